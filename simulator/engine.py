"""Event simulation of a lowered program under a cost model.

The simulator runs exactly the per-device programs of :class:`~pipedsl.program.Program`
that the executor runs, read from their int arrays
(:class:`~pipedsl.program.ProgramArrays`). Each device's order is fixed, so one pass in
topological order settles every time: a device's clock advances through its computes;
a compute that receives a value first waits until it has arrived, starts when the
device is free and its inputs are there (``start = max(device free, inputs arrived)``)
and lasts its cost; a compute that sends its output starts a transfer that arrives
``latency + bytes / bandwidth`` seconds after the compute ends. A device that needs a
value not sent yet parks until the sender gets there. The pass is linear in the number
of computes and deterministic.

Devices that share compute (the cost model's ``speedup``: forced CPU devices on one
host's cores) are simulated by processor sharing, or taking turns in the order their
programs are dispatched where the cost model says ``serial`` (:mod:`~pipedsl.simulator.sharing`).

Memory does not depend on time: it follows each device's order
(:func:`pipedsl.analysis.peak_held`). The residual of a (stage, microbatch) is live from
the ``F`` that writes it to the ``B`` or ``I`` that reads it; the weight residual from
the ``I`` that writes it to its ``W``. Memory is sampled at compute boundaries, so the
residual an ``I`` consumes and the weight residual it produces are not counted
together: the weight residual reuses the residual's storage.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from pipedsl.analysis import peak_held
from pipedsl.arrays import ActionArrays, F, ScheduleArrays, paused_collector
from pipedsl.errors import PipedslError
from pipedsl.ir import Schedule
from pipedsl.program import NEVER_SENT, Program, ProgramArrays, dispatch_order, lower, program_arrays
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.sharing import settle_serial, settle_shared
from pipedsl.stage_costs import StageCosts
from pipedsl.tasks import task_starts
from pipedsl.timeline import Event, EventKind, Timeline
from pipedsl.validate import checked, kept_check

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DeviceStats", "Simulation", "simulate", "step_timing", "steps_timing", "UPDATE"]

UPDATE = 4
"""Kind code of a device's optimizer update in a run of consecutive steps
(:func:`steps_timing`): a compute row that receives and sends nothing, whose stage column
holds its device."""


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """What one device did during the simulated step.

    Attributes:
      device: the device's index.
      stages: the stages it holds.
      busy: seconds spent computing.
      bubble: seconds idle (or blocked in a send) within the makespan: ``makespan - busy``.
      bubble_ratio: ``bubble / makespan`` (0 when the makespan is 0).
      transfer: seconds of the transfers this device sent, summed (they may overlap).
      peak_inflight: the most (stage, microbatch) residual sets held at once.
      peak_activation_bytes: the most residual and weight-residual bytes held at once.
    """

    device: int
    stages: tuple[int, ...]
    busy: float
    bubble: float
    bubble_ratio: float
    transfer: float
    peak_inflight: int
    peak_activation_bytes: int

    @property
    def peak_inflight_microbatches(self) -> float:
        """``peak_inflight`` in microbatches of the device's whole share of the model:
        with k equal stages on the device, k residual sets make one microbatch."""
        return self.peak_inflight / len(self.stages)

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "stages": list(self.stages),
            "busy": self.busy,
            "bubble": self.bubble,
            "bubble_ratio": self.bubble_ratio,
            "transfer": self.transfer,
            "peak_inflight": self.peak_inflight,
            "peak_inflight_microbatches": self.peak_inflight_microbatches,
            "peak_activation_bytes": self.peak_activation_bytes,
        }


@dataclass(frozen=True, slots=True)
class Simulation:
    """The result of simulating one program under one cost model.

    Attributes:
      schedule: the simulated schedule (its name and parameters label the result), as
        objects or as the int columns it was simulated from.
      costs: the cost model used.
      timeline: every compute and transfer with its start and end, in seconds; computes
        first (device by device, each in program order), then transfers likewise.
      makespan: seconds from the step's start to its last event's end.
      bubble_ratio: ``1 - total busy / (devices × makespan)``.
      devices: per-device statistics, shape (D,).
      critical_path: timeline row indices of a chain of events that ends at the
        makespan, in time order; each starts when the previous one ends (on the same
        device, or because it waited for that transfer), so their durations sum to the
        makespan.
      steps_s: with several consecutive steps simulated (``simulate(..., steps=N)``),
        seconds from the first step's start to the end of each step's last update, shape
        (N,) (:func:`steps_timing`); empty for one step.
    """

    # The schedule, timeline and path can be huge; the repr shows the summary only.
    schedule: Schedule | ScheduleArrays = field(repr=False)
    costs: CostModel
    timeline: Timeline = field(repr=False)
    makespan: float
    bubble_ratio: float
    devices: tuple[DeviceStats, ...]
    critical_path: tuple[int, ...] = field(repr=False)
    steps_s: tuple[float, ...] = ()

    @property
    def steady_step(self) -> float | None:
        """Seconds of a step in a long run, updates included: the last of the simulated
        consecutive steps (None for one step)."""
        if len(self.steps_s) < 2:
            return None
        return self.steps_s[-1] - self.steps_s[-2]

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def label(self) -> str:
        """The schedule's name with its parameters, e.g. ``1f1b(pp=4, microbatches=8)``."""
        params = ", ".join(f"{k}={v}" for k, v in self.schedule.params)
        return f"{self.schedule.name}({params})" if params else self.schedule.name

    @property
    def busy(self) -> float:
        """Seconds of computation summed over devices."""
        return sum(d.busy for d in self.devices)

    def critical_events(self) -> list[Event]:
        """The critical path as timeline events, in time order."""
        return [self.timeline.event(row) for row in self.critical_path]

    def to_dataframe(self) -> pd.DataFrame:
        """One row per action and transfer (the timeline's columns) plus ``critical``:
        whether the row is on the critical path."""
        frame = self.timeline.to_dataframe()
        critical = np.zeros(len(self.timeline), dtype=bool)
        critical[list(self.critical_path)] = True
        frame["critical"] = critical
        return frame

    def to_json(self) -> dict[str, Any]:
        """A stable, JSON-ready summary (no per-event timeline; see ``timeline.to_json``)."""
        return {
            "format": "pipedsl-simulation",
            "version": 1,
            "schedule": self.schedule.name,
            "params": dict(self.schedule.params),
            "num_devices": self.schedule.num_devices,
            "num_stages": self.schedule.num_stages,
            "num_microbatches": self.schedule.num_microbatches,
            "num_actions": int(np.count_nonzero(self.timeline.compute_mask)),
            "costs": self.costs.to_json(),
            "makespan": self.makespan,
            "busy": self.busy,
            "bubble_ratio": self.bubble_ratio,
            "peak_inflight": max((d.peak_inflight for d in self.devices), default=0),
            "peak_activation_bytes": max((d.peak_activation_bytes for d in self.devices), default=0),
            "devices": [d.to_json() for d in self.devices],
            "critical_path": self._critical_json(),
            **({"steps_s": list(self.steps_s), "steady_step": self.steady_step} if self.steps_s else {}),
        }

    def _critical_json(self) -> list[dict[str, Any]]:
        """:meth:`critical_events` as JSON objects, read column by column."""
        timeline, rows = self.timeline, np.asarray(self.critical_path, dtype=np.int64)
        # Timeline kind codes index EventKind in declaration order.
        letters = [kind.value for kind in EventKind]
        kinds = [letters[code] for code in timeline.kind[rows].tolist()]
        columns = zip(
            timeline.device[rows].tolist(), kinds, timeline.stage[rows].tolist(), timeline.microbatch[rows].tolist(),
            timeline.start[rows].tolist(), timeline.end[rows].tolist(),
        )  # fmt: skip
        names = ("device", "kind", "stage", "microbatch", "start", "end")
        return [dict(zip(names, values)) for values in columns]


