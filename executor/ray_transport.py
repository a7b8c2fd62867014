"""The Ray backend's transport: every transfer a compiled collective between two stage meshes.

The processes of a pipeline form one ``jax.distributed`` world
(:mod:`pipedsl.executor.ray_cluster`), and every pipeline device's mesh is a set of the
world's JAX devices. A value goes from pipeline device ``a`` to ``b`` as one jitted
``jax.lax.ppermute`` under ``jax.shard_map`` (:class:`Hops`) over the *pair mesh*: axes
``("pair", "data", "tensor")``, ``a``'s mesh at ``pair = 0`` and ``b``'s at ``pair = 1``.
Each leaf keeps its spec: a leaf of shape ``[n, ...]`` with spec ``P(e0, ...)`` on its
mesh is one ``[2n, ...]`` array with spec ``P(("pair", e0), ...)`` on the pair mesh, so
that every device's block *is* its shard, and the sender's processes bring their shards
while the receiver's bring placeholders (zeros, made once). The permutation moves each
device's shard to the device at the same ``(data, tensor)`` place of the other mesh: on
GPUs NCCL device to device, on CPU gloo; nothing goes through Ray.

A collective waits for both sides (a rendezvous), so each device makes its exchanges in
the one order :func:`pipedsl.rendezvous.exchange_order` gives the program, followed by
the worker's own transfers (summed gradients of shared parameters, updated shared
parameters) in a fixed order (:func:`worker_exchanges`). A :class:`WorldTransport` keeps
each sent value until the device reaches a receive (or the step's end) that comes after
it in that order, and then makes, in order, the exchanges that come first.

What each transfer carries (shapes, dtypes, specs) is known to both sides from the model
(:func:`signatures`), so no value's first arrival has to announce its layout.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.mesh import DATA, TENSOR, StageLayout
from pipedsl.executor.stages import StagedModel
from pipedsl.program import Buffer, BufferKind
from pipedsl.rendezvous import Exchange

__all__ = [
    "Signature",
    "Hops",
    "WorldTransport",
    "signatures",
    "worker_exchanges",
    "Pieces",
    "addressable_pieces",
    "assemble",
    "PAIR",
]

PAIR = "pair"

# Per leaf: (global shape, dtype, spec on its stage mesh).
Signature = tuple[tuple[tuple[int, ...], Any, PartitionSpec], ...]


def worker_exchanges(model: StagedModel, placement: Sequence[int], *, update: bool) -> tuple[Exchange, ...]:
    """The worker's transfers after the program (:mod:`pipedsl.executor.worker`), in the
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


