"""Data parallelism inside a stage program: every device of ``"data"`` runs the stage on
its own share of the microbatch, as the ranks of a data-parallel job do.

With ``dp > 1`` a stage's programs are :func:`jax.shard_map` over ``"data"`` only (the
``"tensor"`` axis stays XLA's, which inserts the tensor-parallel collectives): each device
runs the stage traced at its share of the examples (``B / dp``), and the gradients it adds
are its own. The accumulated gradients are then kept as DDP keeps them under
``no_sync``: with ZeRO 0 and 1 every device keeps its own partial sum (an *unreduced*
accumulator of shape ``[dp, *leaf]``) and the step reduces it once, after the last
backward (all-reduce for ZeRO 0, reduce-scatter for ZeRO 1); with ZeRO 2 and 3 every
backward reduce-scatters its contribution into a sharded accumulator, which is what frees
that memory. That is the traffic the plan estimator prices.

On a mesh of shard groups (``RunOptions.fsdp``: axes ``"replica"`` x ``"data"``) the programs
are manual over both axes and the batch splits over both; ZeRO shards over ``"data"`` only, so
every reduction over ``"data"`` (an all-reduce, or a reduce-scatter that leaves each device its
shard) is followed by an all-reduce of its result over ``"replica"``, as HSDP reduces each
shard across its replicas.

The loss is the mean of the devices' losses (a ``psum`` of each device's share divided
by ``dp``), so the gradients are the whole microbatch's when the loss is a mean over its
examples, as it is for data parallelism anywhere.

Values that cross a program's boundary take one of these forms:

- ``BATCH``: axis 0 (the examples) split over ``"data"``: microbatches, activations and
  their cotangents;
- ``STACKED``: each device's own value under a new leading axis of size ``dp``: residuals
  and the ``I`` to ``W`` hand-over, which never leave their device;
- ``WHOLE``: the same on every device: parameters (gathered over ``"data"`` where ZeRO 3
  shards them) and the running loss;
- an accumulator's own form (:meth:`DataShards.accumulator_forms`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pipedsl.executor.stages.mesh import DATA, REPLICA, TENSOR, StageLayout, data_axes, data_size

__all__ = ["Form", "BATCH", "STACKED", "WHOLE", "DataShards", "StageForms", "stage_forms"]


@dataclass(frozen=True, slots=True)
class Form:
    """How a value is laid out over ``"data"`` where it crosses a program's boundary:
    ``spec`` names the ``"data"`` axis only; ``stacked`` values gain a leading axis."""

    spec: PartitionSpec
    stacked: bool = False


BATCH = Form(PartitionSpec(DATA))
STACKED = Form(PartitionSpec(DATA), stacked=True)
WHOLE = Form(PartitionSpec())


def _is_form(x: Any) -> bool:
    return isinstance(x, Form)


class DataShards:
    """One stage's programs over its mesh's ``"data"`` axis (module docstring). On a mesh
    of shard groups (``"replica"`` x ``"data"``, :func:`~pipedsl.executor.stages.mesh.data_axes`)
    the programs are manual over both, the batch split over both, and every reduction over
    ``"data"`` is followed by an all-reduce of its result over ``"replica"``."""

    __slots__ = ("layout", "dp", "group", "axes", "batch_form", "stacked_form", "_acc_axes", "_grad_axes", "_bucketed")

    def __init__(self, layout: StageLayout) -> None:
        self.layout = layout
        self.dp = data_size(layout.mesh)
        self.group = layout.mesh.shape[DATA]
        self.axes = data_axes(layout.mesh)
        entry = self.axes if len(self.axes) > 1 else DATA
        self.batch_form = Form(PartitionSpec(entry))
        self.stacked_form = Form(PartitionSpec(entry), stacked=True)
        # Per parameter leaf, the axis its accumulator (ZeRO 2, 3) and its reduced
        # gradient are split along over "data" (None: whole on every device).
        self._acc_axes = tuple(_data_axis(a.spec) for a in layout.accumulators)
        self._grad_axes = tuple(_data_axis(g.spec) for g in layout.grads)
        # Inside a stage's programs (manual over "data" only), leaves whole over "tensor"
        # go into one collective per kind and dtype (see _reduce_all); a leaf split over
        # "tensor" is reduced alone, where XLA keeps it.
        self._bucketed = tuple(not _names(g.spec) & {TENSOR} for g in layout.grads)

    @property
    def split(self) -> bool:
        """Whether the stage runs per device of ``"data"`` (``dp > 1``)."""
        return self.dp > 1

    def accumulator_forms(self) -> tuple[Form, ...]:
        """Per parameter leaf, its accumulator's form: unreduced (ZeRO 0 and 1: each
        device's partial sum under a leading axis) or split as ZeRO 2 and 3 keep it."""
        if self.layout.unreduced:
            return tuple(self.batch_form for _ in self._acc_axes)
        return _split_along(self._acc_axes)

    def accumulate(self, acc: Sequence[Any], grads: Sequence[Any]) -> tuple[Any, ...]:
        """``acc`` plus this device's ``grads`` (inside a program, in the local view):
        kept as they are where the accumulator is unreduced, else reduced into it. Gradients
        of a bf16 computation are widened to the accumulator's dtype (fp32) first, so they
        are summed and reduced in fp32."""
        grads = tuple(g.astype(a.dtype) for a, g in zip(acc, grads, strict=True))
        if not self.split:
            return tuple(a + g for a, g in zip(acc, grads, strict=True))
        if self.layout.unreduced:
            return tuple(a + g[None] for a, g in zip(acc, grads, strict=True))
        reduced = _reduce_all(tuple(grads), self._acc_axes, self._bucketed, self.group, replicated=self._replicated)
        return tuple(a + g for a, g in zip(acc, reduced, strict=True))

    @property
    def _replicated(self) -> bool:
        """Whether the mesh has shard groups, whose reductions end over ``"replica"``."""
        return len(self.axes) > 1

    def reduce(self) -> Callable[..., tuple[Any, ...]]:
        """A program that takes an unreduced accumulator and returns the step's gradients:
        summed over ``"data"``, each kept as its optimizer state is (ZeRO 1: a
        reduce-scatter, which is all the optimizer's shard needs), every leaf in one
        collective per dtype (:func:`_reduce_all`). Jit it with ``layout.grads`` as its
        outputs' shardings."""
        axes, group, replicated = self._grad_axes, self.group, self._replicated

        def reduce(acc: Sequence[Any]) -> tuple[Any, ...]:
            return _reduce_all(tuple(a[0] for a in acc), axes, (True,) * len(axes), group, replicated=replicated)

        layout = self.layout
        return self._manual(reduce, (tuple(a.spec for a in layout.accumulators),), tuple(g.spec for g in layout.grads))

    def whole(self, positions: Sequence[int]) -> Callable[..., tuple[Any, ...]]:
        """A program that takes the stage's parameter leaves at ``positions`` (of its
        leaves), placed as their optimizer state is, and returns them placed as the
        parameters are kept: ZeRO 1 and 2 update each device's shard and then gather the
        new parameters in one all-gather per dtype. Jit it with the parameters'
        shardings as its outputs'."""
        layout = self.layout
        if not layout.gathers_params:
            raise ValueError("only parameters kept whole over data and updated in shards are gathered")
        axes = [self._grad_axes[k] for k in positions]

        def gather(*values: Any) -> tuple[Any, ...]:
            return _gather_all(values, axes)

        states, params = (
            tuple(layout.states[k].spec for k in positions),
            tuple(layout.params[k].spec for k in positions),
        )
        return self._manual(gather, states, params)

    def _manual(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any) -> Callable[..., Any]:
        # Over both of the mesh's axes (specs as pytrees matching the arguments and
        # results), unlike the stage's programs: each device then holds its own piece of a
        # leaf split over "tensor" too, so every leaf joins one flat buffer and only
        # "data" is communicated.
        return jax.shard_map(fn, mesh=self.layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def total(self, value: Any) -> Any:
        """The sum over the data-parallel devices of a per-device ``value`` (the loss)."""
        return jax.lax.psum(value, self.axes) if self.split else value

    def program(self, fn: Callable[..., Any], in_forms: Any, out_forms: Any) -> Callable[..., Any]:
        """``fn``, written for one device's share, as a program over the whole mesh:
        arguments and results in the given forms (pytrees of :class:`Form` matching them).
        With ``dp = 1`` that is ``fn`` itself."""
        if not self.split:
            return fn

        def body(*args: Any) -> Any:
            local = jax.tree_util.tree_map(_to_local, in_forms, args, is_leaf=_is_form)
            return jax.tree_util.tree_map(_to_global, out_forms, fn(*local), is_leaf=_is_form)

        # check_vma=False: with it, JAX would psum the cotangent of every parameter used
        # on a device's share (each device's gradient is kept as its own here).
        return jax.shard_map(
            body, mesh=self.layout.mesh, in_specs=_specs(in_forms), out_specs=_specs(out_forms),
            axis_names=set(self.axes), check_vma=False,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class StageForms:
    """The :class:`Form` of every argument and result of one stage's programs:
    parameters whole; inputs (``x``), targets (``t``), activations and cotangents split;
    residuals (``stored``) and the ``I`` to ``W`` hand-over (``handoff``, and ``refs``:
    what ``W`` reads from ``I``'s own arguments) stacked per device; accumulators as the
    layout keeps them. ``values`` are the forward's computed outputs."""

    params: tuple[Form, ...]
    x: tuple[Form, ...]
    t: tuple[Form, ...]
    values: tuple[Form, ...]
    stored: tuple[Form, ...]
    cts: tuple[Form, ...]
    input_cts: tuple[Form, ...]
    acc: tuple[Form, ...]
    handoff: tuple[Form, ...]
    refs: tuple[Form, ...]

    def forward_in(self, last: bool) -> tuple[Any, ...]:
        """``F``'s arguments: ``(params, x, targets[, loss])``."""
        return (self.params, self.x, self.t, WHOLE) if last else (self.params, self.x, self.t)

    def forward_out(self, last: bool) -> Any:
        """``F``'s results: the computed values (and the running loss)."""
        return (self.values, WHOLE) if last else self.values


def stage_forms(
    shards: DataShards,
    *,
    num_params: int,
    num_x: int,
    num_t: int,
    num_cts: int,
    num_input_cts: int,
    num_sent: int,
    stored_from: tuple[int | None, ...],
    num_handoff: int,
    handoff_refs: tuple[tuple[bool, int], ...],
) -> StageForms:
    """The forms of a stage's values: ``num_*`` count its parameters, inputs, targets,
    output and input cotangents and computed hand-over values; ``stored_from`` says per
    stored residual which of the forward's inputs (parameters, then inputs, then targets)
    it is, None for a computed one. The forward computes ``num_sent`` activation values,
    then the stored values that are its own."""
    batch, stacked = shards.batch_form, shards.stacked_form
    inputs = (WHOLE,) * num_params + (batch,) * (num_x + num_t)
    stored = tuple(stacked if where is None else inputs[where] for where in stored_from)
    return StageForms(
        params=(WHOLE,) * num_params,
        x=(batch,) * num_x,
        t=(batch,) * num_t,
        values=(batch,) * num_sent + (stacked,) * stored_from.count(None),
        stored=stored,
        cts=(batch,) * num_cts,
        input_cts=(batch,) * num_input_cts,
        acc=shards.accumulator_forms(),
        handoff=(stacked,) * num_handoff,
        refs=tuple(stored[k] if from_stored else batch for from_stored, k in handoff_refs),
    )


def _specs(forms: Any) -> Any:
    return jax.tree_util.tree_map(lambda f: f.spec, forms, is_leaf=_is_form)


def _data_axis(spec: PartitionSpec) -> int | None:
    for axis, name in enumerate(spec):
        if DATA in (name if isinstance(name, tuple) else (name,)):
            return axis
    return None


def _split_along(axes: Sequence[int | None]) -> tuple[Form, ...]:
    return tuple(WHOLE if a is None else Form(PartitionSpec(*([None] * a), DATA)) for a in axes)


def _reduced(value: Any, axis: int | None, *, replicated: bool = False) -> Any:
    """``value`` summed over ``"data"`` (and over ``"replica"`` where ``replicated``):
    whole on every device, or split along ``axis`` over ``"data"``."""
    if axis is None:
        return jax.lax.psum(value, (REPLICA, DATA) if replicated else DATA)
    scattered = jax.lax.psum_scatter(value, DATA, scatter_dimension=axis, tiled=True)
    return jax.lax.psum(scattered, REPLICA) if replicated else scattered


def _reduce_all(
    values: tuple[Any, ...],
    axes: Sequence[int | None],
    bucketed: Sequence[bool],
    dp: int,
    *,
    replicated: bool = False,
) -> tuple[Any, ...]:
    """Every leaf of ``values`` (one device's, in the local view) summed over ``"data"``
    as :func:`_reduced` sums it, with the ``bucketed`` leaves of one dtype that stay whole
    in one all-reduce and those split over ``"data"`` in one reduce-scatter, each of one
    flat buffer. A step's gradients are dozens of leaves: on CPU devices a collective of
    each, even combined into one operation of many operands by XLA, took 16.2 ms for the
    demo transformer's 54 leaves over 8 devices, one all-reduce of the same values in one
    buffer 9.7 ms and one reduce-scatter of them 4.7 ms (as DDP's and FSDP's buckets do on
    GPUs, where a collective's launch costs as much). ``dp`` is the devices of ``"data"``;
    with ``replicated``, every sum (a shard, where split) is then all-reduced over
    ``"replica"``, as HSDP reduces across its shard groups."""
    everyone = (REPLICA, DATA) if replicated else DATA
    out: list[Any] = list(values)
    for i, (v, axis, bucket) in enumerate(zip(values, axes, bucketed, strict=True)):
        if not bucket:
            out[i] = _reduced(v, axis, replicated=replicated)
    whole, split = _buckets(values, axes, bucketed)
    for members in whole:
        summed = jax.lax.psum(jnp.concatenate([values[i].ravel() for i in members]), everyone)
        for i, part in zip(members, _pieces(summed, [values[i].size for i in members]), strict=True):
            out[i] = part.reshape(values[i].shape)
    for pairs in split:
        # Row d of each leaf is device d's shard of it (its split axis moved first), so
        # the scatter leaves every device its own shard of every leaf.
        moved = [jnp.moveaxis(values[i], axis, 0) for i, axis in pairs]
        rows = jnp.concatenate([m.reshape(dp, -1) for m in moved], axis=1)
        mine = jax.lax.psum_scatter(rows, DATA, scatter_dimension=0, tiled=True)[0]
        if replicated:
            mine = jax.lax.psum(mine, REPLICA)
        for (i, axis), m, part in zip(pairs, moved, _pieces(mine, [m.size // dp for m in moved]), strict=True):
            out[i] = jnp.moveaxis(part.reshape((m.shape[0] // dp, *m.shape[1:])), 0, axis)
    return tuple(out)


def _gather_all(values: tuple[Any, ...], axes: Sequence[int | None]) -> tuple[Any, ...]:
    """Every leaf of ``values`` (one device's shard, split along ``axes`` over ``"data"``,
    in the local view) gathered whole on every device of ``"data"``: the inverse of the
    reduce-scatter of :func:`_reduce_all`, the leaves of one dtype in one all-gather."""
    out: list[Any] = list(values)
    for pairs in _buckets(values, axes, (True,) * len(values))[1]:
        moved = [jnp.moveaxis(values[i], axis, 0) for i, axis in pairs]
        # Row d: device d's shards, one after another.
        rows = jax.lax.all_gather(jnp.concatenate([m.ravel() for m in moved]), DATA)
        for (i, axis), m, part in zip(pairs, moved, _pieces(rows, [m.size for m in moved]), strict=True):
            out[i] = jnp.moveaxis(part.reshape((rows.shape[0] * m.shape[0], *m.shape[1:])), 0, axis)
    return tuple(out)


def _buckets(
    values: Sequence[Any], axes: Sequence[int | None], bucketed: Sequence[bool]
) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """The ``bucketed`` leaves by dtype: those whole over ``"data"`` (their indices) and
    those split over it (index, split axis), one list per bucket."""
    whole: dict[Any, list[int]] = {}
    split: dict[Any, list[tuple[int, int]]] = {}
    for i, (v, axis, bucket) in enumerate(zip(values, axes, bucketed, strict=True)):
        if not bucket:
            continue
        if axis is None:
            whole.setdefault(v.dtype, []).append(i)
        else:
            split.setdefault(v.dtype, []).append((i, axis))
    return list(whole.values()), list(split.values())


def _pieces(flat: Any, sizes: Sequence[int]) -> list[Any]:
    """``flat`` cut along its last axis into consecutive pieces of ``sizes``."""
    pieces, start = [], 0
    for size in sizes:
        pieces.append(flat[..., start : start + size])
        start += size
    return pieces


def _names(spec: PartitionSpec) -> set[Any]:
    """The mesh axes a spec names."""
    return {n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None}


def _to_local(form: Form, value: Any) -> Any:
    return value[0] if form.stacked else value


def _to_global(form: Form, value: Any) -> Any:
    return value[None] if form.stacked else value
