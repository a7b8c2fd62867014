"""One SPMD program for the whole step, where every pipeline device is a JAX device of its own.

Dispatched action by action (or task by task, :mod:`pipedsl.tasks`), a step costs the host
a dispatch per program (on a TPU v5e host about 125 us plus a few microseconds per buffer),
so the host, not the devices, sets the pace. Here the step is one ``jax.jit`` of a
``jax.shard_map`` over a 1-D mesh of the pipeline devices (axis ``"stage"``), one dispatch
per step, which runs the schedule's tick table (:func:`pipedsl.ticks.tick_table`):

- the ticks are one ``lax.fori_loop``; at each, every device runs its action of the tick.
  The actions of one kind of one stage are one *part* (:class:`_Tables`), each a
  ``lax.while_loop`` of at most one trip (:func:`_once`), taken on the device whose action
  of the tick is one of that part's, so that the program holds one copy of each part's
  computation whatever the number of microbatches (unrolled, it held one per action, and
  took minutes to compile). What differs between a part's actions (its microbatch, the
  slots it reads and writes) is the device's row of a per-tick table, read once a tick.
  A loop, not a ``lax.switch``: XLA updates a loop's carry in place, where a conditional
  copies whatever it passes through or writes (every pool, at every tick);
- after a tick, its values move by ``lax.ppermute`` over fixed permutations of the (src,
  dst) pairs, each in a ``lax.cond`` that every device takes alike, run after the ticks
  where it moves a value;
- every device's state is uniform, as ``shard_map`` needs: its parameters (and their copy
  in the compute dtype, cast once a step), optimizer state, gradient accumulators,
  residual slots (as many as its peak of microbatches in flight), ``I``-to-``W`` hand-over
  slots and inbound-message slots are padded stacks, one per leaf shape and dtype
  (:class:`_Rows`; the slots ``[slots, n, *shape]``; the parameters and optimizer state
  one per leaf, which the update rewrites whole); an action reads and writes them at
  the places its row gives, a stack's entries written at once (:meth:`_Rows.put_all`,
  :meth:`_Rows.add`) so that XLA writes them in place; the slots are kept from step to
  step (donated to each), so that no step fills them with zeros first;
- the actions run the stage programs' own functions (:meth:`StageProgram.inlined`),
  and the optimizer update after the ticks runs the workers' (:func:`optimizer_step`),
  with the global norm's sum of squares summed over the stage axis where the optimizer
  couples leaves through it; parameters and optimizer state are donated.

On the Ray backend every process of the world runs this same program over a stage mesh of
the world's devices, each holding one pipeline device and bringing its rows (JAX's
multi-controller mode); only the program's permutes pass between processes.

The parameters and optimizer state stay in those rows between steps (sharded over the
stage axis); the workers get them back as their leaves and states (:meth:`TickedStep.settle`)
when anything else reads them. A step returns without waiting: its loss is a device value.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.errors import summary
from pipedsl.executor.runtime.optimizers import couples_through_global_norm
from pipedsl.executor.runtime.worker import (
    Update,
    Worker,
    WorkerStep,
    optimizer_init,
    optimizer_step,
)
from pipedsl.executor.stages.mesh import data_size
from pipedsl.executor.stages.model import StagedModel
from pipedsl.executor.stages.stage_program import StageProgram
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.ticks import TickTable, tick_table, ticks_fit

__all__ = ["MAX_IN_FLIGHT", "STAGE", "TickedStep", "program_failure", "ticks_apply"]

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


def ticks_apply(
    model: StagedModel, stages: Mapping[int, StageProgram], meshes: Sequence[Mesh], *, serial: bool = False
) -> bool:
    """Whether a step of ``model``, whose stages compiled are ``stages`` (every stage's, each
    on its pipeline device's mesh, one of ``meshes``), can run as one program over the stage
    axis: what :func:`~pipedsl.ticks.ticks_fit` asks (two or more pipeline devices, each one
    JAX device of its own; every parameter leaf used by one stage only), and no stage calling
    back into Python on the host (a callback that raises inside a program over several
    devices aborts the process, where the tasks apart raise an error that names the stage
    and action). Every process of a Ray world answers the same from the same stages.
    ``serial``: the pipeline devices all on one JAX device instead, each device's part of a
    tick run in turn (``RunOptions(fuse="ticks")``)."""
    used = [i for s in range(model.num_stages) for i in model.stage_params[s]]
    firsts = {m.devices.flat[0] for m in meshes}
    if serial and len(firsts) != 1:
        return False
    if not ticks_fit(
        pipeline_devices=len(meshes),
        devices_each=max((m.devices.size for m in meshes), default=0),
        shared_devices=not serial and len(firsts) != len(meshes),
        shared_parameters=len(used) != len(set(used)),
    ):
        return False
    return all(data_size(p.layout.mesh) == 1 and not p.calls_host for p in stages.values())


def program_failure(ticked: TickedStep, error: BaseException) -> str:
    """What to say of a step whose one program failed (XLA's error names no stage): the
    error, whether the donated parameters and optimizer state are gone, and how to find the
    failing action."""
    lost = "" if ticked.intact() else "; its donated parameters and optimizer state are gone"
    return (
        f"the step's one program over the pipeline devices failed: {summary(error)}{lost}. "
        "RunOptions(ticks=False) runs the tasks apart and names the one that fails"
    )


class _Rows:
    """Where named groups of values live in stacks, one stack per leaf shape and dtype
    (:func:`_key`): a ``[n, *shape]`` array whose entries are leaves of that shape, so that
    reading or writing one is indexing along the first axis (flat rows would make every
    read a reshape, which on a TPU re-lays the values out in its tiles: a step 2.7 times
    as long on the v5e). Per name, per leaf (key, entry, shape); ``sizes`` are the stacks'
    lengths. The groups follow one another, or with ``union`` each starts at 0 (a slot
    that holds any one of them). With ``alone`` each leaf is a stack of its own, ``[1,
    *shape]`` (the k-th leaf of a shape, on every device, keyed alike), for the parameters
    and the optimizer state, which the update rewrites leaf by leaf from their old values:
    a stack of several, built anew from its entries, is a new array that XLA copies in
    and out of the loop the update runs in (1.2 GB a step of parameters and Adam's state
    at the check model's real size over four devices), where a stack of one can be
    written in place, as a leaf apart is."""

    __slots__ = ("places", "sizes")

    def __init__(self, groups: Mapping[Any, Sequence[Any]], *, union: bool = False, alone: bool = False) -> None:
        sizes: dict[str, int] = {}
        used: dict[str, int] = {}
        self.places: dict[Any, tuple[tuple[str, int, tuple[int, ...]], ...]] = {}
        for name, leaves in groups.items():
            if union:
                used = {}
            places = []
            for leaf in leaves:
                key = _key(leaf)
                at = used.get(key, 0)
                used[key] = at + 1
                if alone:
                    key, at = f"{key}#{at}", 0
                places.append((key, at, tuple(leaf.shape)))
                sizes[key] = max(sizes.get(key, 0), at + 1)
            self.places[name] = tuple(places)
        self.sizes = sizes

    def get(self, rows: Rows, name: Hashable, *, slot: Any = None) -> Leaves:
        """Group ``name``'s values read from ``rows``, or with ``slot`` (a value of the
        program) from slot ``slot`` of slotted stacks (``[slots, n, *shape]``)."""
        if slot is None:
            return tuple(rows[key][at] for key, at, _ in self.places[name])
        return tuple(
            _row_major(lax.dynamic_slice(rows[key], (slot, at, *(0 for _ in shape)), (1, 1, *shape))).reshape(shape)
            for key, at, shape in self.places[name]
        )

    def put(self, rows: Rows, name: Hashable, values: Sequence[Any], *, slot: Any = None) -> Rows:
        """``rows`` with group ``name`` set to ``values`` (at ``slot``, as :meth:`get` reads)."""
        return self.put_all(rows, {name: values}, slot=slot)

    def put_all(self, rows: Rows, groups: Mapping[Hashable, Sequence[Any]], *, slot: Any = None) -> Rows:
        """``rows`` with each group of ``groups`` set to its values: per stack, one write of
        each run of consecutive entries (entry by entry, a write could come before a read of
        another entry that a later value needs, and XLA would copy the stack to keep that
        read right). A run that is the whole stack, computed from its own entries (an
        optimizer's update), is still a new array that XLA copies into the old one's place,
        unless it is a stack of one (``alone``)."""
        entries: dict[str, dict[int, Any]] = {}
        for name, values in groups.items():
            for (key, at, _), value in zip(self.places[name], values, strict=True):
                entries.setdefault(key, {})[at] = jnp.asarray(value).astype(rows[key].dtype)
        rows = dict(rows)
        for key, placed in entries.items():
            runs: list[list[int]] = []
            for at in sorted(placed):
                if runs and at == runs[-1][-1] + 1:
                    runs[-1].append(at)
                else:
                    runs.append([at])
            for run in runs:
                update = jnp.stack([placed[k] for k in run])
                if slot is None:
                    rows[key] = lax.dynamic_update_slice_in_dim(rows[key], update, run[0], 0)
                else:
                    rows[key] = _in_slot(rows[key], update, slot, at=run[0])
        return rows

    def add(self, rows: Rows, name: Hashable, values: Sequence[Any]) -> Rows:
        """``rows`` with ``values`` added to group ``name``'s: per stack, the group's entries
        read, summed and written back at once, which XLA makes in place (entry by entry,
        it reads an entry from the stack as it was, and copies the stack to keep that read
        right past the writes before it)."""
        entries: dict[str, list[Any]] = {}
        for (key, _, _), value in zip(self.places[name], values, strict=True):
            entries.setdefault(key, []).append(jnp.asarray(value).astype(rows[key].dtype))
        rows = dict(rows)
        for key, stack in entries.items():
            start, old = self._start(name, key), rows[key]
            summed = lax.dynamic_slice_in_dim(old, start, len(stack)) + jnp.stack(stack)
            rows[key] = lax.dynamic_update_slice_in_dim(old, summed, start, 0)
        return rows

    def _start(self, name: Hashable, key: str) -> int:
        """Where group ``name``'s entries in stack ``key`` start (they follow one another)."""
        return min(at for k, at, _ in self.places[name] if k == key)


def _key(leaf: Any) -> str:
    """The stack a leaf lives in: its dtype and shape, as ``"float32[512,1024]"``."""
    return f"{np.dtype(leaf.dtype).name}[{','.join(map(str, leaf.shape))}]"


def _blank(key: str, n: int, slots: int | None = None) -> jax.Array:
    """A stack of ``n`` zero leaves of :func:`_key` ``key`` (or a key of :class:`_Rows`
    ``alone``); with ``slots``, that many such stacks, ``[slots, n, *shape]``."""
    dtype, shape = key[: key.index("]")].split("[")
    return jnp.zeros((*(() if slots is None else (slots,)), n, *(int(d) for d in shape.split(",") if d)), dtype)


def _padded(sizes: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Per stack, the longest of the devices'."""
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
    stage, in a slot) and inbound messages (by (kind, stage) of the value, in a slot); the
    slot of each held value."""

    params: _Rows
    grads: _Rows
    residuals: _Rows
    handoffs: _Rows
    residual_slot: dict[tuple[int, int], int]
    handoff_slot: dict[tuple[int, int], int]
    message_slot: dict[tuple[Kind, int, int], int]


@dataclass(frozen=True, slots=True)
class _Tables:
    """The step's ticks as one table the program indexes with the tick and the device, so
    that its loop over the ticks holds each part's computation once.

    Attributes:
      parts: (kind, stage) of each part, the actions of one kind of one stage.
      permutations: the (src, dst) pairs of each permutation, together every pair that
        moves a value, each device at most once a source and once a destination in each.
      columns: the names of ``places``'s columns: ``"part"`` (the 1-based index into
        ``parts`` of the device's action; 0: idle), ``"microbatch"``, its ``"residual"``
        and ``"handoff"`` slots, the inbound slot of the message it ``"reads"`` and of the
        value it passes to a stage on the same device (``"local"``), 0 where it has none;
        per permutation p, ``f"moves {p}"`` (1 where it moves a value after the tick, on
        every device alike) and ``f"inbound {p}"`` (the inbound slot the device writes
        what it receives to, the spare slot where it receives nothing).
      places: per tick, per device, its ``columns``; shape (T, D, C), int32.
    """

    parts: tuple[tuple[Kind, int], ...]
    permutations: tuple[tuple[tuple[int, int], ...], ...]
    columns: tuple[str, ...]
    places: np.ndarray

    def row(self, t: Any, d: Any) -> jax.Array:
        """Device ``d``'s row at tick ``t`` (both values of the program), shape (C,): one
        read of the table, so that a tick costs a device one index, not one per place."""
        return lax.dynamic_slice(jnp.asarray(self.places), (t, d, 0), (1, 1, len(self.columns))).reshape(-1)

    def named(self, row: jax.Array) -> dict[str, Any]:
        """``row``'s entries by column."""
        return {name: row[c] for c, name in enumerate(self.columns)}


class TickedStep:
    """The whole step of ``schedule`` (each pipeline device a JAX device of its own, see
    :func:`ticks_apply`) as one program per kind of step (an optimizer's, skipping a
    non-finite update or not, or gradients only), traced on its first use.

    ``meshes`` are every pipeline device's, ``stages`` every stage's compiled programs;
    ``workers`` are the pipeline devices this process holds: all of them on the local
    backend, its own in a Ray world, whose every process calls the same program on the
    shards it holds (JAX's multi-controller mode: each process's rows are its devices'
    shards of the global arrays). Nothing here talks to another process but the program."""

    def __init__(
        self,
        workers: Sequence[Worker],
        meshes: Sequence[Mesh],
        *,
        schedule: Schedule,
        stages: Mapping[int, StageProgram],
        serial: bool = False,
    ) -> None:
        self.workers = tuple(workers)
        self.meshes = tuple(meshes)
        self.schedule = schedule
        self.table: TickTable = tick_table(schedule)
        self.serial = serial
        if serial:
            # Every pipeline device on the one JAX device of the first: the rows are whole
            # arrays there, and each device's part of a tick runs in turn.
            self.mesh = Mesh(np.array([meshes[0].devices.flat[0]], dtype=object), (STAGE,))
            self.rows_at = NamedSharding(self.mesh, PartitionSpec())
        else:
            self.mesh = Mesh(np.array([m.devices.flat[0] for m in meshes], dtype=object), (STAGE,))
            self.rows_at = NamedSharding(self.mesh, PartitionSpec(STAGE))
        model = self.workers[0].model
        self.model = model
        self.last = schedule.placement[-1]
        self.stages = {s: program.inlined() for s, program in stages.items()}
        # Per stage, how many leaves of its I-to-W hand-over I computes (the rest it passes on).
        self._computed_handoff: dict[int, int] = {}
        self._shapes = self._value_shapes()
        self._lay_out()
        # The whole batch's leaves: the first stage's inputs and the last's targets of one
        # microbatch, times the microbatches; and the zeros that stand for them elsewhere.
        count = schedule.num_microbatches
        self._input_shapes = _times(self._shapes[("x", 0)], count)
        self._target_shapes = _times(self._shapes[("t", model.num_stages - 1)], count)
        self._zeros: dict[tuple[int, tuple[int, ...], str], Any] = {}
        self.tables = self._tables()
        # The program's permutations in a step, every device taking part in each: after
        # each tick, those that move a value, one per stack of the messages.
        moves = [c for c, name in enumerate(self.tables.columns) if name.startswith("moves")]
        self.permutations = len(self.message_size) * int(self.tables.places[:, 0, moves].sum())
        # The parameters (and, once an optimizer step ran, its state) as rows sharded over
        # the stage axis, while this step holds them rather than the workers.
        self._params: Rows | None = None
        self._states: Rows | None = None
        self._states_for: Any = None  # the optimizer whose state _states holds
        self._state_layouts: tuple[_Rows, ...] = ()
        self._state_treedefs: tuple[dict[int, Any], ...] = ()
        self._state_size: dict[str, int] = {}
        self._states_laid_out: Any = None  # the optimizer the state's layouts are for
        self._converters: dict[tuple[str, int], Callable[..., Any]] = {}
        # The residual, hand-over and inbound slots, kept from step to step (donated to each
        # and given back by it) so that no step fills them with zeros first: a step writes
        # every slot before it reads it. Per device on one device when run serially.
        self._slots: Any = None
        self._make_slots: Callable[[], Any] | None = None
        self._programs: dict[Any, tuple[Any, Callable[..., Any]]] = {}
        # The losses of the steps in flight, on CPU devices (MAX_IN_FLIGHT says why).
        cpu = self.mesh.devices.flat[0].platform == "cpu"
        self._in_flight: deque[Any] | None = deque() if cpu and not serial else None

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
        # One slot size for every message: per stack, the most any message has.
        self.messages = _Rows(messages, union=True)
        self.message_size = self.messages.sizes
        devices = []
        flight: list[int] = []
        tick = {a.key: t for t, row in enumerate(table.actions) for a in row if a is not None}
        for d in range(schedule.num_devices):
            mine = schedule.stages_on(d)
            params = _Rows({i: (model.param_avals[i],) for s in mine for i in model.stage_params[s]}, alone=True)
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
        # Per stack of the parameters, the dtype its stages compute in, where they agree.
        compute: dict[str, set[Any]] = {}
        for s in range(schedule.num_stages):
            for i, aval in zip(model.stage_params[s], self._compute_avals(s), strict=True):
                compute.setdefault(_key(model.param_avals[i]), set()).add(np.dtype(aval.dtype))
        self._compute_dtype = {k: next(iter(v)) for k, v in compute.items() if len(v) == 1}
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

    def transfers_of(self, d: int) -> int:
        """The values device ``d`` sends or receives in a step."""
        return sum(d in (move.src, move.dst) for moves in self.table.transfers for move in moves)

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
        self._slots = None  # the workers' programs may want the memory
        for w in self.workers:
            d = w.index
            leaves = self._converter("unpack params", d)({k: self._row(v, d) for k, v in params.items()})
            theirs = None
            if states is not None:
                theirs = self._converter("unpack states", d)({k: self._row(v, d) for k, v in states.items()})
            w.load(leaves, theirs)

    def _row(self, value: jax.Array, d: int) -> jax.Array:
        """Device ``d``'s ``[n, ...]`` stack of those held here: of a ``[D, n, ...]`` array sharded over
        the stage axis, on its device; run serially, of the tuple of the devices' stacks."""
        return value[d] if self.serial else _row_of(value, d)

    def _pack(self, update: Update | None) -> None:
        """Take the workers' parameters (and optimizer state, for ``update``) into rows."""
        workers = self.workers
        if update is not None:
            for w in workers:
                w.place_states(update.optimizer, fresh=update.init)
            if self._states_laid_out is not update.optimizer:
                self._lay_out_states(update)
        param_rows = []
        state_rows = []
        for w in workers:
            d = w.index
            param_rows.append(
                self._converter("pack params", d)({i: w.leaves[i] for i in self.devices[d].params.places})
            )
            if update is not None:
                state_rows.append(self._converter("pack states", d)({s: w.states[s] for s in w.local}))
        self._params = self._sharded(param_rows)
        self._states = self._sharded(state_rows) if update is not None else None
        self._states_for = None if update is None else update.optimizer

    def _converter(self, what: str, d: int) -> Callable[..., Any]:
        """Device ``d``'s jitted conversion between its values and its rows, made once
        (the optimizer state's, once per layout of it): ``"pack params"`` (leaves by flat
        index to ``[1, n, ...]`` stacks, ``[n, ...]`` run serially), ``"pack states"``
        (states by stage), ``"unpack params"``, ``"unpack states"`` and ``"unpack grads"``
        (``[n, ...]`` stacks back; the gradients by flat leaf)."""
        found = self._converters.get((what, d))
        if found is not None:
            return found
        params, size = self.devices[d].params, self.param_size
        states, state_size = (self._state_layouts[d], self._state_size) if "states" in what else (params, size)
        treedefs = self._state_treedefs[d] if "states" in what else {}

        def shard(rows: Rows) -> Rows:
            # A device's shard of the [D, n, ...] rows; run serially, its [n, ...] rows themselves.
            return rows if self.serial else {k: v[None] for k, v in rows.items()}

        def pack_params(leaves: Any) -> Rows:
            rows = {k: _blank(k, n) for k, n in sorted(size.items())}
            return shard(params.put_all(rows, {i: (leaves[i],) for i in params.places}))

        def pack_states(values: Any) -> Rows:
            rows = {k: _blank(k, n) for k, n in sorted(state_size.items())}
            return shard(states.put_all(rows, {s: jax.tree_util.tree_leaves(values[s]) for s in states.places}))

        def unpack_params(row: Rows) -> Any:
            return {i: params.get(row, i)[0] for i in params.places}

        def unpack_states(row: Rows) -> Any:
            return {s: jax.tree_util.tree_unflatten(treedefs[s], states.get(row, s)) for s in treedefs}

        def unpack_grads(row: Rows) -> Any:
            grads, model = self.devices[d].grads, self.model
            return {i: g for s in grads.places for i, g in zip(model.stage_params[s], grads.get(row, s), strict=True)}

        made = {
            "pack params": pack_params, "pack states": pack_states,
            "unpack params": unpack_params, "unpack states": unpack_states, "unpack grads": unpack_grads,
        }[what]  # fmt: skip
        # Unpacked values are placed on the device's own mesh, as its worker keeps them.
        placed = None if what.startswith("pack") else NamedSharding(self.meshes[d], PartitionSpec())
        found = self._converters[(what, d)] = jax.jit(made, out_shardings=placed)
        return found

    def _sharded(self, rows: Sequence[Rows]) -> Rows:
        """Per stack, the ``[1, n, ...]`` stacks of the devices held here (each on its device)
        as this process's shards of one ``[D, n, ...]`` array sharded over the stage axis (no
        copy); run serially, the tuple of the devices' ``[n, ...]`` stacks."""
        out: Rows = {}
        for k in rows[0]:
            parts = [r[k] for r in rows]
            if self.serial:
                out[k] = tuple(parts)
                continue
            out[k] = jax.make_array_from_single_device_arrays(
                (self.table.num_devices, *parts[0].shape[1:]), self.rows_at, [p.addressable_data(0) for p in parts]
            )
        return out

    def _lay_out_states(self, update: Update) -> None:
        """The optimizer state's rows for ``update.optimizer``."""
        optimizer = update.optimizer
        coupled = couples_through_global_norm(optimizer)
        model = self.model
        layouts, treedefs = [], []
        for d in range(self.table.num_devices):
            shapes = {}
            defs = {}
            for s in self.schedule.stages_on(d):
                owned = jax.tree_util.tree_unflatten(
                    model.owned_treedefs[s], [model.param_avals[i] for i in model.owned(s)]
                )
                state = jax.eval_shape(lambda p: optimizer_init(optimizer, p, coupled=coupled), owned)
                leaves, defs[s] = jax.tree_util.tree_flatten(state)
                shapes[s] = tuple(leaves)
            layouts.append(_Rows(shapes, alone=True))
            treedefs.append(defs)
        self._state_layouts = tuple(layouts)
        self._state_treedefs = tuple(treedefs)
        self._state_size = _padded([r.sizes for r in layouts])
        self._states_laid_out = optimizer
        for key in [k for k in self._converters if "states" in k[0]]:
            del self._converters[key]

    # -- the step ---------------------------------------------------------------------

    def run(
        self, inputs: Sequence[Any], targets: Sequence[Any], *, update: Update | None, keep_grads: bool
    ) -> tuple[WorkerStep, ...]:
        """One step over the batch's leaves (the inputs where the first stage is held here,
        the targets where the last is; on a process that holds neither, none); nothing is
        waited for. Returns the step of each worker held here."""
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
        if self.serial:
            xs, ts = tuple(inputs), tuple(targets)
        else:
            xs = self._batch(inputs, self.schedule.placement[0], self._input_shapes)
            ts = self._batch(targets, self.last, self._target_shapes)
        # The step consumes the slots it is given (donated): a step that fails leaves none,
        # and the next makes them anew.
        slots, self._slots = self._slots if self._slots is not None else self._fresh_slots(), None
        new_params, new_states, self._slots, loss, grads = program(params, states, slots, xs, ts)
        if self._in_flight is not None:
            self._in_flight.append(loss)
        if update is not None:
            self._params, self._states = new_params, new_states
            for w in self.workers:
                w.applied = True
        return tuple(
            WorkerStep(
                loss=loss if w.index == self.last else None,
                grads=self._converter("unpack grads", w.index)({k: self._row(v, w.index) for k, v in grads.items()})
                if keep_grads
                else {},
                peak_held=self.peak_held[w.index],
                leftover=(),
                events=(),
            )
            for w in self.workers
        )

    def _batch(self, leaves: Sequence[Any], owner: int, shapes: Leaves) -> Leaves:
        """The batch's ``leaves`` (shaped ``shapes``) as ``[D * n, ...]`` arrays sharded over
        the stage axis: device ``owner``'s block the leaf, every other device's zeros (made
        once) that it never reads. This process brings the blocks of the devices it holds:
        ``leaves`` where it holds ``owner``, else none."""
        held = [w.index for w in self.workers]
        out = []
        for k, shape in enumerate(shapes):
            blocks = []
            for d in held:
                device = self.mesh.devices.flat[d]
                if d == owner:
                    blocks.append(jax.device_put(leaves[k], device))
                else:
                    key = (d, tuple(shape.shape), np.dtype(shape.dtype).name)
                    zeros = self._zeros.get(key)
                    if zeros is None:
                        zeros = self._zeros[key] = jax.device_put(np.zeros(shape.shape, shape.dtype), device)
                    blocks.append(zeros)
            whole = (self.table.num_devices * shape.shape[0], *shape.shape[1:])
            out.append(jax.make_array_from_single_device_arrays(whole, self.rows_at, blocks))
        return tuple(out)

    def intact(self) -> bool:
        """Whether the rows held here are still live (a program that failed after it was
        dispatched may have consumed its donated buffers)."""
        return not any(v.is_deleted() for v in jax.tree_util.tree_leaves((self._params, self._states)))

    def wait(self) -> None:
        """Return once the rows held here are computed."""
        jax.block_until_ready((self._params, self._states))

    def _slot_sizes(self) -> dict[str, tuple[int, dict[str, int]]]:
        """Per pool of slots, the number of slots and each stack's entries in a slot (no
        stacks where there are no slots: a schedule without ``I`` and ``W`` hands nothing over)."""
        pools = {
            "res": (self.residual_count, self.residual_size),
            "hand": (self.handoff_count, self.handoff_size),
            "inbox": (self.message_count, self.message_size),
        }
        return {name: (count, sizes if count else {}) for name, (count, sizes) in pools.items()}

    def _fresh_slots(self) -> Any:
        """Zeroed slots for the step's first use (or after a failed step consumed them):
        ``[D, slots, n, *shape]`` stacks sharded over the stage axis, or run serially, each
        device's ``[slots, n, *shape]`` stacks on the one device."""
        if self._make_slots is None:
            sizes, devices = self._slot_sizes(), self.table.num_devices

            def one() -> dict[str, Rows]:
                return {
                    name: {k: _blank(k, n, count) for k, n in sorted(ns.items())} for name, (count, ns) in sizes.items()
                }

            def make() -> Any:
                if self.serial:
                    return [one() for _ in range(devices)]
                return jax.tree_util.tree_map(lambda v: jnp.broadcast_to(v, (devices, *v.shape)), one())

            self._make_slots = jax.jit(make, out_shardings=self.rows_at)
        return self._make_slots()

    def _program(self, update: Update | None, keep_grads: bool) -> Callable[..., Any]:
        schedule, tables = self.schedule, self.tables
        coupled = update is not None and couples_through_global_norm(update.optimizer)
        skip = update is not None and update.skip_nonfinite
        count, num_devices = schedule.num_microbatches, schedule.num_devices
        bodies = [self._body(kind, s) for kind, s in tables.parts]
        mine = [
            [j for j, (_, s) in enumerate(tables.parts, 1) if schedule.placement[s] == d] for d in range(num_devices)
        ]
        updates = [self._device_update(d, update, coupled) for d in range(num_devices)] if update else []
        slot_sizes = self._slot_sizes()

        # One device's part of the step, whether the devices run it side by side (one
        # program over the stage axis) or in turn on one device (serial): its pools, a
        # tick's action on them, a permuted message taken in, and its update.
        def begin(params: Rows, slots: dict[str, Rows]) -> tuple[dict[str, Any], dict[str, Any]]:
            # What the actions write (the slots as the last step left them), and the
            # parameters once in the compute dtype, for every action of the step only to read.
            pools = {
                "grads": {k: _blank(k, n) for k, n in sorted(self.grad_size.items())},
                "loss": jnp.zeros((), jnp.float32),
                **slots,
                "out": self._outbox(),
            }
            return pools, {k: v.astype(self._compute_dtype.get(k, v.dtype)) for k, v in params.items()}

        def compute(row: jax.Array, pools: dict[str, Any], reads: dict[str, Any], parts: Sequence[int]) -> Any:
            # Each part is a loop of at most one trip, taken on the device whose action of
            # the tick is one of that part's (_once), at the places its ``row`` gives. The
            # row goes through each loop with the pools: what a body computes from it
            # alone, XLA would otherwise hoist out of the loop, into every tick for every
            # part, taken or not.
            def placed(j: int, carry: tuple[jax.Array, dict[str, Any]]) -> tuple[jax.Array, dict[str, Any]]:
                row, pools = carry
                return row, bodies[j - 1](pools, reads=reads, at=tables.named(row))

            for j in parts:
                row, pools = _once(tables.named(row)["part"] == j, functools.partial(placed, j), (row, pools))
            return pools

        def checks(pools: dict[str, Any]) -> tuple[Any, Any]:
            """This device's count of non-finite values and sum of squared gradients, for
            the update's skip and global norm (each summed over the devices), as needed."""
            grads = pools["grads"]
            bad = own = None
            if skip:
                bad = sum((jnp.sum(~jnp.isfinite(v)) for v in grads.values() if _inexact(v)), jnp.int32(0))
                bad = bad + (~jnp.isfinite(pools["loss"])).astype(jnp.int32)
            if coupled:
                own = sum((jnp.sum(jnp.square(v.astype(jnp.float32))) for v in grads.values()), jnp.float32(0))
            return bad, own

        def end(params: Rows, states: Rows, pools: dict[str, Any], me: Any, bad: Any, own: Any) -> Any:
            grads = pools["grads"]
            if update is not None:
                finite = None if bad is None else bad == 0
                for d, device_update in enumerate(updates):
                    params, states = _once(
                        me == d,
                        functools.partial(device_update, grads=grads, finite=finite, total=own),
                        (params, states),
                    )
            slots = {name: pools[name] for name in slot_sizes}
            return params, states, slots, pools["loss"], grads if keep_grads else {}

        def microbatches(xs: Leaves, ts: Leaves) -> Any:
            return (
                tuple(x.reshape((count, x.shape[0] // count, *x.shape[1:])) for x in xs),
                tuple(t.reshape((count, t.shape[0] // count, *t.shape[1:])) for t in ts),
            )

        def body(params: Rows, states: Rows, slots: dict[str, Rows], xs: Leaves, ts: Leaves) -> Any:
            params, states, slots = jax.tree_util.tree_map(lambda v: v[0], (params, states, slots))
            me = lax.axis_index(STAGE)
            pools, weights = begin(params, slots)
            reads = {"weights": weights, "batch": microbatches(xs, ts)}

            def tick(t: Any, pools: dict[str, Any]) -> dict[str, Any]:
                row = tables.row(t, me)
                at = tables.named(row)
                pools = compute(row, pools, reads, range(1, len(bodies) + 1))
                for p, pairs in enumerate(tables.permutations):
                    # A permutation runs after the ticks where it moves a value (the same
                    # on every device); the message each device receives goes to its
                    # inbound slot, or the spare one.
                    got = lax.cond(
                        at[f"moves {p}"] > 0,
                        lambda out, pairs=pairs: {k: lax.ppermute(v, STAGE, perm=pairs) for k, v in out.items()},
                        lambda out: out,
                        pools["out"],
                    )
                    pools = {**pools, "inbox": _into(pools["inbox"], got, at[f"inbound {p}"])}
                return pools

            pools = lax.fori_loop(0, len(tables.places), tick, pools)
            bad, own = checks(pools)
            bad, own = (None if v is None else lax.psum(v, STAGE) for v in (bad, own))
            return jax.tree_util.tree_map(lambda v: v[None], end(params, states, pools, me, bad, own))

        def serial(params: Rows, states: Rows, slots: list[dict[str, Rows]], xs: Leaves, ts: Leaves, mes: Any) -> Any:
            # The devices' parts in turn, each with its index ``mes[d]`` a value of the
            # program (not a constant XLA would fold), so that each runs what it runs on a
            # device of its own: a loop over the same pools. A permutation, after the
            # ticks where it moves a value, copies each source's message into its
            # destination's inbound slot (the spare one where that pair moves nothing):
            # a loop of at most one trip over the inboxes it writes.
            rows = [
                ({k: v[d] for k, v in params.items()}, {k: v[d] for k, v in states.items()}) for d in range(num_devices)
            ]
            batch = microbatches(xs, ts)
            begun = [begin(p, slots[d]) for d, (p, _) in enumerate(rows)]
            reads = [{"weights": weights, "batch": batch} for _, weights in begun]

            def tick(t: Any, pools: list[dict[str, Any]]) -> list[dict[str, Any]]:
                places = [tables.row(t, mes[d]) for d in range(num_devices)]
                pools = [compute(places[d], pools[d], reads[d], mine[d]) for d in range(num_devices)]
                for p, pairs in enumerate(tables.permutations):
                    sent = [pools[src]["out"] for src, _ in pairs]
                    inbound = [tables.named(places[dst])[f"inbound {p}"] for _, dst in pairs]
                    inboxes = _once(
                        tables.named(places[0])[f"moves {p}"] > 0,
                        functools.partial(_into_each, sent=sent, slots=inbound),
                        [pools[dst]["inbox"] for _, dst in pairs],
                    )
                    for (_, dst), inbox in zip(pairs, inboxes, strict=True):
                        pools[dst] = {**pools[dst], "inbox": inbox}
                return pools

            pools = lax.fori_loop(0, len(tables.places), tick, [pools for pools, _ in begun])
            parts = [checks(p) for p in pools]
            bad, own = (None if parts[0][i] is None else sum(p[i] for p in parts) for i in (0, 1))
            ends = [end(*rows[d], pools[d], mes[d], bad, own) for d in range(num_devices)]
            # Each device's values stay its own arrays, not stacked: a stack would copy them.
            new_params, new_states, new_slots, losses, grads = zip(*ends, strict=True)

            def apart(rows: Sequence[Rows]) -> Rows:
                return {key: tuple(r[key] for r in rows) for key in rows[0]}

            return apart(new_params), apart(new_states), list(new_slots), jnp.stack(losses), apart(grads)

        last = self.last
        ran: Callable[..., Any]

        def step(params: Rows, states: Rows, slots: Any, xs: Leaves, ts: Leaves, *mes: Any) -> Any:
            new_params, new_states, new_slots, losses, grads = ran(params, states, slots, xs, ts, *mes)
            return new_params, new_states, new_slots, losses[last], grads

        donated = (0, 1, 2) if update is not None else (2,)
        # Every argument on the rows' sharding, whatever sharding alike it comes with (the
        # slots made fresh, or as the last step left them): else the second step would be
        # compiled again, as long as the first.
        if self.serial:
            ran = serial
            jitted = jax.jit(step, donate_argnums=donated, in_shardings=self.rows_at)
            mes = jax.device_put(np.arange(num_devices, dtype=np.int32), self.rows_at)
            return lambda params, states, slots, xs, ts: jitted(params, states, slots, xs, ts, mes)
        stage_spec = PartitionSpec(STAGE)
        states_size = self._state_size if update is not None else {}
        slot_specs = {name: {k: stage_spec for k in ns} for name, (_, ns) in slot_sizes.items()}
        ran = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(
                {k: stage_spec for k in self.param_size},
                {k: stage_spec for k in states_size},
                slot_specs,
                stage_spec,
                stage_spec,
            ),
            out_specs=(
                {k: stage_spec for k in self.param_size},
                {k: stage_spec for k in states_size},
                slot_specs,
                stage_spec,
                {k: stage_spec for k in self.grad_size} if keep_grads else {},
            ),
            check_vma=False,
        )
        return jax.jit(step, donate_argnums=donated, in_shardings=self.rows_at)

    def _tables(self) -> _Tables:
        """The tick table as :class:`_Tables`: its ticks where some device runs an action,
        each action's places from its device's layout, and its moves grouped into
        permutations."""
        table = self.table
        ticks = [t for t, row in enumerate(table.actions) if any(a is not None for a in row)]
        parts = sorted(
            {(a.kind, a.stage) for t in ticks for a in table.actions[t] if a is not None},
            key=lambda p: (p[1], p[0].value),
        )
        pairs = sorted({(m.src, m.dst) for t in ticks for m in table.transfers[t]})
        permutations: list[list[tuple[int, int]]] = []
        for src, dst in pairs:
            perm = next((p for p in permutations if all(src != a and dst != b for a, b in p)), None)
            if perm is None:
                perm = []
                permutations.append(perm)
            perm.append((src, dst))
        columns = ["part", "microbatch", "residual", "handoff", "reads", "local"]
        columns += [f"{what} {p}" for p in range(len(permutations)) for what in ("moves", "inbound")]
        column = {name: c for c, name in enumerate(columns)}
        places = np.zeros((len(ticks), table.num_devices, len(columns)), np.int32)
        for p in range(len(permutations)):
            places[:, :, column[f"inbound {p}"]] = self.message_count - 1
        for i, t in enumerate(ticks):
            for d, action in enumerate(table.actions[t]):
                if action is None:
                    continue
                device, key = self.devices[d], (action.stage, action.microbatch)
                read = self._reads(action)
                places[i, d, column["part"]] = 1 + parts.index((action.kind, action.stage))
                places[i, d, column["microbatch"]] = action.microbatch
                places[i, d, column["residual"]] = device.residual_slot.get(key, 0)
                places[i, d, column["handoff"]] = device.handoff_slot.get(key, 0)
                places[i, d, column["reads"]] = 0 if read is None else device.message_slot[read]
                if self._local_consumers(action):
                    places[i, d, column["local"]] = device.message_slot[action.key]
            for move in table.transfers[t]:
                p = next(p for p, perm in enumerate(permutations) if (move.src, move.dst) in perm)
                places[i, :, column[f"moves {p}"]] = 1
                places[i, move.dst, column[f"inbound {p}"]] = self.devices[move.dst].message_slot[move.producer.key]
        return _Tables(
            parts=tuple(parts),
            permutations=tuple(tuple(p) for p in permutations),
            columns=tuple(columns),
            places=places,
        )

    def _reads(self, action: Action) -> tuple[Kind, int, int] | None:
        """The key of the action whose value ``action`` reads from another stage, if any."""
        s, m = action.stage, action.microbatch
        if action.kind is Kind.F:
            return (Kind.F, s - 1, m) if s > 0 else None
        if action.kind in (Kind.B, Kind.I) and s + 1 < self.schedule.num_stages:
            return self._backward_of(s + 1, m)
        return None

    def _outbox(self) -> Rows:
        return {k: _blank(k, n) for k, n in sorted(self.message_size.items())}

    def _body(self, kind: Kind, s: int) -> Callable[..., dict[str, Any]]:
        """The ``kind`` actions of stage ``s`` on its device's pools (``pools -> pools``),
        any microbatch's: it reads and writes them at the places ``at`` gives (the
        microbatch, its residual and hand-over slots, the inbound slot of the message it
        reads and of its value for a stage on the same device), each a value of the tick,
        and sets the tick's outbox."""
        model, device = self.model, self.devices[self.schedule.placement[s]]
        prog = self.stages[s]
        messages = self.messages
        last = s == self.schedule.num_stages - 1
        res_params, ref_params = prog.parameter_residuals()
        # Whether it reads a value of another stage, and passes one to a stage on its own
        # device: the same for every microbatch, as the stages' placement decides.
        any_one = Action(kind, s, 0)
        reads_message = self._reads(any_one) is not None
        local = bool(self._local_consumers(any_one))

        def run(pools: dict[str, Any], *, reads: dict[str, Any], at: dict[str, Any]) -> dict[str, Any]:
            grads, res, hand, inbox, out = (pools[k] for k in ("grads", "res", "hand", "inbox", "out"))
            loss, batch, m = pools["loss"], reads["batch"], at["microbatch"]
            read_at, res_at, hand_at = at["reads"], at["residual"], at["handoff"]
            params = prog.compute_params(
                tuple(device.params.get(reads["weights"], i)[0] for i in model.stage_params[s])
            )
            # The stage's programs add their gradients to the accumulators they are given:
            # given zeros, they give the gradients, which the body adds in place.
            nothing = tuple(jnp.zeros(shape, key.split("[")[0]) for key, _, shape in device.grads.places[s])
            if kind is Kind.F:
                x = tuple(_at(b, m) for b in batch[0]) if s == 0 else messages.get(inbox, ("y", s - 1), slot=read_at)
                t = tuple(_at(b, m) for b in batch[1]) if last else ()
                y, kept, new_loss = prog.forward(params, x, t, loss if last else None)
                res = device.residuals.put(res, s, _unheld(tuple(kept), res_params), slot=res_at)
                if last:
                    loss = new_loss
                else:
                    out = messages.put(out, ("y", s), tuple(y))
            elif kind is Kind.W:
                handoff = device.handoffs.get(hand, s, slot=hand_at)
                computed_n = self._computed_handoff[s]
                refs = _rejoined(handoff[computed_n:], ref_params, params)
                grads = device.grads.add(grads, s, prog.backward_weight((handoff[:computed_n], refs), nothing))
            else:
                kept = _rejoined(device.residuals.get(res, s, slot=res_at), res_params, params)
                ct = messages.get(inbox, ("in_ct", s + 1), slot=read_at) if reads_message else ()
                if kind is Kind.B:
                    in_ct, added = prog.backward(kept, ct, nothing)
                    grads = device.grads.add(grads, s, added)
                else:
                    in_ct, (computed, refs) = prog.backward_input(kept, ct)
                    handoff = (*computed, *_unheld(tuple(refs), ref_params))
                    hand = device.handoffs.put(hand, s, handoff, slot=hand_at)
                if s > 0:
                    out = messages.put(out, ("in_ct", s), tuple(in_ct))
            if local:
                # A value for a stage on the same device goes to its inbound slot; one for
                # another device moves there after the tick.
                inbox = _into(inbox, out, at["local"])
            return {**pools, "grads": grads, "loss": loss, "res": res, "hand": hand, "inbox": inbox, "out": out}

        return run

    def _backward_of(self, s: int, m: int) -> tuple[Kind, int, int]:
        """The key of (stage s, microbatch m)'s input-gradient action: its I where split, else its B."""
        order = self.schedule.orders[self.schedule.placement[s]]
        split = any(a.key == (Kind.I, s, m) for a in order)
        return (Kind.I if split else Kind.B, s, m)

    def _device_update(self, d: int, update: Update | None, coupled: bool) -> Callable[..., Any]:
        """Device ``d``'s update: ``(params, states) -> (params, states)``, given its
        accumulated ``grads``, whether the step's were all finite and the global sum of squares."""
        assert update is not None
        optimizer, model, device = update.optimizer, self.model, self.devices[d]
        slayout, treedefs = self._state_layouts[d], self._state_treedefs[d]
        mine = self.schedule.stages_on(d)

        def run(rows: tuple[Rows, Rows], *, grads: Rows, finite: Any, total: Any) -> tuple[Rows, Rows]:
            params, states = rows
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
                new_leaves = zip(owned, jax.tree_util.tree_leaves(new_p), strict=True)
                params = device.params.put_all(params, {i: (leaf,) for i, leaf in new_leaves})
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


def _times(shapes: Leaves, count: int) -> Leaves:
    """Shape structs of ``count`` microbatches' leaves stacked along axis 0, one microbatch's ``shapes``."""
    return tuple(jax.ShapeDtypeStruct((count * v.shape[0], *v.shape[1:]), v.dtype) for v in shapes)


def _row_of(value: jax.Array, d: int) -> jax.Array:
    """Device ``d``'s ``[n, ...]`` stack of a ``[D, n, ...]`` array sharded over the stage axis, on its device."""
    for shard in value.addressable_shards:
        if shard.index[0].start == d:
            return shard.data[0]
    raise AssertionError(f"no shard of row {d}")


def _into(slots: Rows, value: Rows, slot: Any) -> Rows:
    """``slots`` (``[slots, n, ...]`` stacks) with ``value``'s ``[n, ...]`` stacks in slot ``slot``."""
    return {k: _in_slot(v, value[k], slot) for k, v in slots.items()}


def _into_each(inboxes: Sequence[Rows], *, sent: Sequence[Rows], slots: Sequence[Any]) -> list[Rows]:
    """Each of ``inboxes`` with its message of ``sent`` in its slot of ``slots`` (:func:`_into`)."""
    return [_into(*args) for args in zip(inboxes, sent, slots, strict=True)]


def _at(value: jax.Array, i: Any) -> jax.Array:
    """Entry ``i`` (a value of the program) of ``value`` along its first axis."""
    return lax.dynamic_index_in_dim(value, i, keepdims=False)


def _in_slot(stack: jax.Array, value: jax.Array, slot: Any, *, at: int = 0) -> jax.Array:
    """``stack`` (``[slots, n, *shape]``) with ``value`` (``[k, *shape]``) as entries
    ``at``..``at + k`` of slot ``slot`` (a value of the program), written in XLA's default
    layout (:func:`_row_major`)."""
    start = (slot, at, *(0 for _ in value.shape[1:]))
    return lax.dynamic_update_slice(stack, _row_major(value[None]), start)


def _row_major(value: jax.Array) -> jax.Array:
    """``value`` in XLA's default (row-major) layout, as every slot of a pool is read and
    written. Left free, XLA lays a pool out as its reader likes best (a backward's product
    reads the attention probabilities transposed) while the loop of the action that writes
    it keeps another layout, and copies the whole pool between the two at every tick: on
    a TPU v5e, 1 GB a tick at the check model's real size. Pinned at each slot, what is
    re-laid out is the slot, in the loop of the action that reads or writes it."""
    return with_layout_constraint(value, Layout(tuple(range(value.ndim))))


def _inexact(value: Any) -> bool:
    return bool(jnp.issubdtype(value.dtype, jnp.inexact))


def _once(run: Any, body: Callable[[Any], Any], carry: Any) -> Any:
    """``body(carry)`` where ``run`` (a boolean array), else ``carry``, as a while loop of at
    most one trip. XLA updates a loop's carry in place, so the arrays ``body`` writes a
    part of are neither copied in nor out, where a conditional copies whatever it passes
    through or writes (whole pools at every tick). What ``body`` only reads it should close
    over, not carry."""

    def more(state: tuple[Any, Any]) -> Any:
        return state[0] < run.astype(jnp.int32)

    def step(state: tuple[Any, Any]) -> tuple[Any, Any]:
        # Through the barrier, no array of the carry is the loop's own input: an array a
        # loop only read, XLA would pass around it, so that a later loop writing it in
        # place would need a copy of it for this one.
        return state[0] + 1, lax.optimization_barrier(body(state[1]))

    return lax.while_loop(more, step, (jnp.int32(0), carry))[1]
