"""The Ray backend's links: mailboxes in the actors, and sends as actor calls.

A send is a ``deliver`` call on the peer actor, which runs in another of the peer's
threads and wakes the receive waiting in its :class:`Mailbox`. Values travel through
Ray's object store as host (numpy) data, shard by shard: an array sharded over the
sender's mesh goes as its distinct shards and is put back together on the receiver's
mesh with the same spec (both meshes have the same ``dp x tp`` shape), so no side ever
assembles the whole array; a replicated array goes once. A device-to-device path on
GPUs would be another :class:`~pipedsl.executor.transport.Transport`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.errors import ExecutionError, PeerFailed, stage_failure

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
    """Values and failures that arrive at one actor, by step.

    A step's values wait here until its receives take them; entries of earlier steps are
    dropped when a step begins (late deliveries of an aborted step). Keys are ``(step,
    source device, key)``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._step = -1
        self._mail: dict[tuple[int, int, Hashable], Any] = {}
        self._failed: dict[int, str] = {}

    def begin(self, step: int) -> None:
        with self._cond:
            self._step = step
            self._mail = {k: v for k, v in self._mail.items() if k[0] >= step}
            self._failed = {s: m for s, m in self._failed.items() if s >= step}

    def put(self, step: int, src: int, key: Hashable, value: Any) -> None:
        with self._cond:
            if step >= self._step:
                self._mail[(step, src, key)] = value
                self._cond.notify_all()

    def fail(self, step: int, message: str) -> None:
        with self._cond:
            self._failed.setdefault(step, message)
            self._cond.notify_all()

    def take(self, step: int, src: int, key: Hashable, *, me: int, timeout: float) -> Any:
        """The value ``key`` from device ``src``, waiting at most ``timeout`` seconds."""
        slot = (step, src, key)
        with self._cond:
            arrived = self._cond.wait_for(lambda: slot in self._mail or step in self._failed, timeout=timeout)
            if slot in self._mail:
                return self._mail.pop(slot)
            if not arrived:
                raise ExecutionError(
                    f"device {me} waited {timeout:g} s for {_describe(key)} from device {src}, which never sent "
                    "it; raise recv_timeout if stages really take that long",
                    device=me,
                )
            raise PeerFailed(
                f"device {me} stopped waiting for {_describe(key)} from device {src}: {self._failed[step]}", device=me
            )


def _describe(key: Hashable) -> str:
    if isinstance(key, tuple) and key and key[0] == "grad":
        return f"the gradient of leaf {key[2]} from stage {key[1]}"
    if isinstance(key, tuple) and key and key[0] == "param":
        return f"the updated leaf {key[2]}"
    if key == ("done",):
        return "the end of its program"
    return str(key)


class RayTransport:
    """Device ``device``'s end of the links for one step (implements
    :class:`~pipedsl.executor.transport.Transport`): sends are ``deliver`` calls on the
    peer actors, receives wait in this actor's :class:`Mailbox`.

    A send returns at once: a sender thread waits for the value to be computed, copies
    it to host memory and hands it to Ray, so the device goes on dispatching its next
    actions meanwhile. The thread keeps the order of sends; :meth:`finish` waits for it
    at the end of the step, and a value whose computation failed is reported as its
    stage's failure. Recorded sends (``wait=True``) stay synchronous, to be timed.
    """

    __slots__ = ("device", "step", "_mailbox", "_peers", "_timeout", "_aborted", "_queue", "_sender", "_error")

    def __init__(self, device: int, step: int, mailbox: Mailbox, peers: Sequence[Any], *, timeout: float) -> None:
        self.device = device
        self.step = step
        self._mailbox = mailbox
        self._peers = peers
        self._timeout = timeout
        self._aborted = False
        self._queue: queue.SimpleQueue[tuple[Hashable, Any, int, int | None] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._error: ExecutionError | None = None

    def send(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        if self._error is not None:
            raise self._error
        if wait:
            self._post(key, value, dst, stage=stage, wait=True)
            return
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_queued, name=f"pipedsl-send-{self.device}", daemon=True)
            self._sender.start()
        self._queue.put((key, value, dst, stage))

    def _send_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the step has failed
            key, value, dst, stage = item
            try:
                self._post(key, value, dst, stage=stage)
            except ExecutionError as err:
                self._error = err
                self.abort(err)
            except Exception as err:  # anything else Ray raises while handing the value over
                self._error = ExecutionError(f"device {self.device} could not send {key}: {err}", device=self.device)
                self.abort(err)

    def finish(self, failure: ExecutionError | None = None) -> ExecutionError | None:
        """Wait for the queued sends (at most the receive timeout); return the step's
        failure: the sender's own, which caused any other, else ``failure``."""
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join(timeout=self._timeout)
            if self._sender.is_alive() and self._error is None:
                self._error = ExecutionError(
                    f"device {self.device}'s sends did not finish within {self._timeout:g} s", device=self.device
                )
            self._sender = None
        return self._error or failure

    def recv(self, key: Hashable, src: int, *, timeout: float) -> Any:
        if self._error is not None:
            raise self._error
        return self._mailbox.take(self.step, src, key, me=self.device, timeout=timeout)

    def abort(self, error: BaseException) -> None:
        if self._aborted:
            return
        self._aborted = True
        message = f"device {self.device} failed"
        self._mailbox.fail(self.step, message)
        for d, peer in enumerate(self._peers):
            if d != self.device:
                peer.abort.remote(self.step, self.device, message)

    def _post(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        """Hand ``value`` to device ``dst`` from this thread; with ``wait``, return only
        once it has arrived."""
        # To host memory first: Ray moves numpy arrays without copying them again. This is
        # where an asynchronous computation's error surfaces, so it is blamed on its stage.
        try:
            host = to_wire(value)
        except Exception as err:  # XLA reports a failed computation where its result is read
            if stage is None:
                raise
            raise stage_failure(stage, self.device, f"computing {key}", err) from err
        ref = self._peers[dst].deliver.remote(self.step, self.device, key, host)
        if wait:
            import ray

            ray.get(ref, timeout=self._timeout)
