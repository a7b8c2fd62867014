"""The Ray backend's links: transfers and mailboxes in the actors.

Activations and input gradients, the values of every action, move by JAX's own
transfer servers (:mod:`pipedsl.executor.ray_links`): the sender offers, the receiver
pulls by an id both derive from the step and the buffer, and no actor call is made.
Everything else (a channel's first value, which carries the layout the receiver needs;
shared gradients and parameters; the barrier; every value of a recorded step) is a
``deliver`` call on the peer actor, which runs in another of the peer's threads and
wakes the receive waiting in its :class:`Mailbox`. Those values travel through Ray as
host (numpy) data, shard by shard: an array sharded over the sender's mesh goes as its
distinct shards and is put back together on the receiver's mesh with the same spec (both
meshes have the same ``dp x tp`` shape), so no side ever assembles the whole array; a
replicated array goes once. A device-to-device path on GPUs (NCCL) would be another
:class:`~pipedsl.executor.transport.Transport`, or another kind of link behind this one.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.errors import ExecutionError, PeerFailed, stage_failure
from pipedsl.executor.ray_links import Channel, Layout, Links, channel_of, layout_of, structs, transfer_id
from pipedsl.executor.transport import Inbox, describe_key, helper, never_sent, stopped_waiting, watch
from pipedsl.program import Buffer

__all__ = ["Mailbox", "RayTransport", "to_wire", "from_wire"]

_Index = tuple[tuple[int | None, int | None], ...]


@dataclass(frozen=True, slots=True)
class _Sharded:
    """One array on the wire: its global shape, spec and distinct shards by index."""

    shape: tuple[int, ...]
    spec: PartitionSpec
    shards: dict[_Index, np.ndarray]


def _index(index: tuple[slice, ...]) -> _Index:
    return tuple((s.start, s.stop) for s in index)


def to_wire(value: Any) -> Any:
    """``value`` (a pytree of arrays) as host data, sharded arrays shard by shard."""

    def leaf(x: Any) -> Any:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding) or len(sharding.device_set) == 1:
            return np.asarray(x)
        shards: dict[_Index, np.ndarray] = {}
        for shard in x.addressable_shards:
            key = _index(shard.index)
            if key not in shards:
                shards[key] = np.asarray(shard.data)
        return _Sharded(tuple(x.shape), sharding.spec, shards)

    return jax.tree_util.tree_map(leaf, value)


def from_wire(value: Any, mesh: Mesh) -> Any:
    """:func:`to_wire`'s host data put on ``mesh``: shards where the spec puts them,
    whole arrays replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def leaf(x: Any) -> Any:
        if not isinstance(x, _Sharded):
            return jax.device_put(x, replicated)
        sharding = NamedSharding(mesh, x.spec)
        placed = []
        for device, index in sharding.addressable_devices_indices_map(x.shape).items():
            assert index is not None  # every device of the mesh holds a shard
            placed.append(jax.device_put(x.shards[_index(index)], device))
        return jax.make_array_from_single_device_arrays(x.shape, sharding, placed)

    return jax.tree_util.tree_map(leaf, value, is_leaf=lambda x: isinstance(x, _Sharded))