def simulate(
    program: Program | Schedule | ScheduleArrays | Any, costs: CostModel | None = None, *, steps: int = 1
) -> Simulation:
    """Simulate ``program`` (a schedule is validated and lowered first) under ``costs``
    (default: ``CostModel()``, F = 1 s, B = 2 s, free communication). A library name, a
    path or a policy is made a schedule first (:func:`~pipedsl.simulator.schedule_spec.schedule_of`).
    A :class:`~pipedsl.arrays.ScheduleArrays` is validated and lowered on its columns,
    without an object per action or per instruction. Costs of another type are refused
    (PipedslError). With ``steps`` above 1, ``steps`` consecutive training steps are timed
    too, with the cost model's optimizer updates between them (:attr:`Simulation.steps_s`);
    the timeline is the first step's."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PipedslError(f"simulate: steps must be a whole number >= 1, got {steps!r}")
    if costs is not None and not isinstance(costs, CostModel):
        given = type(costs).__name__
        raise PipedslError(f"simulate: costs must be a CostModel, or left out for the default one, got {given}")
    if isinstance(program, ScheduleArrays):
        found = checked(program)
        lowered = program_arrays(found.actions, found.upstream, program.placement)
        order = found.order
        # Lowered, the validation's links are spent: a million actions' are 16 MB.
        del found
        return _simulated(program, lowered, costs, order=order, steps=steps)
    if not isinstance(program, Program):
        from pipedsl.simulator.schedule_spec import schedule_of

        program = schedule_of(program, costs)
    if isinstance(program, Schedule):
        program = lower(program)
    return _simulated(program.schedule, program.arrays, costs, order=_kept_order(program), steps=steps)


def _simulated(
    schedule: Schedule | ScheduleArrays,
    arrays: ProgramArrays,
    costs: CostModel | None,
    *,
    order: np.ndarray | None,
    steps: int = 1,
) -> Simulation:
    """The simulation of ``schedule``'s lowered ``arrays`` (``order``: as for :func:`step_timing`;
    ``steps``: as for :func:`simulate`)."""
    costs = costs if costs is not None else CostModel()
    stage_costs = costs.resolve(schedule)
    ends: tuple[float, ...] = ()
    if steps > 1:
        updates = costs.device_updates(schedule)
        ends = steps_timing(arrays, stage_costs, updates, steps=steps, barrier=costs.update_barrier)
    num_devices = arrays.actions.num_devices
    with paused_collector():
        run = _Run.of(arrays, stage_costs, num_stages=schedule.num_stages, order=order)
        critical = _critical_path(arrays, run)
        ones = np.ones(schedule.num_stages, dtype=np.int64)
        inflight = peak_held(arrays.actions, ones, ones)
        held = peak_held(arrays.actions, stage_costs.residual_bytes, stage_costs.weight_residual_bytes)
        # Summed from the pass's columns, in the timeline's row order (the same sums),
        # before the timeline exists: the largest columns are then never held twice.
        device = arrays.actions.device
        busy = np.bincount(device, weights=run.end - run.start, minlength=num_devices)
        transfer = np.bincount(device[run.senders], weights=run.arrived - run.end[run.senders], minlength=num_devices)
        timeline = _timeline(schedule.name, arrays, run)
    makespan = timeline.makespan
    devices = tuple(
        DeviceStats(
            device=d,
            stages=schedule.stages_on(d),
            busy=float(busy[d]),
            bubble=makespan - float(busy[d]),
            bubble_ratio=(makespan - float(busy[d])) / makespan if makespan > 0 else 0.0,
            transfer=float(transfer[d]),
            peak_inflight=int(inflight[d]),
            peak_activation_bytes=int(held[d]),
        )
        for d in range(num_devices)
    )
    return Simulation(
        schedule=schedule,
        costs=costs,
        timeline=timeline,
        makespan=makespan,
        # Timeline.bubble_ratio's formula, over the busy times summed above.
        bubble_ratio=float(1.0 - busy.sum() / (num_devices * makespan)) if makespan > 0 else 0.0,
        devices=devices,
        critical_path=critical,
        steps_s=ends,
    )


def _kept_order(program: Program) -> np.ndarray | None:
    """The order validation ran the program's computes in, when its arrays are the
    validated schedule's own (as :func:`~pipedsl.program.lower` makes them)."""
    found = kept_check(program.schedule)
    if found is None or found.actions is not program.arrays.actions:
        return None
    return found.order


