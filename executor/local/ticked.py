"""One SPMD program for the whole step, where every pipeline device is a JAX device of its own.

Dispatched action by action (or task by task, :mod:`pipedsl.tasks`), a step costs the host
a dispatch per program (on a TPU v5e host about 125 us plus a few microseconds per buffer),
so the host, not the devices, sets the pace. Here the step is one ``jax.jit`` of a
``jax.shard_map`` over a 1-D mesh of the pipeline devices (axis ``"stage"``), one dispatch
per step, which runs the schedule's tick table (:func:`pipedsl.ticks.tick_table`):

- the ticks are unrolled; at each, every device runs its action of the tick through a
  ``lax.switch`` over the distinct actions of that tick (and idle), its index read from a
  per-device table with ``lax.axis_index``, so the program holds one copy of each
  action's computation, as the ``"unrolled"`` one program of shared devices does
  (:mod:`pipedsl.executor.local.fused`);
- after a tick, the values it produced for other devices move by ``lax.ppermute`` over
  that tick's (src, dst) pairs (grouped into permutations where a device receives two);
- every device's state is uniform, as ``shard_map`` needs: its parameters, optimizer
  state, gradient accumulators, residual slots (as many as its peak of microbatches in
  flight), ``I``-to-``W`` hand-over slots and inbound-message slots are padded flat rows,
  one per dtype (:class:`_Rows`), and each branch reads and writes its device's values
  by static slices;
- the branches run the stage programs' own functions (:meth:`StageProgram.inlined`),
  and the optimizer update after the ticks runs the workers' (:func:`optimizer_step`),
  with the global norm's sum of squares summed over the stage axis where the optimizer
  couples leaves through it; parameters and optimizer state are donated.

The parameters and optimizer state stay in those rows between steps (sharded over the
stage axis); the workers get them back as their leaves and states (:meth:`TickedStep.settle`)
when anything else reads them. A step returns without waiting: its loss is a device value.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.runtime.optimizers import couples_through_global_norm
from pipedsl.executor.runtime.worker import (
    Update,
    Worker,
    WorkerStep,
    optimizer_init,
    optimizer_step,
)
from pipedsl.executor.stages.mesh import data_size
from pipedsl.executor.stages.stage_program import StageProgram
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.ticks import TickTable, tick_table

__all__ = ["MAX_IN_FLIGHT", "STAGE", "TickedStep", "ticks_apply"]

STAGE = "stage"
"""The mesh axis of the pipeline devices."""

MAX_IN_FLIGHT = 2
"""Steps of one program over CPU devices dispatched and not yet done, at most: the next
step is queued while one runs. XLA's CPU runtime runs each device's share of a program on
a shared thread pool, and a collective holds its thread until every device's share has
arrived, so with many steps queued the shares of different steps can take every thread
and the permutes never meet (the process aborts after 40 s: jax 0.10, 2 cores, 200 steps
of a 4-device program queued; with at most 8 queued, 1,000 steps ran). Accelerators run
collectives on their own streams, unbounded."""

Leaves = tuple[Any, ...]
Rows = dict[str, Any]


def ticks_apply(workers: Sequence[Worker], meshes: Sequence[Mesh]) -> bool:
    """Whether a step of ``workers`` can run as one program over the stage axis: two or
    more pipeline devices, each one JAX device of its own; every parameter leaf used by one
    stage only (a shared leaf's gradients are summed across devices, which the per-task
    path does); and no stage calling back into Python on the host (a callback that raises
    inside a program over several devices aborts the process, where the tasks apart raise
    an error that names the stage and action)."""
    if len(meshes) < 2 or any(m.devices.size != 1 for m in meshes):
        return False
    if len({m.devices.flat[0] for m in meshes}) != len(meshes):
        return False
    model = workers[0].model
    used = [i for s in range(model.num_stages) for i in model.stage_params[s]]
    if len(used) != len(set(used)):
        return False
    programs = [p for w in workers for p in w.runtime.stages.values()]
    return all(data_size(p.layout.mesh) == 1 and not p.calls_host for p in programs)


class _Rows:
    """Where named groups of values live in flat rows, one row per dtype: per name, per
    leaf (dtype, offset, shape); ``sizes`` are the rows' lengths. The groups follow one
    another, or with ``union`` each starts at 0 (a slot that holds any one of them)."""

    __slots__ = ("places", "sizes")

    def __init__(self, groups: Mapping[Any, Sequence[Any]], *, union: bool = False) -> None:
        sizes: dict[str, int] = {}
        used: dict[str, int] = {}
        self.places: dict[Any, tuple[tuple[str, int, tuple[int, ...]], ...]] = {}
        for name, leaves in groups.items():
            if union:
                used = {}
            places = []
            for leaf in leaves:
                dtype = np.dtype(leaf.dtype).name
                at = used.get(dtype, 0)
                places.append((dtype, at, tuple(leaf.shape)))
                used[dtype] = at + int(np.prod(leaf.shape, dtype=np.int64))
                sizes[dtype] = max(sizes.get(dtype, 0), used[dtype])
            self.places[name] = tuple(places)
        self.sizes = sizes

    def get(self, rows: Rows, name: Hashable, *, base: Mapping[str, int] | None = None) -> Leaves:
        """Group ``name``'s values read from ``rows`` (each row starting at ``base[dtype]``)."""
        out = []
        for dtype, at, shape in self.places[name]:
            start = at + (base or {}).get(dtype, 0)
            n = int(np.prod(shape, dtype=np.int64))
            out.append(lax.slice(rows[dtype], (start,), (start + n,)).reshape(shape))
        return tuple(out)

    def put(self, rows: Rows, name: Hashable, values: Sequence[Any], *, base: Mapping[str, int] | None = None) -> Rows:
        """``rows`` with group ``name`` set to ``values``."""
        rows = dict(rows)
        for (dtype, at, _), value in zip(self.places[name], values, strict=True):
            start = at + (base or {}).get(dtype, 0)
            flat = jnp.ravel(value).astype(dtype)
            rows[dtype] = lax.dynamic_update_slice(rows[dtype], flat, (start,))
        return rows

    def zeros(self) -> Rows:
        return {dtype: jnp.zeros((n,), dtype) for dtype, n in sorted(self.sizes.items())}