def signatures(
    model: StagedModel, mesh: Mesh, specs: Sequence[PartitionSpec], *, zero: int
) -> Callable[[Hashable], Signature]:
    """What each transfer key carries, for meshes shaped like ``mesh`` (every pipeline
    device's mesh has the same ``dp x tp`` shape): activations and input gradients as the
    stage programs place them (axis 0 over ``"data"``, see
    :class:`~pipedsl.executor.mesh.StageLayout.batch`), shared gradients and parameters
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


class Hops:
    """The compiled point-to-point programs of one process between pipeline devices'
    ``meshes`` (see the module docstring); :meth:`move` is one transfer."""

    def __init__(self, meshes: Sequence[Mesh]) -> None:
        self.meshes = tuple(meshes)
        self._pairs: dict[tuple[int, int], Mesh] = {}
        self._programs: dict[tuple[int, int, Signature], Callable[..., Any]] = {}
        self._placeholders: dict[tuple[int, int, Signature], tuple[tuple[Any, ...], ...]] = {}
        self._mine: dict[int, set[Any]] = {}

    def move(self, src: int, dst: int, signature: Signature, value: Sequence[Any] | None) -> tuple[Any, ...] | None:
        """Move the leaves ``value`` (on ``src``'s mesh; None where this process holds
        none of ``src``'s devices) to ``dst``'s mesh: the arrays there where this process
        holds some of ``dst``'s devices, else None. Every process of both meshes calls it
        for the same transfer."""
        pair = self._pair(src, dst)
        key = (src, dst, signature)
        moved: Any
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._program(pair, signature)
        inputs = []
        if value is not None:
            source = self.meshes[src]
            for x, (shape, dtype, spec) in zip(value, signature, strict=True):
                x = _conformed(x, NamedSharding(source, spec), shape, dtype)
                inputs.append(_on_pair(pair, shape, dtype, spec, [s.data for s in x.addressable_shards]))
        else:
            holders = self._placeholders.get(key)
            if holders is None:
                holders = self._placeholders[key] = self._zeros(dst, signature)
            for (shape, dtype, spec), pieces in zip(signature, holders, strict=True):
                inputs.append(_on_pair(pair, shape, dtype, spec, list(pieces)))
        moved = program(*inputs)
        if value is not None:
            return None
        target = self.meshes[dst]
        mine = self._held(dst)
        out = []
        for y, (shape, _, spec) in zip(moved, signature, strict=True):
            held = [s.data for s in y.addressable_shards if s.device in mine]
            arr = jax.make_array_from_single_device_arrays(
                _flat(shape), NamedSharding(target, _flat_spec(shape, spec)), held
            )
            out.append(arr.reshape(()) if not shape else arr)
        return tuple(out)

    def _held(self, d: int) -> set[Any]:
        found = self._mine.get(d)
        if found is None:
            found = self._mine[d] = {
                dev for dev in self.meshes[d].devices.flat if dev.process_index == jax.process_index()
            }
        return found

    def _pair(self, src: int, dst: int) -> Mesh:
        pair = self._pairs.get((src, dst))
        if pair is None:
            a, b = self.meshes[src], self.meshes[dst]
            pair = self._pairs[(src, dst)] = Mesh(np.stack([a.devices, b.devices]), (PAIR, DATA, TENSOR))
        return pair

    def _program(self, pair: Mesh, signature: Signature) -> Callable[..., Any]:
        specs = tuple(_pair_spec(shape, spec) for shape, _, spec in signature)

        def hop(*leaves: Any) -> tuple[Any, ...]:
            return tuple(jax.lax.ppermute(x, PAIR, [(0, 1)]) for x in leaves)

        return jax.jit(jax.shard_map(hop, mesh=pair, in_specs=specs, out_specs=specs))

    def _zeros(self, dst: int, signature: Signature) -> tuple[tuple[Any, ...], ...]:
        target = self.meshes[dst]
        mine = self._held(dst)
        out = []
        for shape, dtype, spec in signature:
            sharding = NamedSharding(target, _flat_spec(shape, spec))
            block = sharding.shard_shape(_flat(shape))
            out.append(tuple(jax.device_put(np.zeros(block, dtype), dev) for dev in target.devices.flat if dev in mine))
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


def _on_pair(pair: Mesh, shape: tuple[int, ...], dtype: Any, spec: PartitionSpec, pieces: list[Any]) -> Any:
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
    (implements :class:`~pipedsl.executor.transport.Transport`).

    ``order`` is every exchange of the step in the one order all devices make them;
    ``signature(key)`` what a key carries. A send keeps its value; a receive first makes,
    in ``order``, every earlier exchange of this device (each a send it has made), then
    its own; :meth:`finish` makes the rest. Each exchange is one :meth:`Hops.move`.
    """

    __slots__ = ("device", "_mine", "_at", "_kept", "_hops", "_signature", "moved")

    def __init__(
        self,
        device: int,
        order: Sequence[Exchange],
        hops: Hops,
        signature: Callable[[Hashable], Signature],
    ) -> None:
        self.device = device
        self._mine = tuple(e for e in order if device in (e.src, e.dst))
        self._at = 0
        self._kept: dict[tuple[Hashable, int], Any] = {}
        self._hops = hops
        self._signature = signature
        self.moved = 0  # exchanges made this step (sent or received)

    def send(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        self._kept[(key, dst)] = value

    def recv(self, key: Hashable, src: int, *, timeout: float) -> Any:
        while self._at < len(self._mine):
            e = self._mine[self._at]
            self._at += 1
            if e.dst == self.device:
                if e.buffer != key or e.src != src:
                    raise ExecutionError(
                        f"device {self.device} asked for {key} from device {src} where the exchange order has "
                        f"{e.buffer} from device {e.src} next",
                        device=self.device,
                    )
                return self._receive(key, src)
            self._send(e)
        raise ExecutionError(f"device {self.device} asked for {key} from device {src}, which the exchange order lacks")

    def finish(self) -> None:
        """Make the exchanges left (all of them sends of this device)."""
        while self._at < len(self._mine):
            e = self._mine[self._at]
            self._at += 1
            if e.dst == self.device:
                raise ExecutionError(
                    f"device {self.device} never received {e.buffer} from device {e.src}", device=self.device
                )
            self._send(e)

    def abort(self, error: BaseException) -> None:
        # A collective cannot be called off: the driver ends a failed step by ending the world.
        self._kept.clear()

    def _send(self, e: Exchange) -> None:
        value = self._kept.pop((e.buffer, e.dst), None)
        if value is None:
            raise ExecutionError(
                f"device {self.device} is to send {e.buffer} to device {e.dst} before it computed it",
                device=self.device,
            )
        self._hops.move(e.src, e.dst, self._signature(e.buffer), tuple(jax.tree_util.tree_leaves(value)))
        self.moved += 1

    def _receive(self, key: Hashable, src: int) -> Any:
        arrays = self._hops.move(src, self.device, self._signature(key), None)
        assert arrays is not None  # this process holds devices of the receiver's mesh
        self.moved += 1
        return arrays if isinstance(key, Buffer) else arrays[0]


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
