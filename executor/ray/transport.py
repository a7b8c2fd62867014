"""The Ray backend's transport: every transfer a compiled collective between two stage meshes.

The processes of a pipeline form one ``jax.distributed`` world
(:mod:`pipedsl.executor.ray.cluster`), and every pipeline device's mesh is a set of the
world's JAX devices. A value goes from pipeline device ``a`` to ``b`` as one jitted
``jax.lax.ppermute`` under ``jax.shard_map`` (:class:`Hops`) over the *pair mesh*: axes
``("pair", "data", "tensor")``, ``a``'s mesh at ``pair = 0`` and ``b``'s at ``pair = 1``.
Each leaf keeps its spec: a leaf of shape ``[n, ...]`` with spec ``P(e0, ...)`` on its
mesh is one ``[2n, ...]`` array with spec ``P(("pair", e0), ...)`` on the pair mesh, so
that every device's block *is* its shard, and the sender's processes bring their shards
while the receiver's bring placeholders (zeros, made once). The permutation moves each
device's shard to the device at the same ``(data, tensor)`` place of the other mesh: on
GPUs NCCL device to device, on CPU gloo; nothing goes through Ray. Within one collective,
the leaves of one dtype travel packed in one buffer per device, moved by one permutation
(each is a library call of its own): one way, or both at once where the collective
carries values each way.

A collective waits for both sides (a rendezvous), so each device makes its exchanges in
the one order :func:`pipedsl.rendezvous.exchange_order` gives the program, followed by
the worker's own transfers (summed gradients of shared parameters, updated shared
parameters) in a fixed order (:func:`worker_exchanges`). Consecutive exchanges between
the same two devices that both have ready go as one collective, in both directions at
once (:func:`pipedsl.rendezvous.exchange_groups`). A :class:`WorldTransport` makes a
group as soon as the device has computed every value it sends in it, and a group in which
it only receives when it needs the value (or at the step's end), always in that order.

What each transfer carries (shapes, dtypes, specs) is known to both sides from the model
(:func:`signatures`), so no value's first arrival has to announce its layout.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.runtime.scheduler import Receive
from pipedsl.executor.stages.mesh import DATA, StageLayout
from pipedsl.executor.stages.model import StagedModel
from pipedsl.program import Buffer, BufferKind
from pipedsl.rendezvous import Exchange

__all__ = [
    "Signature",
    "Hops",
    "Transfer",
    "WorldTransport",
    "signatures",
    "worker_exchanges",
    "worker_groups",
    "Pieces",
    "addressable_pieces",
    "assemble",
    "PAIR",
]

PAIR = "pair"

# Per leaf: (global shape, dtype, spec on its stage mesh).
Signature = tuple[tuple[tuple[int, ...], Any, PartitionSpec], ...]


def worker_exchanges(model: StagedModel, placement: Sequence[int], *, update: bool) -> tuple[Exchange, ...]:
    """The worker's transfers after the program (:mod:`pipedsl.executor.runtime.worker`), in the
    order every device makes them: the gradient of every shared leaf to its owner, then,
    with an optimizer ``update``, the updated leaf back to each device that uses it. All
    of them are sent before any is received, so any fixed order is deadlock-free."""
    grads, params = [], []
    for s in range(model.num_stages):
        for i in model.stage_params[s]:
            owner, user = placement[model.owner[i]], placement[s]
            if owner != user:
                grads.append(Exchange(("grad", s, i), user, owner))  # type: ignore[arg-type]  # worker keys
                params.append(Exchange(("param", s, i), owner, user))  # type: ignore[arg-type]
    return tuple(grads) + (tuple(params) if update else ())


def worker_groups(model: StagedModel, placement: Sequence[int], *, update: bool) -> tuple[tuple[Exchange, ...], ...]:
    """:func:`worker_exchanges` in groups of one collective each: the consecutive ones
    between the same two devices, gradients and updated parameters apart (a device sends
    an updated leaf only once it has received every gradient)."""
    grads = worker_exchanges(model, placement, update=False)
    params = worker_exchanges(model, placement, update=update)[len(grads) :]
    return _runs(grads) + _runs(params)


def _runs(exchanges: Sequence[Exchange]) -> tuple[tuple[Exchange, ...], ...]:
    runs: list[list[Exchange]] = []
    for e in exchanges:
        if runs and {runs[-1][0].src, runs[-1][0].dst} == {e.src, e.dst}:
            runs[-1].append(e)
        else:
            runs.append([e])
    return tuple(tuple(run) for run in runs)


def signatures(
    model: StagedModel, mesh: Mesh, specs: Sequence[PartitionSpec], *, zero: int
) -> Callable[[Hashable], Signature]:
    """What each transfer key carries, for meshes shaped like ``mesh`` (every pipeline
    device's mesh has the same ``dp x cp x tp`` shape, ``cp = 1`` on Ray): activations and input gradients as the
    stage programs place them (axis 0 over ``"data"``, see
    :class:`~pipedsl.executor.stages.mesh.StageLayout.batch`), shared gradients and parameters
    as the stages keep them."""
    dp = mesh.shape[DATA]
    found: dict[Hashable, Signature] = {}

    def batch(avals: Sequence[Any]) -> Signature:
        out = []
        for a in avals:
            shape = (a.shape[0] * dp, *a.shape[1:]) if a.shape else ()
            split = bool(shape) and shape[0] % dp == 0
            out.append((shape, a.dtype, PartitionSpec(DATA) if split else PartitionSpec()))
        return tuple(out)

    def leaf(i: int, *, kept: bool) -> Signature:
        aval = model.param_avals[i]
        layout = StageLayout(mesh, [specs[i]], [aval], zero=zero, leaves=(i,))
        sharding = layout.params[0] if kept else layout.grads[0]
        return ((tuple(aval.shape), aval.dtype, sharding.spec),)

    def signature(key: Hashable) -> Signature:
        sig = found.get(key)
        if sig is None:
            if isinstance(key, Buffer):
                if key.kind is BufferKind.ACTIVATION:
                    sig = batch(model.input_avals[key.stage + 1])
                else:
                    floats = [a for a in model.input_avals[key.stage] if jnp.issubdtype(a.dtype, jnp.inexact)]
                    sig = batch(floats)
            else:
                assert isinstance(key, tuple)  # the worker's ("grad" | "param", stage, leaf)
                what, _, i = key
                sig = leaf(int(i), kept=what == "param")
            found[key] = sig
        return sig

    return signature


# One transfer of a group as :meth:`Hops.exchange` takes it: (source device, destination
# device, what it carries, the leaves where this process sends them, else None).
Transfer = tuple[int, int, Signature, Sequence[Any] | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Leaf:
    """One leaf of a transfer as :meth:`Hops.exchange` moves it: its global shape and
    dtype, its sharding on the source's and on the destination's mesh, its sharding and
    shape on the pair mesh, and how many of its blocks this process brings or receives."""

    shape: tuple[int, ...]
    dtype: Any
    source: NamedSharding
    target: NamedSharding
    pair: NamedSharding
    pair_shape: tuple[int, ...]
    pieces: int


@dataclass(frozen=True, slots=True)
class _Plan:
    """The compiled collective of one shape of group, per transfer its leaves, and per
    transfer this process receives the placeholders it brings (empty where it sends)."""

    program: Callable[..., Any]
    leaves: tuple[tuple[_Leaf, ...], ...]
    placeholders: tuple[tuple[Any, ...], ...]


class Hops:
    """The compiled point-to-point programs of one process between pipeline devices'
    ``meshes`` (see the module docstring): :meth:`exchange` makes several transfers
    between two devices, in either direction, as one collective."""

    def __init__(self, meshes: Sequence[Mesh]) -> None:
        self.meshes = tuple(meshes)
        self._pairs: dict[tuple[int, int], Mesh] = {}
        self._plans: dict[Hashable, _Plan] = {}
        # Per (pair, destination, signature), the pair-mesh arrays whose blocks on the
        # destination's devices are zeros: what a receiving process brings, made once.
        self._placeholders: dict[tuple[int, int, int, Signature], tuple[Any, ...]] = {}
        self._mine: dict[int, set[Any]] = {}

    def move(self, src: int, dst: int, signature: Signature, value: Sequence[Any] | None) -> tuple[Any, ...] | None:
        """One transfer (:meth:`exchange` of one)."""
        return self.exchange(((src, dst, signature, value),))[0]

    def exchange(self, transfers: Sequence[Transfer]) -> list[tuple[Any, ...] | None]:
        """Make ``transfers`` (all between the same two pipeline devices) as one compiled
        collective: every process of both meshes calls it with the same transfers, in the
        same order, bringing the leaves of those it sends (on the source's mesh). Returns,
        per transfer, the arrays on the destination's mesh where this process holds some
        of its devices, else None."""
        src0, dst0 = transfers[0][0], transfers[0][1]
        key = (min(src0, dst0), max(src0, dst0), tuple((src, signature) for src, _, signature, _ in transfers))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(key[0], key[1], transfers)
        inputs: list[Any] = []
        for (_, _, _, value), leaves, holders in zip(transfers, plan.leaves, plan.placeholders, strict=True):
            if value is None:
                inputs.extend(holders)
                continue
            for x, leaf in zip(value, leaves, strict=True):
                x = _conformed(x, leaf.source, leaf.shape, leaf.dtype)
                pieces = [x.addressable_data(i) for i in range(leaf.pieces)]
                inputs.append(jax.make_array_from_single_device_arrays(leaf.pair_shape, leaf.pair, pieces))
        moved = plan.program(*inputs)
        out: list[tuple[Any, ...] | None] = []
        at = 0
        for (_, _, _, value), leaves in zip(transfers, plan.leaves, strict=True):
            if value is not None:
                out.append(None)
                at += len(leaves)
                continue
            arrays = []
            for leaf in leaves:
                y = moved[at]
                at += 1
                # This process's blocks of the pair array are its destination's devices'.
                pieces = [y.addressable_data(i) for i in range(leaf.pieces)]
                arr = jax.make_array_from_single_device_arrays(_flat(leaf.shape), leaf.target, pieces)
                arrays.append(arr.reshape(()) if not leaf.shape else arr)
            out.append(tuple(arrays))
        return out

    def _plan(self, a: int, b: int, transfers: Sequence[Transfer]) -> _Plan:
        """What :meth:`exchange` needs for transfers shaped like ``transfers`` between
        ``a`` and ``b`` (``a``'s mesh at ``pair = 0``): made once per shape."""
        pair = self._pair(a, b)
        leaves: list[tuple[_Leaf, ...]] = []
        placeholders: list[tuple[Any, ...]] = []
        for src, dst, signature, value in transfers:
            here = src if value is not None else dst
            count = len(self._held(here))
            leaves.append(
                tuple(
                    _Leaf(
                        shape=shape,
                        dtype=dtype,
                        source=NamedSharding(self.meshes[src], spec),
                        target=NamedSharding(self.meshes[dst], _flat_spec(shape, spec)),
                        pair=NamedSharding(pair, _pair_spec(shape, spec)),
                        pair_shape=(2 * _flat(shape)[0], *_flat(shape)[1:]),
                        pieces=count,
                    )
                    for shape, dtype, spec in signature
                )
            )
            held = self._placeholders.get((a, b, dst, signature)) if value is None else ()
            if held is None:
                held = self._placeholders[(a, b, dst, signature)] = self._zeros(pair, dst, signature)
            placeholders.append(held)
        return _Plan(self._program(pair, a, transfers), tuple(leaves), tuple(placeholders))

    def _held(self, d: int) -> set[Any]:
        found = self._mine.get(d)
        if found is None:
            found = self._mine[d] = {
                dev for dev in self.meshes[d].devices.flat if dev.process_index == jax.process_index()
            }
        return found

    def _pair(self, a: int, b: int) -> Mesh:
        pair = self._pairs.get((a, b))
        if pair is None:
            first, second = self.meshes[a], self.meshes[b]
            pair = self._pairs[(a, b)] = Mesh(np.stack([first.devices, second.devices]), (PAIR, *first.axis_names))
        return pair

    def _program(self, pair: Mesh, a: int, transfers: Sequence[Transfer]) -> Callable[..., Any]:
        """The jitted collective over the pair mesh (``a``'s mesh at ``pair = 0``): per
        dtype, the leaves packed into one buffer per device and moved by one ppermute
        (each is a gloo or NCCL call of its own, with its own fixed cost). Where leaves
        of one dtype go both ways, each device brings the buffer of the way it sends (the
        longer way's length) and one two-way permutation swaps them."""
        specs: list[PartitionSpec] = []
        groups: dict[np.dtype[Any], tuple[list[int], list[int]]] = {}
        for src, _, signature, _ in transfers:
            for shape, dtype, spec in signature:
                groups.setdefault(np.dtype(dtype), ([], []))[0 if src == a else 1].append(len(specs))
                specs.append(_pair_spec(shape, spec))

        def hop(*leaves: Any) -> tuple[Any, ...]:
            out: list[Any] = [None] * len(leaves)
            for ways in groups.values():
                # Each device's blocks, flattened end to end: the same cut on both sides.
                packed = [jnp.concatenate([leaves[i].reshape(-1) for i in members]) for members in ways if members]
                if len(packed) == 1:
                    moved = jax.lax.ppermute(packed[0], PAIR, [(0, 1)] if ways[0] else [(1, 0)])
                else:
                    size = max(p.size for p in packed)
                    forward, backward = (jnp.pad(p, (0, size - p.size)) for p in packed)
                    mine = jnp.where(jax.lax.axis_index(PAIR) == 0, forward, backward)
                    moved = jax.lax.ppermute(mine, PAIR, [(0, 1), (1, 0)])
                for members in ways:
                    at = 0
                    for i in members:
                        size = leaves[i].size
                        out[i] = moved[at : at + size].reshape(leaves[i].shape)
                        at += size
            return tuple(out)

        return jax.jit(jax.shard_map(hop, mesh=pair, in_specs=tuple(specs), out_specs=tuple(specs)))

    def _zeros(self, pair: Mesh, dst: int, signature: Signature) -> tuple[Any, ...]:
        target = self.meshes[dst]
        mine = self._held(dst)
        out = []
        for shape, dtype, spec in signature:
            sharding = NamedSharding(target, _flat_spec(shape, spec))
            block = sharding.shard_shape(_flat(shape))
            pieces = [jax.device_put(np.zeros(block, dtype), dev) for dev in target.devices.flat if dev in mine]
            out.append(_on_pair(pair, shape, spec, pieces))
        return tuple(out)


def _flat(shape: tuple[int, ...]) -> tuple[int, ...]:
    # A scalar travels as one element.
    return shape if shape else (1,)


def _flat_spec(shape: tuple[int, ...], spec: PartitionSpec) -> PartitionSpec:
    return spec if shape else PartitionSpec()


def _pair_spec(shape: tuple[int, ...], spec: PartitionSpec) -> PartitionSpec:
    """The leaf's spec on the pair mesh: axis 0 also over ``"pair"`` (major)."""
    parts = list(_flat_spec(shape, spec)) or [None]
    first = parts[0]
    names = () if first is None else (first if isinstance(first, tuple) else (first,))
    return PartitionSpec((PAIR, *names), *parts[1:])


def _on_pair(pair: Mesh, shape: tuple[int, ...], spec: PartitionSpec, pieces: list[Any]) -> Any:
    flat = _flat(shape)
    return jax.make_array_from_single_device_arrays(
        (2 * flat[0], *flat[1:]), NamedSharding(pair, _pair_spec(shape, spec)), pieces
    )


def _conformed(x: Any, sharding: NamedSharding, shape: tuple[int, ...], dtype: Any) -> Any:
    """``x`` as the transfer carries it: on ``sharding`` (placed anew only when the
    stage program left it elsewhere), scalars as one element."""
    if tuple(np.shape(x)) != shape:
        raise ExecutionError(f"a sent value has shape {tuple(np.shape(x))}, the transfer carries {shape}")
    if not shape:
        return jax.device_put(jnp.reshape(x, (1,)), NamedSharding(sharding.mesh, PartitionSpec()))
    if getattr(x, "sharding", None) != sharding:
        return jax.device_put(x, sharding)
    return x


class WorldTransport:
    """Pipeline device ``device``'s end of the world's transfers for one step
    (implements :class:`~pipedsl.executor.runtime.transport.Transport`).

    ``groups`` is every exchange of the step, cut into the groups made as one collective
    each (:func:`pipedsl.rendezvous.exchange_groups`), in the one order all devices make
    them; ``signature(key)`` what a key carries. A send keeps its value and makes, in
    order, this device's next groups while it has every value it sends in them (at least
    one); a receive is answered by the first value this device received and has not handed
    out yet, making first, in order, this device's next groups until one brings a value
    (and after it those it is then ready to send in); :meth:`finish` makes the rest. Each
    group is one :meth:`Hops.exchange`.
    """

    __slots__ = (
        "device", "_mine", "_sends", "_at", "_kept", "_arrived", "_hops", "_signature", "moved", "collectives",
    )  # fmt: skip

    def __init__(
        self,
        device: int,
        groups: Sequence[Sequence[Exchange]],
        hops: Hops,
        signature: Callable[[Hashable], Signature],
    ) -> None:
        self.device = device
        self._mine = tuple(g for g in groups if device in (g[0].src, g[0].dst))
        # Per group, what this device sends in it: the group is made once they are all kept.
        self._sends = tuple(tuple((e.buffer, e.dst) for e in g if e.src == device) for g in self._mine)
        self._at = 0
        self._kept: dict[tuple[Hashable, int], Any] = {}
        self._arrived: deque[tuple[Hashable, int, Any]] = deque()
        self._hops = hops
        self._signature = signature
        self.moved = 0  # exchanges made this step (sent or received)
        self.collectives = 0  # the collectives they took

    def send(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        self._kept[(key, dst)] = value
        self._make_ready()

    def recv(self, key: Hashable, src: int) -> Any:
        """``key`` from device ``src``: made, in order, this device's next groups until one
        brings a value."""
        arrived = self._arrived
        while not arrived:
            if self._at == len(self._mine):
                raise ExecutionError(
                    f"device {self.device} asked for {key} from device {src}, which the exchange order lacks",
                    device=self.device,
                )
            self._make_next()
        got, came_from, value = arrived.popleft()
        if got != key or came_from != src:
            raise ExecutionError(
                f"device {self.device} asked for {key} from device {src} where the exchange order has "
                f"{got} from device {came_from} next",
                device=self.device,
            )
        # The groups that were waiting behind this one for it to be made go now.
        self._make_ready()
        return value

    def take(self, request: Receive, device: int) -> Any:
        """The scheduler's receive (a :class:`~pipedsl.executor.runtime.scheduler.Mail`): made
        at once, by :meth:`recv`, as the exchange order has it."""
        return self.recv(request.key, request.src)

    def arrivals(self) -> list[tuple[Hashable, int]]:
        """Nothing arrives unasked: every value is received when it is taken."""
        return []

    def fail(self, device: int) -> None:
        """A collective cannot be called off: the driver ends a failed step by ending the world."""

    def finish(self) -> None:
        """Make the groups left (all of them sends of this device)."""
        while self._at < len(self._mine):
            self._make_next()
        if self._arrived:
            got, came_from, _ = self._arrived[0]
            raise ExecutionError(
                f"device {self.device} never received {got} from device {came_from}", device=self.device
            )

    def abort(self, error: BaseException) -> None:
        # A collective cannot be called off: the driver ends a failed step by ending the world.
        self._kept.clear()

    def _make_ready(self) -> None:
        """Make, in order, the next groups in which this device sends and has every value
        it sends: a value goes as soon as it is computed (see
        :func:`pipedsl.rendezvous.exchange_groups`)."""
        while self._at < len(self._mine):
            sends = self._sends[self._at]
            if not sends or any(key not in self._kept for key in sends):
                return
            self._make_next()

    def _make_next(self) -> None:
        """Make this device's next group of exchanges, in the order all devices make them."""
        group = self._mine[self._at]
        self._at += 1
        transfers: list[Transfer] = []
        for e in group:
            value = None
            if e.src == self.device:
                kept = self._kept.pop((e.buffer, e.dst), None)
                if kept is None:
                    raise ExecutionError(
                        f"device {self.device} is to send {e.buffer} to device {e.dst} before it computed it",
                        device=self.device,
                    )
                value = tuple(jax.tree_util.tree_leaves(kept))
            transfers.append((e.src, e.dst, self._signature(e.buffer), value))
        for e, arrays in zip(group, self._hops.exchange(transfers), strict=True):
            if e.dst == self.device:
                assert arrays is not None  # this process holds devices of the receiver's mesh
                self._arrived.append((e.buffer, e.src, arrays if isinstance(e.buffer, Buffer) else arrays[0]))
        self.moved += len(group)
        self.collectives += 1


@dataclass(frozen=True, slots=True)
class Pieces:
    """One array as one process holds it: its global shape and dtype and its distinct
    shards by index (``(start, stop)`` per axis)."""

    shape: tuple[int, ...]
    dtype: Any
    shards: dict[tuple[tuple[int | None, int | None], ...], np.ndarray]


def addressable_pieces(value: Any) -> Any:
    """``value`` (a pytree of arrays, possibly over several processes) as this process's
    :class:`Pieces`, leaf by leaf, for :func:`assemble`."""

    def leaf(x: Any) -> Pieces:
        if not isinstance(x, jax.Array):
            arr = np.asarray(x)
            return Pieces(arr.shape, arr.dtype, {tuple((0, n) for n in arr.shape): arr})
        shards: dict[Any, np.ndarray] = {}
        for shard in x.addressable_shards:
            index = tuple((s.start, s.stop) for s in shard.index)
            if index not in shards:
                shards[index] = np.asarray(shard.data)
        return Pieces(tuple(x.shape), np.dtype(x.dtype), shards)

    return jax.tree_util.tree_map(leaf, value)


def assemble(parts: Sequence[Any]) -> Any:
    """The whole arrays of several processes' :func:`addressable_pieces` of one value."""

    def leaf(*pieces: Pieces) -> np.ndarray:
        out = np.empty(pieces[0].shape, pieces[0].dtype)
        for piece in pieces:
            for index, block in piece.shards.items():
                out[tuple(slice(a, b) for a, b in index)] = block
        return out

    return jax.tree_util.tree_map(leaf, *parts)
