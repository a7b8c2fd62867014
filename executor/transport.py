"""Moving values between pipeline devices.

A :class:`~pipedsl.executor.worker.Worker` sees one small interface per device,
:class:`Transport`: hand a value to another device under a key (a buffer of the lowered
program, or the worker's own keys for gradient sums and parameter hand-outs), wait for
one from another device (always with a timeout), and tell every peer that this device
failed so that none of them waits in vain. A backend supplies the implementation; this
module holds the one for the local backend, where every pipeline device is a mesh of
JAX devices of the same process and a transfer is a copy to the receiver's mesh that
keeps each array's sharding (spec), and the errors every backend's receives share.

Between two CPU devices of one process a program buffer that is already computed when
it is received goes through host memory instead: the receiver takes the sender's arrays
as host arrays (views, no copy), and the stage program that reads them copies them in as
it is dispatched. A ``jax.device_put`` from one CPU device to another costs a hundred
microseconds or more of host time whatever the size (jaxlib 0.10, a 64-byte array: 70 to
280 µs here), a jitted call's host arguments about ten. A value still being computed is
waited for (:class:`Handoff`), never copied: a stage program compiles once for host
arguments and once more for device arrays, so a buffer that came one way in one step and
the other way in the next compiled every program that reads it twice.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.errors import ExecutionError, PeerFailed
from pipedsl.program import Buffer

__all__ = [
    "Transport",
    "LocalExchange",
    "LocalTransport",
    "resharder",
    "describe_key",
    "never_sent",
    "stopped_waiting",
    "finished",
    "watch",
    "helper",
    "Inbox",
]


class Transport(Protocol):
    """One device's end of the links between pipeline devices."""

    def send(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        """Hand ``value`` (a pytree of arrays, computed by ``stage`` or by none) to device
        ``dst`` as ``key``.

        Returns at once unless ``wait``; then only once the value has arrived (used when
        timing, so that the transfer's end can be recorded).
        """
        ...

    def recv(self, key: Hashable, src: int, *, timeout: float) -> Any:
        """Wait at most ``timeout`` seconds for ``key`` from device ``src``.

        Raises :class:`ExecutionError` on timeout and :class:`PeerFailed` as soon as any
        device has reported a failure.
        """
        ...

    def abort(self, error: BaseException) -> None:
        """Report that this device failed with ``error``; wakes every waiting peer."""
        ...


def resharder(mesh: Mesh) -> Callable[..., Any]:
    """A function ``move(value, *, handoff=False)`` that puts a pytree of arrays on
    ``mesh``, each leaf with the spec it has now (a ``NamedSharding``'s spec; anything
    else is replicated). When every leaf is already there (pipeline devices that share
    their JAX devices) nothing is copied or dispatched. With ``handoff``, a value that
    goes from another CPU device to a one-CPU-device mesh is wrapped for the receiver to
    take through host memory, or copy, when it receives it (module docstring)."""
    # The target of each source sharding, and the mover of each (tree, shardings), worked
    # out once: a step sends the same few structures over and over.
    targets: dict[Any, NamedSharding] = {}
    movers: dict[Any, Any] = {}
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, PartitionSpec())
    by_host = mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu"

    def target(sharding: Any) -> NamedSharding:
        found = targets.get(sharding)
        if found is None:
            if not isinstance(sharding, NamedSharding):
                found = replicated
            elif sharding.device_set == devices and sharding.mesh.devices.shape == mesh.devices.shape:
                found = sharding
            else:
                found = NamedSharding(mesh, sharding.spec)
            targets[sharding] = found
        return found

    def move(value: Any, *, handoff: bool = False) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(value)
        key = (treedef, handoff, *[getattr(v, "sharding", None) for v in leaves])
        mover: Any = movers.get(key)
        if mover is None:
            mover = movers[key] = mover_of(leaves, handoff)
        if mover is _UNCHANGED:
            return value
        if type(mover) is _ByHost:
            return Handoff(leaves, treedef, mover.put)
        return jax.tree_util.tree_unflatten(treedef, mover(tuple(leaves)))

    def mover_of(leaves: list[Any], handoff: bool) -> Any:
        sources = tuple(getattr(v, "sharding", None) for v in leaves)
        goals = tuple(target(s) for s in sources)
        if all(g is s for g, s in zip(goals, sources, strict=True)):
            return _UNCHANGED
        # One jax.device_put per value. A jitted identity placed by in_shardings copied
        # several times faster, but crashed the process (a segfault inside XLA) when one
        # device thread ran it while another compiled.
        put = partial(_put, goals=goals)
        if handoff and by_host and all(_on_one_cpu(s) for s in sources):
            return _ByHost(put)
        return put

    return move