def step_timing(arrays: ProgramArrays, costs: StageCosts, *, order: np.ndarray | None = None) -> tuple[float, float]:
    """(makespan in seconds, bubble ratio) of a program's ``arrays`` under ``costs``
    (resolved for its schedule): the numbers :func:`simulate` reports, without building
    its timeline or critical path.

    ``order``: the schedule's :attr:`~pipedsl.validate.Checked.order` when ``arrays``
    were lowered from its checked actions; with it the pass runs the rows in that order
    instead of finding one, which is faster when the same arrays are timed many times.
    """
    with paused_collector():
        run = _Run.of(arrays, costs, num_stages=len(costs.forward), order=order)
    devices = arrays.actions.num_devices
    ends = run.end if not len(run.arrived) else np.concatenate([run.end, run.arrived])
    makespan = float(ends.max()) if len(ends) else 0.0
    if makespan <= 0:
        return makespan, 0.0
    busy = np.bincount(arrays.actions.device, weights=run.end - run.start, minlength=devices)
    return makespan, float(1.0 - busy.sum() / (devices * makespan))


def steps_timing(
    arrays: ProgramArrays, costs: StageCosts, updates: Sequence[float], *, steps: int, barrier: bool
) -> tuple[float, ...]:
    """Seconds from the first of ``steps`` consecutive training steps' synchronised start
    to the end of each step (its last device's update), shape (steps,), for a program's
    ``arrays`` under ``costs`` (resolved for its schedule), device d's optimizer update
    taking ``updates[d]`` seconds (plus the dispatch of one program).

    Without ``barrier``, a device's update starts once its own last compute of the step is
    done, and its next step's first compute follows the update (and waits for its input,
    as in any step): one step's drain overlaps the next one's warm-up wherever the
    schedule leaves a device free early. The steps are simulated as one program, each
    device's program repeated with an update after each step, so devices that share
    compute share it across the steps too. With ``barrier`` (an update that reads the
    whole model's gradients: a global-norm clip, a finiteness check over the model)
    every device waits for every other one's gradients, then updates, and the next step
    starts from a synchronised start once every device has updated: each step takes one
    step's makespan plus the slowest update.
    """
    if steps < 1:
        raise PipedslError(f"steps must be at least 1, got {steps}")
    devices = arrays.actions.num_devices
    if len(updates) != devices:
        raise PipedslError(f"updates gives {len(updates)} devices' seconds, but the program has {devices} devices")
    if barrier:
        makespan, _ = step_timing(arrays, costs)
        step = makespan + max((u + costs.dispatch for u in updates), default=0.0)
        return tuple(step * (k + 1) for k in range(steps))
    joined, update_rows = _consecutive(arrays, steps)
    with paused_collector():
        run = _Run.of(joined, costs, num_stages=len(costs.forward), updates=updates)
    return tuple(float(end) for end in run.end[update_rows].max(axis=1))