class Mailbox:
    """Values and failures that arrive at one actor, by step, and the layouts of the
    channels it has learned (see :mod:`pipedsl.executor.ray_links`).

    A step's values wait here until its receives take them; entries of earlier steps are
    dropped when a step begins (late deliveries of an aborted step). Keys are ``(step,
    source device, key)``. A layout is learned from any delivery that carries one, of
    whatever step, with that step: the sender sends a channel's later values by transfer
    either way, but only a channel learned in an earlier step has all of a step's values
    come by transfer.
    """

    def __init__(self, learned: dict[Channel, Any]) -> None:
        self._cond = threading.Condition()
        self._step = -1
        self._mail: dict[tuple[int, int, Hashable], Any] = {}
        self._failed: dict[int, str] = {}
        self._learned = learned

    def begin(self, step: int) -> None:
        with self._cond:
            self._step = step
            self._mail = {k: v for k, v in self._mail.items() if k[0] >= step}
            self._failed = {s: m for s, m in self._failed.items() if s >= step}

    def put(self, step: int, src: int, key: Hashable, value: Any, *, learn: tuple[Channel, Any] | None = None) -> None:
        with self._cond:
            if learn is not None:
                self._learned[learn[0]] = (step, learn[1])
            if step >= self._step:
                self._mail[(step, src, key)] = value
            self._cond.notify_all()

    def fail(self, step: int, message: str) -> None:
        with self._cond:
            self._failed.setdefault(step, message)
            self._cond.notify_all()

    def take(self, step: int, src: int, key: Hashable, *, me: int, timeout: float, channel: Channel | None = None) -> Any:
        """The value ``key`` from device ``src``, waiting at most ``timeout`` seconds; or,
        with a ``channel`` whose layout is known (the value then comes by transfer), a
        :class:`_Pull` of what to pull, unless the value is here already."""
        slot = (step, src, key)
        learned = self._learned

        def by_transfer() -> tuple[jax.ShapeDtypeStruct, ...] | None:
            found = learned.get(channel) if channel is not None else None
            return None if found is None else found[1]

        def ready() -> bool:
            return slot in self._mail or step in self._failed or by_transfer() is not None

        with self._cond:
            arrived = self._cond.wait_for(ready, timeout=timeout)
            if slot in self._mail:
                return self._mail.pop(slot)
            wanted = by_transfer()
            if wanted is not None:
                return _Pull(wanted)
            if not arrived:
                raise never_sent(me, key, src, timeout)
            raise stopped_waiting(me, key, src, self._failed[step])

    def failure(self, step: int) -> str | None:
        """Why ``step`` failed elsewhere, or None while it has not."""
        with self._cond:
            return self._failed.get(step)


@dataclass(frozen=True, slots=True)
class _Pull:
    """A receive that is to pull arrays of these shapes and shardings."""

    structs: tuple[jax.ShapeDtypeStruct, ...]


