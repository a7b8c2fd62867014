"""The local backend's transport: mailboxes between pipeline devices of one process.

Every pipeline device of the local backend is a mesh of JAX devices of this process, and a
transfer is a copy to the receiver's mesh that keeps each array's sharding (spec)
(:func:`resharder`); values that stay on the same devices move nowhere. The devices of a
step share one :class:`LocalExchange` of mailboxes, each device's end of it a
:class:`LocalTransport` (a :class:`~pipedsl.executor.runtime.transport.Transport`).

Between two CPU devices of one process a program buffer that is already computed when
it is received goes through host memory instead: the receiver takes the sender's arrays
as host arrays (views, no copy), and the stage program that reads them copies them in as
it is dispatched. A ``jax.device_put`` from one CPU device to another costs a hundred
microseconds or more of host time whatever the size (jaxlib 0.10, a 64-byte array: 70 to
280 µs here), a jitted call's host arguments about ten. A value still being computed is
waited for (:class:`Handoff`), never copied: a stage program compiles once for host
arguments and once more for device arrays, so a buffer that came one way in one step and
the other way in the next compiled every program that reads it twice. Accelerators never
take this path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.runtime.transport import never_sent, stopped_waiting
from pipedsl.executor.runtime.waits import finished
from pipedsl.program import Buffer

__all__ = ["LocalExchange", "LocalTransport", "Handoff", "resharder"]


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


def _put(leaves: tuple[Any, ...], *, goals: tuple[NamedSharding, ...]) -> Any:
    return jax.device_put(list(leaves), list(goals))


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
        """Device ``device``'s :class:`~pipedsl.executor.runtime.transport.Transport`."""
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
    """Device ``device``'s end of a :class:`LocalExchange` (implements :class:`~pipedsl.executor.runtime.transport.Transport`)."""

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