def _consecutive(arrays: ProgramArrays, steps: int) -> tuple[ProgramArrays, np.ndarray]:
    """``arrays`` of one step as a program of ``steps`` steps: each device's computes of
    step 0, its update (an :data:`UPDATE` row), its computes of step 1, and so on, each
    receiving from its own step's sender. Returns the program and the rows of the updates,
    shape (steps, D)."""
    actions = arrays.actions
    lengths = np.diff(actions.bounds)
    block = lengths + 1  # a device's computes of a step, then its update
    per_device = block * steps
    bounds = np.concatenate([[0], np.cumsum(per_device)]).astype(np.int64)
    total = int(bounds[-1])
    step = np.arange(steps, dtype=np.int64)[:, None]
    device = actions.device
    # Row of each compute in each step, shape (steps, N).
    rows = (bounds[:-1][device] + actions.position)[None, :] + step * block[device][None, :]
    update_rows = bounds[:-1][None, :] + step * block[None, :] + lengths[None, :]
    owner = np.repeat(np.arange(len(lengths), dtype=np.int64), per_device)
    kind = np.full(total, UPDATE, dtype=np.int8)
    stage, microbatch = owner.copy(), np.zeros(total, dtype=np.int64)
    recv_from, send_to = np.full(total, -1, dtype=np.int64), np.full(total, -1, dtype=np.int64)
    flat = rows.ravel()
    kind[flat] = np.tile(actions.kind, steps)
    stage[flat] = np.tile(actions.stage, steps)
    microbatch[flat] = np.tile(actions.microbatch, steps)
    source = arrays.recv_from
    recv_from[flat] = np.where(source >= 0, rows[:, np.maximum(source, 0)], source[None, :]).ravel()
    send_to[flat] = np.tile(arrays.send_to, steps)
    position = np.arange(total, dtype=np.int64) - np.repeat(bounds[:-1], per_device)
    joined = ActionArrays(kind, stage, microbatch, owner, position, bounds)
    return ProgramArrays(joined, recv_from, send_to), update_rows