class RayTransport:
    """Device ``device``'s end of the links for one step of pipeline ``pipeline`` (its
    key and model id), whose mesh is ``mesh`` (implements
    :class:`~pipedsl.executor.transport.Transport`).

    Activations and input gradients go by transfer (:mod:`pipedsl.executor.ray_links`)
    once their channel's layout has been announced; everything else, a channel's first
    value and every value of a ``recording`` step (so that each send can be timed to its
    arrival) is a ``deliver`` call on the peer actor, waking the receive in its
    :class:`Mailbox`.

    A send returns at once. A value by transfer is offered right away (the server sends
    it once computed) and then handed to a sender thread that waits for it, so that a
    failed computation is reported as its stage's failure; a value by actor call is
    handed to that thread to be computed, copied to host memory and given to Ray. The
    thread (a kept helper, :func:`~pipedsl.executor.transport.helper`) keeps the order of
    what it is given; :meth:`finish` waits for it at the end of the step.

    Receives by transfer are pulled ahead, in the order of the program's receives
    (``expected``), at most :data:`_AHEAD` pending, so that a value moves as soon as it
    is offered; a receive then waits for its arrays. That wait ends when the value
    arrives, when the peer offers an error in its place (on a failure, :meth:`abort`
    offers one for every value this device would still have sent by transfer,
    ``planned``), when the peer's process is gone, when the step fails anywhere (the
    abort reaches this device's mailbox), or after the receive timeout, as a wait in the
    mailbox does.
    """

    __slots__ = (
        "device",
        "step",
        "_mailbox",
        "_peers",
        "_links",
        "_mesh",
        "_pipeline",
        "_planned",
        "_recording",
        "_timeout",
        "_aborted",
        "_sender",
        "_error",
        "_lock",
        "_offered",
        "_ahead",
        "_next",
        "_pulled",
    )

    def __init__(
        self,
        device: int,
        step: int,
        mailbox: Mailbox,
        peers: Sequence[Any],
        links: Links,
        *,
        mesh: Mesh,
        pipeline: tuple[int, int],
        planned: Sequence[tuple[Hashable, int]],
        expected: Sequence[tuple[Hashable, int]],
        recording: bool,
        timeout: float,
    ) -> None:
        self.device = device
        self.step = step
        self._mailbox = mailbox
        self._peers = peers
        self._links = links
        self._mesh = mesh
        self._pipeline = pipeline
        self._planned = planned
        self._recording = recording
        self._timeout = timeout
        self._aborted = False
        self._sender: Inbox | None = None
        self._error: ExecutionError | None = None
        self._lock = threading.Lock()
        self._offered: set[tuple[Hashable, int]] = set()  # (key, receiver), sent by either path
        # The receives that come by transfer this step: those whose channel's layout was
        # learned in an earlier step, so that the sender sends every value of this step
        # by transfer. A channel learned in this step (its first value may have arrived
        # before this step began here) is looked up in the mailbox at each receive.
        self._ahead: list[tuple[Buffer, int, tuple[jax.ShapeDtypeStruct, ...]]] = []
        if not recording:
            for key, src in expected:
                channel = channel_of(*pipeline, src, device, key)
                known = links.learned.get(channel) if channel is not None else None
                if known is not None and known[0] < step and known[1] is not None:
                    assert isinstance(key, Buffer)  # only program buffers have channels
                    self._ahead.append((key, src, known[1]))
        self._next = 0  # the first of _ahead not pulled yet
        self._pulled: dict[tuple[Hashable, int], tuple[Any, ...] | None] = {
            (key, src): None for key, src, _ in self._ahead
        }
        self._pull_ahead(_AHEAD)

    def send(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        if self._error is not None:
            raise self._error
        if wait:
            self._deliver(key, value, dst, stage=stage, wait=True)
            return
        offered = self._offer(key, value, dst, stage=stage)
        if self._sender is None:
            self._sender = helper()
        self._sender.put(partial(self._send_queued, key, value, dst, stage, offered))

    def _send_queued(self, key: Hashable, value: Any, dst: int, stage: int | None, offered: bool) -> None:
        if self._error is not None:
            return  # the step has failed: what is still queued is dropped
        try:
            if offered:
                _computed(value, stage, self.device, key)
            elif not self._offer(key, value, dst, stage=stage):
                self._deliver(key, value, dst, stage=stage)
        except ExecutionError as err:
            self._error = err
            self.abort(err)
        except Exception as err:  # anything else Ray or the transfer raises while handing the value over
            self._error = ExecutionError(f"device {self.device} could not send {key}: {err}", device=self.device)
            self.abort(err)

    def finish(self, failure: ExecutionError | None = None) -> ExecutionError | None:
        """Wait for the queued sends (at most the receive timeout); return the step's
        failure: the sender's own, which caused any other, else ``failure``."""
        if self._sender is not None:
            sent = threading.Event()
            self._sender.put(sent.set)
            self._sender.put(None)
            if not sent.wait(timeout=self._timeout) and self._error is None:
                self._error = ExecutionError(
                    f"device {self.device}'s sends did not finish within {self._timeout:g} s", device=self.device
                )
            self._sender = None
        return self._error or failure

    def recv(self, key: Hashable, src: int, *, timeout: float) -> Any:
        if self._error is not None:
            raise self._error
        me, step = self.device, self.step
        slot = (key, src)
        if slot in self._pulled:
            while self._pulled[slot] is None:
                self._pull_ahead(1)
            arrays = self._pulled.pop(slot)
            self._pull_ahead(1)  # keeps _AHEAD pending
            return self._arrived(key, src, arrays, timeout=timeout)
        channel = None if self._recording else channel_of(*self._pipeline, src, me, key)
        got = self._mailbox.take(step, src, key, me=me, timeout=timeout, channel=channel)
        if isinstance(got, _Pull):
            # The channel's first value came during this step: pull this one now.
            assert isinstance(key, Buffer)  # only program buffers have channels
            return self._arrived(key, src, self._pull(key, src, got.structs), timeout=timeout)
        return got

    def _pull(self, key: Buffer, src: int, wanted: tuple[jax.ShapeDtypeStruct, ...]) -> tuple[Any, ...]:
        # Returns at once: the arrays fill in when the peer offers them.
        return tuple(self._links.connection(src).pull(transfer_id(self.step, self.device, key), list(wanted)))

    def _pull_ahead(self, count: int) -> None:
        """Pull the next ``count`` receives of ``_ahead``."""
        ahead = self._ahead
        for _ in range(count):
            if self._next >= len(ahead):
                return
            key, src, wanted = ahead[self._next]
            self._next += 1
            self._pulled[(key, src)] = self._pull(key, src, wanted)

    def _arrived(self, key: Hashable, src: int, arrays: Any, *, timeout: float) -> tuple[Any, ...]:
        """``arrays`` pulled from ``src``, once there; an error offered in their place
        (or the peer's server gone) is the peer's failure. Waits at most ``timeout``
        seconds, and no longer than the step lives: a pull cannot be cancelled, and one
        whose value never comes would otherwise hold this device past an abort."""
        if not _ready(arrays):
            arrived = watch(arrays)
            deadline = time.monotonic() + timeout
            while not arrived.wait(_LOOK):
                why = self._mailbox.failure(self.step)
                if why is not None:
                    raise stopped_waiting(self.device, key, src, why)
                if time.monotonic() > deadline:
                    raise never_sent(self.device, key, src, timeout)
        try:
            return jax.block_until_ready(arrays)
        except Exception as err:  # the peer offered an error, or its server went away
            raise PeerFailed(
                f"device {self.device} could not receive {describe_key(key)} from device {src}: {_first_line(err)}",
                device=self.device,
            ) from err

    def abort(self, error: BaseException) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            unsent = [(key, dst) for key, dst in self._planned if (key, dst) not in self._offered]
        message = f"device {self.device} failed"
        self._mailbox.fail(self.step, message)
        for d, peer in enumerate(self._peers):
            if d != self.device:
                peer.abort.remote(self.step, self.device, message)
        if self._recording:
            return
        from jax.experimental import transfer

        for key, dst in unsent:
            channel = channel_of(*self._pipeline, self.device, dst, key)
            layout = self._links.announced.get(channel) if channel is not None else None
            if layout is None:
                continue  # the peer waits in its mailbox, which the abort wakes
            assert isinstance(key, Buffer)
            errors = [transfer.make_error_array(s, message) for s in structs(layout, self._mesh)]
            self._links.server.await_pull(transfer_id(self.step, dst, key), errors, timeout=self._deadline())

    def _offer(self, key: Hashable, value: Any, dst: int, *, stage: int | None) -> bool:
        """Offer ``value`` to device ``dst`` by transfer when its channel's layout has been
        announced (else return False: it goes as an actor call)."""
        if self._recording:
            return False
        channel = channel_of(*self._pipeline, self.device, dst, key)
        layout = self._links.announced.get(channel) if channel is not None else None
        if layout is None:
            return False
        assert isinstance(key, Buffer)
        found = layout_of(value)
        if found != layout:
            value = self._conform(key, value, dst, found, layout, stage=stage)
        with self._lock:
            if self._aborted:
                return True
            self._offered.add((key, dst))
        self._links.server.await_pull(transfer_id(self.step, dst, key), list(value), timeout=self._deadline())
        return True

    def _conform(
        self, key: Hashable, value: Any, dst: int, found: Layout | None, layout: Layout, *, stage: int | None
    ) -> tuple[Any, ...]:
        """``value`` placed as its channel's first value was (the receiver pulls that
        layout): a value may come with another sharding than the first, say an input
        passed through; other shapes or dtypes are an error."""
        if found is None or [leaf[:2] for leaf in found] != [leaf[:2] for leaf in layout]:
            raise ExecutionError(
                f"device {self.device} sent {key} to device {dst} with other shapes or dtypes than the first "
                f"such value's ({found} against {layout})",
                stage=stage,
                device=self.device,
            )
        return tuple(jax.device_put(x, NamedSharding(self._mesh, spec)) for x, (_, _, spec) in zip(value, layout, strict=True))

    def _deliver(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        """Hand ``value`` to device ``dst`` as an actor call (with the layout, on a
        channel's first value); with ``wait``, return only once it has arrived."""
        channel = channel_of(*self._pipeline, self.device, dst, key)
        learn = None if channel is None else (channel, layout_of(value))
        # To host memory first: Ray moves numpy arrays without copying them again. This is
        # where an asynchronous computation's error surfaces, so it is blamed on its stage.
        host = _computed(value, stage, self.device, key, to_host=True)
        with self._lock:
            self._offered.add((key, dst))
        ref = self._peers[dst].deliver.remote(self.step, self.device, key, host, learn=learn)
        if learn is not None:
            self._links.announced.setdefault(learn[0], learn[1])
        if wait:
            import ray

            ray.get(ref, timeout=self._timeout)

    def _deadline(self) -> datetime.datetime:
        # When the server drops an offer nobody pulled (the receiver failed first): a
        # receiver may legitimately lag far behind its sender, so well past one wait.
        return datetime.datetime.now() + datetime.timedelta(seconds=_OFFER_WAITS * self._timeout)


# Pulls a receiving device keeps pending ahead of its program: a value whose pull is
# pending moves the moment its sender offers it.
_AHEAD = 8
# An offer lives this many receive timeouts (see RayTransport._deadline).
_OFFER_WAITS = 4
# How often a receive waiting for a pulled value looks whether the step has failed
# elsewhere, in seconds (the value's arrival itself wakes it at once). The receive waits
# on a helper thread blocked in JAX's own wait, not by looking at the arrays: where the
# actors' computations fill a node's cores, looking takes the CPU from them (with fifty
# looks in a row first and then pauses, a two-actor 1F1B step on two cores took
# 1.44-1.55x the local backend's step; with pauses only, 1.24-1.50x; waiting so,
# 1.13-1.22x). A pull cannot be cancelled, and a helper still in JAX's wait when the
# process ends aborts it; every pull of a step completes, though: with its value, with
# the error its sender's abort offers in its place (:meth:`RayTransport.abort`, run on
# every device of a failed or timed-out step), or when the sender's server goes away.
_LOOK = 0.05
# Seconds between a receive's two looks at a pulled value before it waits on a helper.
_MOMENT = 1e-4


def _ready(arrays: tuple[Any, ...]) -> bool:
    """Whether ``arrays`` have arrived, looking twice, a moment apart: a value nearly
    there (one of a small model's) comes without a hand-over to a helper thread."""
    if all(x.is_ready() for x in arrays):
        return True
    time.sleep(_MOMENT)
    return all(x.is_ready() for x in arrays)


def _computed(value: Any, stage: int | None, device: int, key: Hashable, *, to_host: bool = False) -> Any:
    """Wait for ``value`` (and, ``to_host``, return it as host data, see :func:`to_wire`);
    a failed computation is raised as ``stage``'s failure."""
    try:
        return to_wire(value) if to_host else jax.block_until_ready(value)
    except Exception as err:  # XLA reports a failed computation where its result is read
        if stage is None:
            raise
        raise stage_failure(stage, device, f"computing {key}", err) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