_UNCHANGED = object()  # the mover of values already where they go


def _on_one_cpu(sharding: Any) -> bool:
    return sharding is not None and len(sharding.device_set) == 1 and next(iter(sharding.device_set)).platform == "cpu"


class _ByHost:
    """The mover of values the receiver may take through host memory; ``put`` copies."""

    __slots__ = ("put",)

    def __init__(self, put: Callable[[tuple[Any, ...]], Any]) -> None:
        self.put = put


class Handoff:
    """A sent value on another CPU device, in the receiver's mailbox, that the receiver
    takes as host arrays."""

    __slots__ = ("leaves", "treedef", "put")

    def __init__(self, leaves: list[Any], treedef: Any, put: Callable[[tuple[Any, ...]], Any]) -> None:
        self.leaves = leaves
        self.treedef = treedef
        self.put = put

    def ready(self) -> bool:
        """Whether every array has been computed (or has failed)."""
        for x in self.leaves:
            if not x.is_ready():
                return False
        return True

    def take(self, timeout: float) -> Any:
        """The value for the receiver as host arrays, once every array is computed (waiting
        at most ``timeout`` seconds); one that did not finish in time is copied to the
        receiver's device, where reading it waits."""
        if self.ready() or finished(self.leaves, timeout):
            return self.computed()
        return self._copied()

    def computed(self) -> Any:
        """The value as host arrays, every array being computed; one whose computation
        failed is copied to the receiver's device, where reading it reports its error."""
        try:
            return self.treedef.unflatten([np.asarray(x) for x in self.leaves])
        except Exception:  # a failed computation: copied, its error is read where it is used
            return self._copied()

    def _copied(self) -> Any:
        return self.treedef.unflatten(self.put(tuple(self.leaves)))


def finished(value: Any, timeout: float) -> bool:
    """Whether every array of ``value`` is computed (or failed) within ``timeout``
    seconds: the wait happens on a helper thread, as JAX's own wait has no bound. Arrays
    computed already need no wait (XLA's CPU client runs small programs as they are
    dispatched: a step's last gradients often are)."""
    try:
        if all(x.is_ready() for x in jax.tree_util.tree_leaves(value) if hasattr(x, "is_ready")):
            return True
    except Exception:  # noqa: S110  # a deleted array: the helper's wait reports it as failed
        pass
    return watch(value).wait(timeout)


def watch(value: Any) -> threading.Event:
    """An event set once every array of ``value`` is computed (or failed), by a helper
    thread: a waiter that must also notice other things (a failure elsewhere, its own
    deadline) waits on the event in slices instead of polling the arrays, which would
    take CPU from the computation it waits for."""
    done = threading.Event()
    inbox = helper()
    inbox.put(partial(_wait, value, done))
    inbox.put(None)
    return done


Inbox = queue.SimpleQueue[Callable[[], None] | None]
"""A lent helper thread's work: the calls it is to make, in order; None gives it back."""


def helper() -> Inbox:
    """A helper thread, lent until None is put in its inbox: it makes the calls put there
    in order, then goes back to the idle helpers. Helpers are kept between uses: a thread
    started per use cost 0.1 to 1 ms of the step (more on a loaded machine), and every
    device waits or sends several times per step (a Ray step of a tiny model took 0.5-1.3
    ms less of its 10-16 ms once each actor's sender was a kept helper). A helper whose
    call never returns is never given back; the next use gets another."""
    with _IDLE_LOCK:
        inbox = _IDLE.pop() if _IDLE else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(inbox,), name="pipedsl-helper", daemon=True).start()
    return inbox


_IDLE_LOCK = threading.Lock()
_IDLE: list[Inbox] = []


def _serve(inbox: Inbox) -> None:
    while True:
        while (call := inbox.get()) is not None:
            call()
            del call  # keeps no value alive while idle
        with _IDLE_LOCK:
            _IDLE.append(inbox)


def _wait(value: Any, done: threading.Event) -> None:
    try:
        jax.block_until_ready(value)
    except Exception:  # noqa: S110  # the caller's own wait reports it, blamed on its stage
        pass
    finally:
        done.set()


def _put(leaves: tuple[Any, ...], *, goals: tuple[NamedSharding, ...]) -> Any:
    return jax.device_put(list(leaves), list(goals))


def describe_key(key: Hashable) -> str:
    """A transport key in words: a program buffer as the lowered program writes it, the
    worker's own keys for what they carry."""
    if isinstance(key, tuple) and key and key[0] == "grad":
        return f"the gradient of leaf {key[2]} from stage {key[1]}"
    if isinstance(key, tuple) and key and key[0] == "param":
        return f"the updated leaf {key[2]}"
    if isinstance(key, tuple) and key and key[0] == "done":
        return "the end of its program"
    return str(key)