def _padded(sizes: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Per dtype, the longest of the devices' rows."""
    out: dict[str, int] = {}
    for one in sizes:
        for dtype, n in one.items():
            out[dtype] = max(out.get(dtype, 0), n)
    return out


def _slots(intervals: Sequence[tuple[Any, int, int]]) -> tuple[dict[Any, int], int]:
    """Slots for values held from a tick to a later one: ``(name, taken, freed)`` each
    takes a slot at the end of tick ``taken`` (or during it) and frees it once tick
    ``freed`` has read it. Returns each name's slot and the number of slots."""
    free_at: list[int] = []  # per slot, the tick after which it is free
    slot: dict[Any, int] = {}
    for name, taken, freed in sorted(intervals, key=lambda v: (v[1], v[2])):
        k = next((k for k, f in enumerate(free_at) if f <= taken), None)
        if k is None:
            k = len(free_at)
            free_at.append(freed)
        free_at[k] = freed
        slot[name] = k
    return slot, len(free_at)


@dataclass(frozen=True, slots=True)
class _Device:
    """One pipeline device's static layout: its parameters (by flat leaf), optimizer
    state (by stage), gradient accumulators (by stage), residuals and hand-overs (by
    stage, at a slot's base) and inbound messages (by (kind, stage) of the value, at a
    slot's base); the slot of each held value."""

    params: _Rows
    grads: _Rows
    residuals: _Rows
    handoffs: _Rows
    residual_slot: dict[tuple[int, int], int]
    handoff_slot: dict[tuple[int, int], int]
    message_slot: dict[tuple[Kind, int, int], int]


class TickedStep:
    """The whole step of ``workers`` (each pipeline device a JAX device of its own, see
    :func:`ticks_apply`) as one program per kind of step (an optimizer's, skipping a
    non-finite update or not, or gradients only), traced on its first use."""

    def __init__(self, workers: Sequence[Worker], meshes: Sequence[Mesh], *, schedule: Schedule) -> None:
        self.workers = tuple(workers)
        self.schedule = schedule
        self.table: TickTable = tick_table(schedule)
        self.mesh = Mesh(np.array([m.devices.flat[0] for m in meshes], dtype=object), (STAGE,))
        self.rows_at = NamedSharding(self.mesh, PartitionSpec(STAGE))
        model = self.workers[0].model
        self.model = model
        self.last = schedule.placement[-1]
        stages: dict[int, StageProgram] = {}
        for w in self.workers:
            for s, program in w.runtime.stages.items():
                if schedule.placement[s] == w.index:
                    stages[s] = program.inlined()
        self.stages = stages
        # Per stage, how many leaves of its I-to-W hand-over I computes (the rest it passes on).
        self._computed_handoff: dict[int, int] = {}
        self._shapes = self._value_shapes()
        self._lay_out()
        # The parameters (and, once an optimizer step ran, its state) as rows sharded over
        # the stage axis, while this step holds them rather than the workers.
        self._params: Rows | None = None
        self._states: Rows | None = None
        self._states_for: Any = None  # the optimizer whose state _states holds
        self._state_layouts: tuple[_Rows, ...] = ()
        self._state_treedefs: tuple[dict[int, Any], ...] = ()
        self._state_size: dict[str, int] = {}
        self._programs: dict[Any, tuple[Any, Callable[..., Any]]] = {}
        # The losses of the steps in flight, on CPU devices (MAX_IN_FLIGHT says why).
        self._in_flight: deque[Any] | None = deque() if self.mesh.devices.flat[0].platform == "cpu" else None

    # -- layouts ----------------------------------------------------------------------

    def _value_shapes(self) -> dict[tuple[str, int], tuple[Any, ...]]:
        """Shape structs of every stage's values of one microbatch: ("x", s) its inputs,
        ("t", s) targets, ("ct", s) output cotangents, ("y", s) activation, ("res", s)
        residuals, ("in_ct", s) input cotangents, ("handoff", s) its I-to-W hand-over
        (flattened)."""
        out: dict[tuple[str, int], tuple[Any, ...]] = {}
        for s, prog in self.stages.items():
            x, t, ct = prog.one_microbatch()
            params = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self._compute_avals(s))
            loss = jax.ShapeDtypeStruct((), jnp.float32) if prog.last else None
            y, res, _ = jax.eval_shape(prog.forward, params, x, t, loss)
            in_ct, (computed, refs) = jax.eval_shape(prog.backward_input, res, ct)
            res_params, ref_params = prog.parameter_residuals()
            kept = _unheld(tuple(res), res_params)
            handoff = (*computed, *_unheld(tuple(refs), ref_params))
            out |= {("x", s): x, ("t", s): t, ("ct", s): ct, ("y", s): tuple(y), ("res", s): kept}
            out |= {("in_ct", s): tuple(in_ct), ("handoff", s): handoff}
            self._computed_handoff[s] = len(computed)
        return out

    def _compute_avals(self, s: int) -> tuple[Any, ...]:
        model = self.model
        prog = self.stages[s]
        cast = jax.eval_shape(lambda *p: prog.compute_params(p), *(model.param_avals[i] for i in model.stage_params[s]))
        return tuple(cast)

    def _lay_out(self) -> None:
        table, schedule, model = self.table, self.schedule, self.model
        shapes = self._shapes
        messages = {
            key: shapes[key]
            for s in range(schedule.num_stages)
            for key in ((("y", s),) if s + 1 < schedule.num_stages else ()) + ((("in_ct", s),) if s > 0 else ())
        }
        # One slot size for every message: the longest of each dtype.
        self.messages = _Rows(messages, union=True)
        self.message_size = self.messages.sizes
        devices = []
        flight: list[int] = []
        tick = {a.key: t for t, row in enumerate(table.actions) for a in row if a is not None}
        for d in range(schedule.num_devices):
            mine = schedule.stages_on(d)
            params = _Rows({i: (model.param_avals[i],) for s in mine for i in model.stage_params[s]})
            grads = _Rows({s: tuple(model.param_avals[i] for i in model.stage_params[s]) for s in mine})
            residuals = _Rows({s: shapes[("res", s)] for s in mine}, union=True)
            handoffs = _Rows({s: shapes[("handoff", s)] for s in mine}, union=True)
            held: list[tuple[Any, int, int]] = []
            handed: list[tuple[Any, int, int]] = []
            inbound: list[tuple[Any, int, int]] = []
            handed_until: dict[tuple[int, int], int] = {}
            for a in schedule.orders[d]:
                s, m = a.stage, a.microbatch
                if a.kind is Kind.F:
                    freed = tick[self._backward_of(s, m)]
                    held.append(((s, m), tick[a.key], freed))
                elif a.kind is Kind.I:
                    handed.append(((s, m), tick[a.key], tick[(Kind.W, s, m)]))
                    handed_until[(s, m)] = tick[(Kind.W, s, m)]
            for t, moves in enumerate(table.transfers):
                for move in moves:
                    if move.dst == d:
                        inbound.append((move.producer.key, t, tick[move.consumer.key]))
            # Values passed between stages on this device wait in the inbound slots too.
            for a in schedule.orders[d]:
                for producer in self._local_consumers(a):
                    inbound.append((a.key, tick[a.key], tick[producer]))
            # In flight, as the schedule counts it: from F to the end of the backward (W where split).
            flight.append(_slots([(k, t, handed_until.get(k, f)) for k, t, f in held])[1])
            residual_slot, _ = _slots(held)
            handoff_slot, _ = _slots(handed)
            message_slot, _ = _slots(inbound)
            devices.append(_Device(params, grads, residuals, handoffs, residual_slot, handoff_slot, message_slot))
        self.devices = tuple(devices)
        self.peak_held = tuple(flight)
        self.param_size = _padded([d.params.sizes for d in devices])
        self.grad_size = _padded([d.grads.sizes for d in devices])
        self.residual_size = _padded([d.residuals.sizes for d in devices])
        self.handoff_size = _padded([d.handoffs.sizes for d in devices])
        self.residual_count = max(1 + max(d.residual_slot.values(), default=-1) for d in devices)
        self.handoff_count = max((1 + max(d.handoff_slot.values(), default=-1) for d in devices), default=0)
        # One slot more: where a device that receives nothing in a permutation writes it.
        self.message_count = 1 + max((1 + max(d.message_slot.values(), default=-1) for d in devices), default=0)

    def _local_consumers(self, action: Action) -> tuple[tuple[Kind, int, int], ...]:
        """The actions on ``action``'s own device that read the value it produces for
        another stage (keys)."""
        schedule = self.schedule
        s, m = action.stage, action.microbatch
        here = schedule.placement[s]
        if action.kind is Kind.F and s + 1 < schedule.num_stages and schedule.placement[s + 1] == here:
            return ((Kind.F, s + 1, m),)
        if action.kind in (Kind.B, Kind.I) and s > 0 and schedule.placement[s - 1] == here:
            split = any(a.key == (Kind.I, s - 1, m) for a in schedule.orders[here])
            return ((Kind.I if split else Kind.B, s - 1, m),)
        return ()

    # -- resident state ---------------------------------------------------------------

    def holds(self) -> bool:
        """Whether the parameters are held here rather than by the workers."""
        return self._params is not None

    def settle(self) -> None:
        """Hand the parameters and optimizer state held here back to the workers (each
        device's values unpacked from its row, on its device)."""
        if self._params is None:
            return
        params, states = self._params, self._states
        self._params = self._states = None
        for w in self.workers:
            d = w.index
            row = {k: _row_of(v, d) for k, v in params.items()}
            layout = self.devices[d].params
            leaves = jax.jit(lambda r, layout=layout: {i: layout.get(r, i)[0] for i in layout.places})(row)
            theirs = None
            if states is not None:
                srow = {k: _row_of(v, d) for k, v in states.items()}
                slayout, treedefs = self._state_layouts[d], self._state_treedefs[d]
                theirs = jax.jit(
                    lambda r, slayout=slayout, treedefs=treedefs: {
                        s: jax.tree_util.tree_unflatten(treedefs[s], slayout.get(r, s)) for s in treedefs
                    }
                )(srow)
            w.load(leaves, theirs)

    def _pack(self, update: Update | None) -> None:
        """Take the workers' parameters (and optimizer state, for ``update``) into rows."""
        workers = self.workers
        if update is not None:
            for w in workers:
                w.place_states(update.optimizer, fresh=update.init)
            self._lay_out_states(update)
        param_rows = []
        state_rows = []
        for w in workers:
            d = w.index
            layout = self.devices[d].params
            sizes = self.param_size

            def pack(leaves: Any, layout: _Rows = layout, sizes: dict[str, int] = sizes) -> Rows:
                rows = {k: jnp.zeros((n,), k) for k, n in sorted(sizes.items())}
                for i in layout.places:
                    rows = layout.put(rows, i, (leaves[i],))
                return {k: v[None] for k, v in rows.items()}

            param_rows.append(jax.jit(pack)({i: w.leaves[i] for i in self.devices[d].params.places}))
            if update is not None:
                slayout, size = self._state_layouts[d], self._state_size

                def pack_states(states: Any, slayout: _Rows = slayout, size: dict[str, int] = size) -> Rows:
                    rows = {k: jnp.zeros((n,), k) for k, n in sorted(size.items())}
                    for s in slayout.places:
                        rows = slayout.put(rows, s, jax.tree_util.tree_leaves(states[s]))
                    return {k: v[None] for k, v in rows.items()}

                state_rows.append(jax.jit(pack_states)({s: w.states[s] for s in w.local}))
        self._params = self._sharded(param_rows)
        self._states = self._sharded(state_rows) if update is not None else None
        self._states_for = None if update is None else update.optimizer

    def _sharded(self, rows: Sequence[Rows]) -> Rows:
        """Per dtype, the devices' ``[1, n]`` rows (each on its device) as one ``[D, n]``
        array sharded over the stage axis (no copy)."""
        out = {}
        for k in rows[0]:
            parts = [r[k] for r in rows]
            out[k] = jax.make_array_from_single_device_arrays(
                (len(parts), parts[0].shape[1]), self.rows_at, [p.addressable_data(0) for p in parts]
            )
        return out

    def _lay_out_states(self, update: Update) -> None:
        """The optimizer state's rows for ``update.optimizer``."""
        optimizer = update.optimizer
        coupled = couples_through_global_norm(optimizer)
        model = self.model
        layouts, treedefs = [], []
        for w in self.workers:
            shapes = {}
            defs = {}
            for s in w.local:
                owned = jax.tree_util.tree_unflatten(
                    model.owned_treedefs[s], [model.param_avals[i] for i in model.owned(s)]
                )
                state = jax.eval_shape(lambda p: optimizer_init(optimizer, p, coupled=coupled), owned)
                leaves, defs[s] = jax.tree_util.tree_flatten(state)
                shapes[s] = tuple(leaves)
            layouts.append(_Rows(shapes))
            treedefs.append(defs)
        self._state_layouts = tuple(layouts)
        self._state_treedefs = tuple(treedefs)
        self._state_size = _padded([r.sizes for r in layouts])

    # -- the step ---------------------------------------------------------------------

    def run(
        self, inputs: Sequence[Any], targets: Sequence[Any], *, update: Update | None, keep_grads: bool
    ) -> tuple[WorkerStep, ...]:
        """One step over the batch's leaves; nothing is waited for."""
        for w in self.workers:
            w.start(update)
        if update is not None and (update.init or self._states_for is not update.optimizer):
            self.settle()
        if self._params is None or (update is not None and self._states is None):
            self._pack(update)
        optimizer = None if update is None else update.optimizer
        key = (None if update is None else (id(optimizer), update.skip_nonfinite), keep_grads)
        found = self._programs.get(key)
        if found is None or found[0] is not optimizer:
            found = self._programs[key] = (optimizer, self._program(update, keep_grads))
        program = found[1]
        assert self._params is not None
        # With an update the rows are donated: a program that fails after its dispatch may
        # have consumed them, which intact() then sees.
        params, states = self._params, self._states if update is not None else {}
        if self._in_flight is not None and len(self._in_flight) >= MAX_IN_FLIGHT:
            jax.block_until_ready(self._in_flight.popleft())
        new_params, new_states, loss, grads = program(params, states, tuple(inputs), tuple(targets))
        if self._in_flight is not None:
            self._in_flight.append(loss)
        if update is not None:
            self._params, self._states = new_params, new_states
            for w in self.workers:
                w.applied = True
        return tuple(
            WorkerStep(
                loss=loss if d == self.last else None,
                grads=grads.get(d, {}) if keep_grads else {},
                peak_held=self.peak_held[d],
                leftover=(),
                events=(),
            )
            for d in range(len(self.workers))
        )

    def intact(self) -> bool:
        """Whether the rows held here are still live (a program that failed after it was
        dispatched may have consumed its donated buffers)."""
        held = [*(self._params or {}).values(), *(self._states or {}).values()]
        return not any(v.is_deleted() for v in held)

    def wait(self) -> None:
        """Return once the rows held here are computed."""
        jax.block_until_ready((self._params, self._states))

    def _program(self, update: Update | None, keep_grads: bool) -> Callable[..., Any]:
        table, schedule = self.table, self.schedule
        mesh, stage_spec = self.mesh, PartitionSpec(STAGE)
        coupled = update is not None and couples_through_global_norm(update.optimizer)
        skip = update is not None and update.skip_nonfinite
        count = schedule.num_microbatches
        ticks = [self._tick(t) for t in range(table.num_ticks)]
        updates = [self._device_update(d, update, coupled) for d in range(schedule.num_devices)] if update else []

        def body(params: Rows, states: Rows, xs: Leaves, ts: Leaves) -> Any:
            params = {k: v[0] for k, v in params.items()}
            states = {k: v[0] for k, v in states.items()}
            me = lax.axis_index(STAGE)
            batch = (
                tuple(x.reshape((count, x.shape[0] // count, *x.shape[1:])) for x in xs),
                tuple(t.reshape((count, t.shape[0] // count, *t.shape[1:])) for t in ts),
            )
            held = (
                {k: jnp.zeros((n,), k) for k, n in sorted(self.grad_size.items())},
                jnp.zeros((), jnp.float32),
                {k: jnp.zeros((n * self.residual_count,), k) for k, n in sorted(self.residual_size.items())},
                {k: jnp.zeros((n * self.handoff_count,), k) for k, n in sorted(self.handoff_size.items())},
                {k: jnp.zeros((n * self.message_count,), k) for k, n in sorted(self.message_size.items())},
            )
            for index, branches, groups in ticks:
                if len(branches) > 1:
                    grads, loss, res, hand, inbox, out = lax.switch(
                        jnp.asarray(index)[me], branches, held, params, batch
                    )
                    held = (grads, loss, res, hand, inbox)
                    for pairs, slots in groups:
                        at = jnp.asarray(slots)[me]
                        for k, value in out.items():
                            got = lax.ppermute(value, STAGE, perm=pairs)
                            n = self.message_size[k]
                            inbox = {**inbox, k: lax.dynamic_update_slice(inbox[k], got, (at * n,))}
                        held = (grads, loss, res, hand, inbox)
            grads, loss = held[0], held[1]
            new_params, new_states = params, states
            if update is not None:
                finite = None
                if skip:
                    bad = sum((jnp.sum(~jnp.isfinite(v)) for v in grads.values() if _inexact(v)), jnp.int32(0))
                    bad = bad + (~jnp.isfinite(loss)).astype(jnp.int32)
                    finite = lax.psum(bad, STAGE) == 0
                total = None
                if coupled:
                    own = sum((jnp.sum(jnp.square(v.astype(jnp.float32))) for v in grads.values()), jnp.float32(0))
                    total = lax.psum(own, STAGE)
                new_params, new_states = lax.switch(me, updates, params, states, grads, finite, total)
            expanded = (
                {k: v[None] for k, v in new_params.items()},
                {k: v[None] for k, v in new_states.items()},
                loss[None],
                {k: v[None] for k, v in grads.items()} if keep_grads else {},
            )
            return expanded

        spec_rows = {k: stage_spec for k in self.param_size}
        spec_states = {k: stage_spec for k in self._state_size} if update is not None else {}
        sharded = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec_rows, spec_states, PartitionSpec(), PartitionSpec()),
            out_specs=(
                spec_rows,
                spec_states,
                stage_spec,
                {k: stage_spec for k in self.grad_size} if keep_grads else {},
            ),
            check_vma=False,
        )
        last, model, devices = self.last, self.model, self.devices

        def step(params: Rows, states: Rows, xs: Leaves, ts: Leaves) -> Any:
            new_params, new_states, losses, grads = sharded(params, states, xs, ts)
            per_device: dict[int, dict[int, Any]] = {}
            if keep_grads:
                for d, device in enumerate(devices):
                    row = {k: v[d] for k, v in grads.items()}
                    mine = {}
                    for s in schedule.stages_on(d):
                        for i, g in zip(model.stage_params[s], device.grads.get(row, s), strict=True):
                            mine[i] = g
                    per_device[d] = mine
            return new_params, new_states, losses[last], per_device

        replicated = NamedSharding(mesh, PartitionSpec())
        return jax.jit(
            step,
            donate_argnums=(0, 1) if update is not None else (),
            in_shardings=(self.rows_at, self.rows_at, replicated, replicated),
        )

    def _tick(
        self, t: int
    ) -> tuple[np.ndarray, list[Callable[..., Any]], list[tuple[list[tuple[int, int]], np.ndarray]]]:
        """Tick ``t``'s per-device branch index, branches (idle first) and permutations
        (each: its (src, dst) pairs and per device the inbound slot it writes, the spare
        slot where it receives nothing)."""
        table = self.table
        index = np.zeros(table.num_devices, np.int32)
        branches: list[Callable[..., Any]] = [self._idle]
        for d, action in enumerate(table.actions[t]):
            if action is not None:
                index[d] = len(branches)
                branches.append(self._branch(d, action))
        groups: list[tuple[list[tuple[int, int]], np.ndarray]] = []
        spare = self.message_count - 1
        for move in table.transfers[t]:
            group = next((g for g in groups if all(dst != move.dst for _, dst in g[0])), None)
            if group is None:
                group = ([], np.full(table.num_devices, spare, np.int32))
                groups.append(group)
            group[0].append((move.src, move.dst))
            group[1][move.dst] = self.devices[move.dst].message_slot[move.producer.key]
        return index, branches, groups

    def _outbox(self) -> Rows:
        return {k: jnp.zeros((n,), k) for k, n in sorted(self.message_size.items())}

    def _idle(self, held: Any, params: Rows, batch: Any) -> Any:
        return (*held, self._outbox())

    def _message_base(self, slot: int) -> dict[str, int]:
        return {k: slot * n for k, n in self.message_size.items()}

    def _branch(self, d: int, action: Action) -> Callable[..., Any]:
        """Device ``d``'s branch for ``action``: ``(held, params, batch) -> (*held, outbox)``."""
        schedule, model, device = self.schedule, self.model, self.devices[d]
        s, m, kind = action.stage, action.microbatch, action.kind
        prog = self.stages[s]
        messages = self.messages
        last = s == schedule.num_stages - 1
        res_base = (
            {k: device.residual_slot[(s, m)] * n for k, n in self.residual_size.items()} if kind is not Kind.W else {}
        )
        hand_slot = device.handoff_slot.get((s, m))
        hand_base = {k: hand_slot * n for k, n in self.handoff_size.items()} if hand_slot is not None else {}

        res_params, ref_params = prog.parameter_residuals()

        def stage_params(params: Rows) -> Leaves:
            return prog.compute_params(tuple(device.params.get(params, i)[0] for i in model.stage_params[s]))

        def send(inbox: Rows, name: tuple[str, int], values: Leaves, consumer: tuple[Kind, int, int] | None) -> Any:
            """Where the value goes: this device's inbox (a consumer here) or the outbox."""
            out = self._outbox()
            if consumer is None:
                return inbox, out
            here = self._local_consumers(action)
            if here:
                slot = device.message_slot[action.key]
                return messages.put(inbox, name, values, base=self._message_base(slot)), out
            return inbox, messages.put(out, name, values)

        def received(inbox: Rows, name: tuple[str, int], producer: tuple[Kind, int, int]) -> Leaves:
            return messages.get(inbox, name, base=self._message_base(device.message_slot[producer]))

        def run(held: Any, params: Rows, batch: Any) -> Any:
            grads, loss, res, hand, inbox = held
            if kind is Kind.F:
                x = tuple(b[m] for b in batch[0]) if s == 0 else received(inbox, ("y", s - 1), (Kind.F, s - 1, m))
                t = tuple(b[m] for b in batch[1]) if last else ()
                y, kept, new_loss = prog.forward(stage_params(params), x, t, loss if last else None)
                res = device.residuals.put(res, s, _unheld(tuple(kept), res_params), base=res_base)
                if last:
                    loss = new_loss
                consumer = None if last else (Kind.F, s + 1, m)
                inbox, out = send(inbox, ("y", s), tuple(y), consumer)
                return grads, loss, res, hand, inbox, out
            if kind is Kind.W:
                handoff = device.handoffs.get(hand, s, base=hand_base)
                computed_n = self._computed_handoff[s]
                refs = _rejoined(handoff[computed_n:], ref_params, stage_params(params))
                acc = device.grads.get(grads, s)
                new_acc = prog.backward_weight((handoff[:computed_n], refs), acc)
                return device.grads.put(grads, s, new_acc), loss, res, hand, inbox, self._outbox()
            kept = _rejoined(device.residuals.get(res, s, base=res_base), res_params, stage_params(params))
            ct = () if last else received(inbox, ("in_ct", s + 1), self._backward_of(s + 1, m))
            consumer = None if s == 0 else self._backward_of(s - 1, m)
            if kind is Kind.B:
                acc = device.grads.get(grads, s)
                in_ct, new_acc = prog.backward(kept, ct, acc)
                grads = device.grads.put(grads, s, new_acc)
            else:
                in_ct, (computed, refs) = prog.backward_input(kept, ct)
                handed = (*computed, *_unheld(tuple(refs), ref_params))
                hand = device.handoffs.put(hand, s, handed, base=hand_base)
            inbox, out = send(inbox, ("in_ct", s), tuple(in_ct), consumer)
            return grads, loss, res, hand, inbox, out

        return run

    def _backward_of(self, s: int, m: int) -> tuple[Kind, int, int]:
        """The key of (stage s, microbatch m)'s input-gradient action: its I where split, else its B."""
        order = self.schedule.orders[self.schedule.placement[s]]
        split = any(a.key == (Kind.I, s, m) for a in order)
        return (Kind.I if split else Kind.B, s, m)

    def _device_update(self, d: int, update: Update | None, coupled: bool) -> Callable[..., Any]:
        """Device ``d``'s update branch: ``(params, states, grads, finite, total) -> (params, states)``."""
        assert update is not None
        optimizer, model, device = update.optimizer, self.model, self.devices[d]
        slayout, treedefs = self._state_layouts[d], self._state_treedefs[d]
        mine = self.schedule.stages_on(d)

        def run(params: Rows, states: Rows, grads: Rows, finite: Any, total: Any) -> Any:
            for s in mine:
                owned = model.owned(s)
                treedef = model.owned_treedefs[s]
                p = jax.tree_util.tree_unflatten(treedef, [device.params.get(params, i)[0] for i in owned])
                acc = dict(zip(model.stage_params[s], device.grads.get(grads, s), strict=True))
                g = jax.tree_util.tree_unflatten(treedef, [acc[i] for i in owned])
                state = jax.tree_util.tree_unflatten(treedefs[s], slayout.get(states, s))
                rest = None
                if coupled:
                    own = sum((jnp.sum(jnp.square(v.astype(jnp.float32))) for v in acc.values()), jnp.float32(0))
                    rest = total - own
                new_p, new_state = optimizer_step(optimizer, finite, g, rest, state, p)
                for i, leaf in zip(owned, jax.tree_util.tree_leaves(new_p), strict=True):
                    params = device.params.put(params, i, (leaf,))
                states = slayout.put(states, s, jax.tree_util.tree_leaves(new_state))
            return params, states

        return run


def _unheld(values: Leaves, params: Sequence[int | None]) -> Leaves:
    """``values`` less those that are the stage's parameters (``params[k]`` not None):
    the parameters are in the program already, so slots keep only the rest."""
    return tuple(v for v, p in zip(values, params, strict=True) if p is None)


def _rejoined(kept: Leaves, params: Sequence[int | None], stage_params: Leaves) -> Leaves:
    """The values :func:`_unheld` thinned, the parameters back in their places."""
    rest = iter(kept)
    return tuple(next(rest) if p is None else stage_params[p] for p in params)


def _row_of(value: jax.Array, d: int) -> jax.Array:
    """Device ``d``'s ``[n]`` row of a ``[D, n]`` array sharded over the stage axis, on its device."""
    for shard in value.addressable_shards:
        if shard.index[0].start == d:
            return shard.data[0]
    raise AssertionError(f"no shard of row {d}")


def _inexact(value: Any) -> bool:
    return bool(jnp.issubdtype(value.dtype, jnp.inexact))
