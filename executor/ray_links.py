"""The Ray backend's fast path between actors: JAX's own transfer servers.

Every device actor runs a ``jax.experimental.transfer`` server on its node's address
(127.0.0.1 on an instance pipedsl started). An activation or input gradient of the
lowered program (:class:`~pipedsl.program.Buffer` of kind ``ACTIVATION`` or
``GRADIENT``) is offered by its sender with ``await_pull`` under a number both sides
derive from the step, the receiver and the buffer (:func:`transfer_id`), and the
receiver pulls it by that number when its program reaches the receive: the programs are
static, so no message announces a value, and the arrays go from one process's devices to
the other's without Ray's object store or an actor call.

A receiver must know what it pulls (shapes, dtypes, shardings). It learns that once per
*channel* (pipeline, model, sender, receiver, buffer kind, stage): the first value of a
channel travels as an actor call that carries its layout (:func:`layout_of`), and every
later one by transfer. :class:`Links` keeps, per actor, the server, its connections and
what it has announced and learned.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.program import Buffer, BufferKind

__all__ = ["Channel", "Layout", "Links", "channel_of", "layout_of", "structs", "transfer_id"]

# (pipeline, model id, sender, receiver, kind code, stage): values of one channel share
# their layout.
Channel = tuple[int, int, int, int, int, int]
# Per leaf of a tuple of arrays: (shape, dtype name, PartitionSpec on the mesh).
Layout = tuple[tuple[tuple[int, ...], str, PartitionSpec], ...]

_KINDS = {BufferKind.ACTIVATION: 0, BufferKind.GRADIENT: 1}
# Bits of a transfer id, low to high: microbatch, stage, kind, receiver, step (the step
# wraps: an id is reused only 2**27 steps later, long after any offer of it expired).
_MICROBATCH, _STAGE, _RECEIVER, _STEP = 1 << 16, 1 << 10, 1 << 8, 1 << 27


def channel_of(pipeline: int, model: int, src: int, dst: int, key: Any) -> Channel | None:
    """The channel of value ``key`` from device ``src`` to ``dst``, or None when it always
    travels as an actor call (not an activation or input gradient of the program, or
    beyond the numbers a transfer id holds)."""
    if type(key) is not Buffer:
        return None
    kind = _KINDS.get(key.kind)
    if kind is None or dst >= _RECEIVER or key.stage >= _STAGE or key.microbatch >= _MICROBATCH:
        return None
    return (pipeline, model, src, dst, kind, key.stage)


def transfer_id(step: int, dst: int, key: Buffer) -> int:
    """The number under which the sender offers ``key`` of ``step`` to device ``dst``
    (unique per sender; only for keys that have a channel)."""
    kind = _KINDS[key.kind]
    return ((((step % _STEP) * _RECEIVER + dst) * 2 + kind) * _STAGE + key.stage) * _MICROBATCH + key.microbatch


def layout_of(value: Any) -> Layout | None:
    """The layout of ``value`` when it can go by transfer (a tuple of JAX arrays, each
    with a ``NamedSharding``), else None. Specs are written in one form (mesh axes of
    size 1 and trailing Nones left out), so that equal placements compare equal."""
    if type(value) is not tuple or not value:
        return None
    leaves = []
    for x in value:
        sharding = getattr(x, "sharding", None)
        if not isinstance(x, jax.Array) or not isinstance(sharding, NamedSharding):
            return None
        leaves.append((tuple(x.shape), x.dtype.name, _plain(sharding.spec, sharding.mesh.shape)))
    return tuple(leaves)


def _plain(spec: PartitionSpec, sizes: Any) -> PartitionSpec:
    def entry(names: Any) -> Any:
        kept = tuple(n for n in (names if isinstance(names, tuple) else (names,)) if n is not None and sizes[n] > 1)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    entries = [entry(e) for e in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


class Links:
    """One actor's transfer server on ``host`` (an IP address), its connections to the
    peers' servers, and the layouts of the channels it has announced (as the sender)
    and learned (as the receiver).

    ``announced`` is only touched by the actor's own step (its sender thread);
    ``learned`` is written by deliveries and read by receives, under the mailbox's lock.
    """

    def __init__(self, host: str) -> None:
        from jax.experimental import transfer

        client = jax.local_devices()[0].client
        self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self.address: str = self.server.address()
        self.announced: dict[Channel, Layout | None] = {}
        # Per channel: the step whose delivery taught it, and what to pull (None: its
        # values cannot go by transfer).
        self.learned: dict[Channel, tuple[int, tuple[jax.ShapeDtypeStruct, ...] | None]] = {}
        self._peers: tuple[str, ...] = ()
        self._connections: dict[int, Any] = {}
        self._lock = threading.Lock()

    def meet(self, addresses: tuple[str, ...]) -> None:
        """The transfer servers' addresses of every device, by device."""
        with self._lock:
            self._peers = addresses
            self._connections.clear()

    def connection(self, device: int) -> Any:
        """The connection to device ``device``'s server (made on first use)."""
        with self._lock:
            found = self._connections.get(device)
            if found is None:
                found = self.server.connect(self._peers[device])
                self._connections[device] = found
            return found


def structs(layout: Layout, mesh: Mesh) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What a receiver on ``mesh`` pulls for a value of ``layout`` (the same specs: both
    meshes have the same ``dp x tp`` shape)."""
    return tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)) for shape, dtype, spec in layout)