def never_sent(me: int, key: Hashable, src: int, timeout: float) -> ExecutionError:
    """The error of a receive that waited its whole timeout."""
    return ExecutionError(
        f"device {me} waited {timeout:g} s for {describe_key(key)} from device {src}, which never sent "
        "it; raise recv_timeout if stages really take that long",
        device=me,
    )


def stopped_waiting(me: int, key: Hashable, src: int, why: str) -> PeerFailed:
    """The error of a receive ended by a failure elsewhere (``why``)."""
    return PeerFailed(f"device {me} stopped waiting for {describe_key(key)} from device {src}: {why}", device=me)


class LocalExchange:
    """The mailboxes shared by the local devices for one step.

    ``movers[d]`` puts a value on the mesh that pipeline device ``d`` runs on (a
    :func:`resharder`, made once per backend: it caches the target shardings). A value sent
    to ``d`` goes through it asynchronously: the copy is dispatched, and a computation
    that reads the value waits for it.
    """

    NOTHING = object()  # what :meth:`poll` returns for a value not sent yet

    def __init__(self, movers: Sequence[Callable[..., Any]]) -> None:
        self.movers = tuple(movers)
        # Taking and putting mail holds the lock only; a receive on a thread of its own
        # waits on the condition, which a put wakes only when some receive waits.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiting = 0
        self._mail: dict[tuple[Hashable, int], Any] = {}
        self._arrived: list[tuple[Hashable, int]] = []  # since the last arrivals()
        self._failed: int | None = None  # the first device that reported a failure

    def endpoint(self, device: int) -> LocalTransport:
        """Device ``device``'s :class:`Transport`."""
        return LocalTransport(self, device)

    def poll(self, slot: tuple[Hashable, int]) -> Any:
        """The value sent as ``slot`` (key, receiver), taken, or :attr:`NOTHING`; a
        :class:`Handoff` still being computed is returned as it is, for the caller to
        take once it has nothing else to do."""
        with self._lock:
            value = self._mail.pop(slot, self.NOTHING)
        return value.computed() if type(value) is Handoff and value.ready() else value

    def arrivals(self) -> list[tuple[Hashable, int]]:
        """The slots sent since the last call."""
        with self._lock:
            arrived, self._arrived = self._arrived, []
        return arrived

    def fail(self, device: int) -> None:
        """Report that ``device`` failed: every wait ends."""
        with self._lock:
            if self._failed is None:
                self._failed = device
            self._changed.notify_all()

    def _put(self, key: tuple[Hashable, int], value: Any) -> None:
        with self._lock:
            self._mail[key] = value
            self._arrived.append(key)
            if self._waiting:
                self._changed.notify_all()

    def _take(self, key: tuple[Hashable, int], me: int, src: int, timeout: float) -> Any:
        with self._lock:
            value = self._mail.pop(key, self.NOTHING)
            if value is not self.NOTHING:
                return value
            self._waiting += 1
            try:
                arrived = self._changed.wait_for(lambda: key in self._mail or self._failed is not None, timeout=timeout)
            finally:
                self._waiting -= 1
            if key in self._mail:
                return self._mail.pop(key)
            if not arrived:
                raise never_sent(me, key[0], src, timeout)
            raise stopped_waiting(me, key[0], src, f"device {self._failed} failed")


class LocalTransport:
    """Device ``device``'s end of a :class:`LocalExchange` (implements :class:`Transport`)."""

    __slots__ = ("_exchange", "_device")

    def __init__(self, exchange: LocalExchange, device: int) -> None:
        self._exchange = exchange
        self._device = device

    def send(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        # Only program buffers may go through the host: the stage programs that read them
        # take host arrays; parameters and gradients are kept on devices.
        if wait:
            jax.block_until_ready(value)
        moved = self._exchange.movers[dst](value, handoff=isinstance(key, Buffer))
        if wait and not isinstance(moved, Handoff):  # a hand-over of computed arrays copies nothing
            jax.block_until_ready(moved)
        self._exchange._put((key, dst), moved)

    def recv(self, key: Hashable, src: int, *, timeout: float) -> Any:
        value = self._exchange._take((key, self._device), self._device, src, timeout)
        return value.take(timeout) if isinstance(value, Handoff) else value

    def abort(self, error: BaseException) -> None:
        # The error itself reaches the caller through the failing device's thread.
        self._exchange.fail(self._device)
