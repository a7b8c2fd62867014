"""The local backend's transport: mailboxes between pipeline devices of one process.

Every pipeline device of the local backend is a mesh of JAX devices of this process, and a
transfer is a copy to the receiver's mesh that keeps each array's sharding (spec)
(:func:`resharder`), dispatched as the value is sent: JAX queues the copy behind the program
that computes the value and the receiver's programs behind the copy, so nothing waits.
Pipeline devices that share their JAX devices but are dispatched apart (a step dispatched
action by action, as on devices of their own: ``RunOptions(fuse="off")``, or recorded) copy
their values too, as separate devices would. The devices of a step share one
:class:`LocalExchange` of mailboxes, each device's end of it a :class:`LocalTransport` (a
:class:`~pipedsl.executor.runtime.transport.Transport`); the exchange answers the devices'
receives for the scheduler (a :class:`~pipedsl.executor.runtime.scheduler.Mail`).

Between two CPU devices of one process (``RunOptions.host_transfers``, the default) a
program buffer that is already computed when it is received goes through host memory
instead: the receiver takes the sender's arrays as host arrays (views, no copy), and the
stage program that reads them copies them in as it is dispatched. A ``jax.device_put`` from
one CPU device to another costs a hundred microseconds or more of host time whatever the
size (jaxlib 0.10, a 64-byte array: 70 to 280 us here), a jitted call's host arguments
about ten. A value still being computed is waited for (:class:`Handoff`), never copied: a
stage program compiles once for host arguments and once more for device arrays, so a
buffer that came one way in one step and the other way in the next compiled every program
that reads it twice. Accelerators never take this path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.runtime.scheduler import NOTHING, Pending, Receive
from pipedsl.executor.runtime.waits import finished
from pipedsl.program import Buffer

__all__ = ["LocalExchange", "LocalTransport", "Handoff", "resharder"]


def resharder(mesh: Mesh, *, copy: bool = False, by_host: bool = True) -> Callable[..., Any]:
    """A function ``move(value, *, handoff=False)`` that puts a pytree of arrays on
    ``mesh``, each leaf with the spec it has now (a ``NamedSharding``'s spec; anything
    else is replicated). When every leaf is already there (pipeline devices that share
    their JAX devices) nothing is copied or dispatched, unless ``copy``. With ``handoff``
    and ``by_host``, a value that goes from another CPU device to a one-CPU-device mesh is
    wrapped for the receiver to take through host memory, or copy, when it receives it
    (module docstring)."""
    # The target of each source sharding, and the mover of each (tree, shardings), worked
    # out once: a step sends the same few structures over and over.
    targets: dict[Any, NamedSharding] = {}
    movers: dict[Any, Any] = {}
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, PartitionSpec())
    by_host = by_host and mesh.devices.size == 1 and mesh.devices.flat[0].platform == "cpu"

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
        if not copy and all(g is s for g, s in zip(goals, sources, strict=True)):
            return _UNCHANGED
        # One jax.device_put per value. A jitted identity placed by in_shardings copied
        # several times faster, but crashed the process (a segfault inside XLA) when one
        # device thread ran it while another compiled.
        put = partial(_put, goals=goals, copy=copy)
        # Through host memory only from other CPU devices: on its own device a value is
        # copied as devices of their own would copy it (``copy``).
        if handoff and by_host and all(s is not None and _on_one_cpu(s) and s.device_set != devices for s in sources):
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


class Handoff(Pending):
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


def _put(leaves: tuple[Any, ...], *, goals: tuple[NamedSharding, ...], copy: bool) -> Any:
    return jax.device_put(list(leaves), list(goals), may_alias=False if copy else None)


class LocalExchange:
    """The mailboxes shared by the local devices for one step, and the answers to their
    receives (a :class:`~pipedsl.executor.runtime.scheduler.Mail`).

    ``movers[d]`` puts a value on the mesh that pipeline device ``d`` runs on (a
    :func:`resharder`, made once per backend: it caches the target shardings). A value sent
    to ``d`` goes through it asynchronously: the copy is dispatched, and a computation
    that reads the value waits for it. The devices of a step run on one thread
    (:mod:`pipedsl.executor.runtime.scheduler`); the lock keeps the mailboxes whole should a
    caller's other thread look at them.
    """

    def __init__(self, movers: Sequence[Callable[..., Any]]) -> None:
        self.movers = tuple(movers)
        self._lock = threading.Lock()
        self._mail: dict[tuple[Hashable, int], Any] = {}
        self._arrived: list[tuple[Hashable, int]] = []  # since the last arrivals()
        self.failed: int | None = None  # the first device that reported a failure

    def endpoint(self, device: int) -> LocalTransport:
        """Device ``device``'s :class:`~pipedsl.executor.runtime.transport.Transport`."""
        return LocalTransport(self, device)

    def take(self, request: Receive, device: int) -> Any:
        """The value ``device`` asks for, taken; a :class:`Handoff` still being computed as
        it is, for the scheduler to take once it has nothing else to do; ``NOTHING`` if it
        is not sent yet."""
        with self._lock:
            value = self._mail.pop((request.key, device), NOTHING)
        return value.computed() if type(value) is Handoff and value.ready() else value

    def arrivals(self) -> list[tuple[Hashable, int]]:
        """The slots sent since the last call."""
        with self._lock:
            arrived, self._arrived = self._arrived, []
        return arrived

    def fail(self, device: int) -> None:
        """Report that ``device`` failed."""
        with self._lock:
            if self.failed is None:
                self.failed = device

    def put(self, key: tuple[Hashable, int], value: Any) -> None:
        """Leave ``value`` in the mailbox ``key`` (key, receiver)."""
        with self._lock:
            self._mail[key] = value
            self._arrived.append(key)


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
        self._exchange.put((key, dst), moved)

    def abort(self, error: BaseException) -> None:
        # The error itself reaches the caller through the scheduler.
        self._exchange.fail(self._device)