@dataclass(frozen=True, slots=True, eq=False)
class _Run:
    """What the topological pass settled, per compute row of the program's arrays.

    ``start``, ``end``: seconds, shape (N,). ``arrival``: per compute row, when the
    transfer it sends arrives (meaningless for a row that sends nothing), length N.
    ``senders``: the rows that send, increasing; ``arrived``: ``arrival`` of those
    rows, shape (len(senders),).
    """

    start: np.ndarray
    end: np.ndarray
    arrival: np.ndarray
    senders: np.ndarray
    arrived: np.ndarray
    overlap: bool

    @classmethod
    def of(
        cls,
        arrays: ProgramArrays,
        costs: StageCosts,
        *,
        num_stages: int,
        order: np.ndarray | None = None,
        updates: Sequence[float] = (),
    ) -> _Run:
        """Settle every compute; ``order``, when given, is one its dependencies allow.
        ``updates``: device d's :data:`UPDATE` rows' seconds, where there are such rows."""
        actions = arrays.actions
        kind, stage = actions.kind.astype(np.int64), actions.stage
        # The pass reads each row's seconds from lists of a few shared floats (one per
        # kind and stage, and an update's per device: kind UPDATE, stage its device),
        # not one float object per row.
        seconds = [*costs.forward, *costs.backward, *costs.input_grad, *costs.weight_grad, *updates]
        code = kind * num_stages + stage
        if costs.dispatch:
            # A compute that starts a task carries the task's dispatch (pipedsl.tasks); an
            # update is a program of its own, and so is the first task after it.
            starts = task_starts(arrays)
            if len(updates):
                updating = kind == UPDATE
                starts |= updating
                starts[1:] |= updating[:-1]
            code = code + starts * len(seconds)
            seconds += [s + costs.dispatch for s in seconds]
        duration = np.array(seconds, dtype=np.float64)[code]
        # F sends its activation, B and I their input gradient; W sends nothing. A row
        # that sends nothing adds 0.0, which leaves a blocked sender's clock as it was.
        sends = arrays.send_to >= 0
        transfers = [*costs.activation_transfer, *costs.gradient_transfer, 0.0]
        gradients = len(costs.activation_transfer)
        sent_code = np.where(sends, np.where(kind == F, 0, gradients) + stage, len(transfers) - 1)
        if costs.speedup is not None:
            if costs.serial:
                *shared, stuck = settle_serial(
                    arrays,
                    _shared(seconds, code),
                    _shared(transfers, sent_code),
                    costs.overlap_sends,
                    costs.speedup[0],
                    dispatch_order(arrays).tolist(),
                )
            else:
                *shared, stuck = settle_shared(
                    arrays, _shared(seconds, code), _shared(transfers, sent_code), costs.overlap_sends, costs.speedup
                )
            if stuck is not None:
                raise _cannot_finish(arrays, *stuck)
            start_array, end_array, arrival_array = (np.array(v, dtype=np.float64) for v in shared)
            senders = np.flatnonzero(sends)
            return cls(start_array, end_array, arrival_array, senders, arrival_array[senders], costs.overlap_sends)
        if order is None:
            start, arrival = _settle(arrays, _shared(seconds, code), _shared(transfers, sent_code), costs.overlap_sends)
            start_array, arrival_array = np.array(start, dtype=np.float64), np.array(arrival, dtype=np.float64)
        else:
            start_array, arrival_array = _settle_in_order(
                arrays,
                order,
                duration[order],
                np.array(transfers, dtype=np.float64)[sent_code[order]],
                costs.overlap_sends,
            )
        senders = np.flatnonzero(sends)
        # The same float additions as the pass's, so ends and arrivals match bit for bit.
        arrived = arrival_array[senders]
        return cls(start_array, start_array + duration, arrival_array, senders, arrived, costs.overlap_sends)

    def pred(self, arrays: ProgramArrays, row: int) -> int | None:
        """The event compute ``row`` waited on last: the compute before it on its device
        (``-1 - r`` for that compute's transfer, when sends block), the transfer it
        receives (``-1 - r`` for the one compute r sent) when that arrived later, or
        None at a device's start. The pass's own comparison, redone for one row."""
        first = int(arrays.actions.bounds[int(arrays.actions.device[row])])
        t, last = 0.0, None
        if row > first:
            before = row - 1
            blocked = not self.overlap and int(arrays.send_to[before]) >= 0
            t, last = (float(self.arrival[before]), -1 - before) if blocked else (float(self.end[before]), before)
        source = int(arrays.recv_from[row])
        if source >= 0 and self.arrival[source] > t:
            return -1 - source
        return last


# In the pass that finds its own order, a row's arrival until it sends: larger than any
# time, so that one test ``arrived > t`` finds both a later arrival and one not sent
# yet; told apart by identity, since a time may itself overflow to infinity.
_UNSENT = float("inf")


def _shared(table: list[float], codes: np.ndarray) -> list[float]:
    """``table[c]`` for every code c: a list of the table's own few float objects."""
    return list(map(table.__getitem__, codes.tolist()))


def _settle_in_order(
    arrays: ProgramArrays, order: np.ndarray, duration: np.ndarray, sent: np.ndarray, overlap: bool
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_settle` over the rows in ``order``, one their dependencies allow: each
    compute's input was sent before it comes, so nothing waits and no device parks.
    ``duration`` and ``sent`` (seconds, float64) are given in that order. Returns (start,
    arrival) per row, arrival being ``end + sent`` for every row.

    The loop walks its inputs in order and appends its outputs, so it reads memory
    in sequence; it reads the arrival of a value sent shortly before. Its inputs are read
    through memoryviews and its outputs kept in typed arrays: each number is a Python
    object only while the loop holds it (lists of a million held several hundred MB at
    once, of objects and pointers, for the same speed).
    """
    count = len(order)
    # Where each row comes in the order, counted from 1: slot 0 of ``arrival`` is what
    # a compute that receives nothing reads, earlier than any time.
    position = np.empty(count, dtype=np.int64)
    position[order] = np.arange(1, count + 1, dtype=np.int64)
    source = arrays.recv_from[order]
    reads = np.where(source < 0, 0, position[np.maximum(source, 0)])
    del position, source
    devices = arrays.actions.device[order]
    starts = array("d")
    arrival = array("d", (-math.inf,))
    begin, send = starts.append, arrival.append
    clocks = [0.0] * arrays.actions.num_devices
    blocking = not overlap
    for d, read, seconds, transfer in zip(devices.data, reads.data, duration.data, sent.data):
        t = clocks[d]
        arrived = arrival[read]
        if arrived > t:
            t = arrived
        begin(t)
        t += seconds
        done = t + transfer
        send(done)
        clocks[d] = done if blocking else t
    start, arrived_at = np.empty(count, dtype=np.float64), np.empty(count, dtype=np.float64)
    start[order] = np.frombuffer(starts, dtype=np.float64)
    arrived_at[order] = np.frombuffer(arrival, dtype=np.float64)[1:]
    return start, arrived_at


def _settle(
    arrays: ProgramArrays, duration: list[float], sent: list[float], overlap: bool
) -> tuple[list[float], list[float]]:
    """The topological pass: (start, arrival) per compute row (see :class:`_Run`);
    ``sent`` holds the seconds of each row's outgoing transfer (0.0 where it sends
    nothing).

    The loop touches only lists, floats and ints. Each device runs until a compute needs
    a value not yet sent; it parks on the sending compute's row and is woken when that
    compute sends.
    """
    count = len(duration)
    # Slots past the rows: ``count`` for a value no compute sends (it stays unsent),
    # ``count + 1`` read by a compute that receives nothing (earlier than any time), and
    # ``count + 2`` written by one that sends nothing.
    arrival = [_UNSENT] * (count + 3)
    arrival[count + 1] = -math.inf
    recv_from = arrays.recv_from
    reads = np.where(recv_from == -1, count + 1, np.where(recv_from == NEVER_SENT, count, recv_from)).tolist()
    writes = np.where(arrays.send_to >= 0, np.arange(count), count + 2).tolist()
    bounds = arrays.actions.bounds.tolist()
    num_devices = len(bounds) - 1
    start: list[float] = [0.0] * count
    # Per slot, the device parked until that row sends (-1: none); a list, not a dict:
    # every row looks here.
    parked = [-1] * (count + 3)
    pointer = bounds[:-1]
    clocks = [0.0] * num_devices
    ready = list(range(num_devices - 1, -1, -1))
    blocking = not overlap
    while ready:
        d = ready.pop()
        stop, t = bounds[d + 1], clocks[d]
        # A for loop over the rows left (cheaper than counting by hand); a break leaves
        # ``row`` at the compute that waits.
        for row in range(pointer[d], stop):
            arrived = arrival[reads[row]]
            if arrived > t:
                if arrived is _UNSENT:
                    parked[reads[row]] = d
                    break
                t = arrived
            start[row] = t
            t += duration[row]
            slot = writes[row]
            done = t + sent[row]
            arrival[slot] = done
            if blocking:
                t = done
            waiter = parked[slot]
            if waiter >= 0:
                ready.append(waiter)
        else:
            row = stop
        pointer[d], clocks[d] = row, t
    stuck = [d for d in range(num_devices) if pointer[d] < bounds[d + 1]]
    if stuck:
        raise _cannot_finish(arrays, stuck[0], pointer[stuck[0]])
    del arrival[count:]
    return start, arrival


def _cannot_finish(arrays: ProgramArrays, device: int, row: int) -> PipedslError:
    actions = arrays.actions
    stage, mb = int(actions.stage[row]), int(actions.microbatch[row])
    what, stage = ("activation", stage - 1) if int(actions.kind[row]) == F else ("gradient", stage + 1)
    return PipedslError(
        f"the program cannot finish: device {device} waits for the {what} of stage {stage}, microbatch {mb}, "
        "which no device sends; build programs with pipedsl.program.lower"
    )


# What a transfer carries, by whether its sender is a backward: an F's activation, else
# a gradient.
_BUFFERS = ("act", "grad")


def _timeline(name: str, arrays: ProgramArrays, run: _Run) -> Timeline:
    """Computes first (device by device, each in program order), then transfers likewise.

    Devices, stages, microbatches and peers are int32 columns, filled in place: a
    million-action program's timeline has two million rows, and int64 columns built by
    concatenation held about twice its size at once.
    """
    actions, senders = arrays.actions, run.senders
    n_comp, n_xfer = len(actions), len(senders)
    total = n_comp + n_xfer

    def joined(computes: np.ndarray | int, transfers: np.ndarray | int, dtype: type) -> np.ndarray:
        column: np.ndarray = np.empty(total, dtype=dtype)
        column[:n_comp] = computes
        column[n_comp:] = transfers
        return column

    backward = (actions.kind[senders] != F).tolist()
    return Timeline.from_columns(
        name=name,
        num_devices=actions.num_devices,
        origin="simulated",
        device=joined(actions.device, actions.device[senders], np.int32),
        kind=joined(actions.kind, EventKind.SEND.code, np.int8),
        stage=joined(actions.stage, actions.stage[senders], np.int32),
        microbatch=joined(actions.microbatch, actions.microbatch[senders], np.int32),
        start=joined(run.start, run.end[senders], np.float64),
        end=joined(run.end, run.arrived, np.float64),
        peer=joined(0, arrays.send_to[senders], np.int32),
        # Two shared strings, not one new string per transfer, and no part tuples joined.
        buffer=tuple(chain(repeat("", n_comp), map(_BUFFERS.__getitem__, backward))),
    )


def _critical_path(arrays: ProgramArrays, run: _Run) -> tuple[int, ...]:
    """Timeline rows from the step's start to the compute that ends last (the first
    such row, for determinism), following each event's predecessor back."""
    n_comp = len(run.start)
    if n_comp == 0:
        return ()
    senders = run.senders
    event: int | None = int(np.argmax(run.end))
    path = []
    while event is not None:
        if event >= 0:
            path.append(event)
            event = run.pred(arrays, event)
        else:
            # A transfer's predecessor is the compute that sent it.
            sender = -1 - event
            path.append(n_comp + int(np.searchsorted(senders, sender)))
            event = sender
    path.reverse()
    return tuple(path)
