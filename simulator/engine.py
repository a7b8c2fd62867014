"""Event simulation of a lowered program under a cost model.

The simulator runs exactly the per-device instruction lists of
:class:`~pipedsl.program.Program` that the executor runs. Each device's order is fixed,
so one pass in topological order settles every time: a device's clock advances through
its instructions, a ``Recv`` waits until its buffer has arrived, a compute starts when
the device is free and its inputs are there (``start = max(device free, inputs
arrived)``) and lasts its cost, and a ``Send`` starts a transfer that arrives
``latency + bytes / bandwidth`` seconds later. A device that reaches a ``Recv`` whose
buffer has not been sent yet parks until the sender gets there. The pass is linear in
the number of instructions and deterministic.

Memory does not depend on time: it follows each device's order. The residual of a
(stage, microbatch) is live from the ``F`` that writes it to its ``Free``; the weight
residual from the ``I`` that writes it to its ``Free`` after ``W``. Memory is sampled at
compute boundaries (after a compute and the frees that follow it), so the residual an
``I`` consumes and the weight residual it produces are not counted together: the
weight residual reuses the residual's storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipedsl.errors import PipedslError
from pipedsl.ir import Schedule
from pipedsl.program import (
    BufferKind,
    Compute,
    Free,
    Instruction,
    Program,
    Recv,
    Send,
    lower,
)
from pipedsl.simulator.costs import CostModel, StageCosts
from pipedsl.timeline import Event, EventKind, Timeline

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DeviceStats", "Simulation", "simulate"]

_EVENT_CODE = {kind: index for index, kind in enumerate(EventKind)}
_SEND_CODE = _EVENT_CODE[EventKind.SEND]


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
      schedule: the simulated schedule (its name and parameters label the result).
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
    """

    # The schedule, timeline and path can be huge; the repr shows the summary only.
    schedule: Schedule = field(repr=False)
    costs: CostModel
    timeline: Timeline = field(repr=False)
    makespan: float
    bubble_ratio: float
    devices: tuple[DeviceStats, ...]
    critical_path: tuple[int, ...] = field(repr=False)

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
        events = self.timeline
        out = []
        for row in self.critical_path:
            peer = int(events.peer[row])
            out.append(
                Event(
                    device=int(events.device[row]),
                    kind=tuple(EventKind)[int(events.kind[row])],
                    stage=int(events.stage[row]),
                    microbatch=int(events.microbatch[row]),
                    start=float(events.start[row]),
                    end=float(events.end[row]),
                    peer=None if peer < 0 else peer,
                    buffer=events.buffer[row] or None,
                )
            )
        return out

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
            "critical_path": [
                {
                    "device": e.device,
                    "kind": e.kind.value,
                    "stage": e.stage,
                    "microbatch": e.microbatch,
                    "start": e.start,
                    "end": e.end,
                }
                for e in self.critical_events()
            ],
        }


def simulate(program: Program | Schedule, costs: CostModel | None = None) -> Simulation:
    """Simulate ``program`` (a schedule is validated and lowered first) under ``costs``
    (default: ``CostModel()``, F = 1 s, B = 2 s, free communication)."""
    if isinstance(program, Schedule):
        program = lower(program)
    costs = costs if costs is not None else CostModel()
    stage_costs = costs.resolve(program.schedule)
    timeline, critical = _run(program, stage_costs)
    peaks = [_peak_memory(dev.instructions, stage_costs) for dev in program.devices]
    makespan = timeline.makespan
    busy = timeline.busy()
    sends = ~timeline.compute_mask
    transfer = np.bincount(
        timeline.device[sends], weights=(timeline.end - timeline.start)[sends], minlength=timeline.num_devices
    )
    devices = tuple(
        DeviceStats(
            device=d,
            stages=program.devices[d].stages,
            busy=float(busy[d]),
            bubble=makespan - float(busy[d]),
            bubble_ratio=(makespan - float(busy[d])) / makespan if makespan > 0 else 0.0,
            transfer=float(transfer[d]),
            peak_inflight=peaks[d][0],
            peak_activation_bytes=peaks[d][1],
        )
        for d in range(timeline.num_devices)
    )
    return Simulation(
        schedule=program.schedule,
        costs=costs,
        timeline=timeline,
        makespan=makespan,
        bubble_ratio=timeline.bubble_ratio(),
        devices=devices,
        critical_path=critical,
    )


def _run(program: Program, costs: StageCosts) -> tuple[Timeline, tuple[int, ...]]:
    """The topological pass. Returns the timeline and the critical path's rows.

    The inner loop touches only lists, floats and ints, and appends to flat columns in
    the order events are settled; :func:`_assemble` turns them into arrays once. A
    compute is named in the loop by its index in the compute columns, a transfer by
    ``-1 - index`` in the transfer columns, so each event can record its predecessor.
    Each device walks its instructions through one iterator, which a device parked at
    a ``Recv`` resumes from when the buffer it waits for is sent.
    """
    num_devices = len(program.devices)
    num_stages = program.schedule.num_stages
    num_mb = program.schedule.num_microbatches
    # A compute's cost class is kind code × S + stage: one index into ``seconds``.
    seconds = [*costs.forward, *costs.backward, *costs.input_grad, *costs.weight_grad]
    offset = {kind.value: _EVENT_CODE[kind] * num_stages for kind in EventKind if kind.is_compute}
    act_seconds, grad_seconds = costs.activation_transfer, costs.gradient_transfer
    gradient = BufferKind.GRADIENT
    overlap = costs.overlap_sends
    # A moved buffer is an activation or a gradient of one (stage, microbatch): its id is
    # 2 × (stage × M + microbatch), plus 1 for a gradient.
    num_ids = 2 * num_stages * num_mb
    arrival: list[float | None] = [None] * num_ids
    arrival_event = [0] * num_ids
    parked: list[int | None] = [None] * num_ids
    waits_for: list[int | None] = [None] * num_devices

    iterators = [iter(dev.instructions) for dev in program.devices]
    clocks = [0.0] * num_devices
    lasts: list[int | None] = [None] * num_devices
    finished = 0
    n_comp = n_xfer = 0
    c_device: list[int] = []
    c_start: list[float] = []
    c_class: list[int] = []
    c_mb: list[int] = []
    c_pred: list[int | None] = []
    x_device: list[int] = []
    x_start: list[float] = []
    x_end: list[float] = []
    x_id: list[int] = []
    x_peer: list[int] = []
    x_pred: list[int | None] = []

    ready = list(range(num_devices - 1, -1, -1))
    while ready:
        d = ready.pop()
        t = clocks[d]
        last = lasts[d]
        bid = waits_for[d]
        if bid is not None:
            waits_for[d] = None
            arrived = arrival[bid]
            if arrived > t:
                t = arrived
                last = arrival_event[bid]
        for ins in iterators[d]:
            tp = type(ins)
            if tp is Free:
                continue
            if tp is Compute:
                action = ins.action
                cls = offset[action.kind._value_] + action.stage
                c_pred.append(last)
                c_start.append(t)
                c_device.append(d)
                c_class.append(cls)
                c_mb.append(action.microbatch)
                last = n_comp
                n_comp += 1
                t += seconds[cls]
            elif tp is Recv:
                buf = ins.buffer
                bid = 2 * (buf.stage * num_mb + buf.microbatch) + (buf.kind is gradient)
                arrived = arrival[bid]
                if arrived is None:
                    parked[bid] = d
                    waits_for[d] = bid
                    break
                if arrived > t:
                    t = arrived
                    last = arrival_event[bid]
            elif tp is Send:
                buf = ins.buffer
                is_grad = buf.kind is gradient
                stage = buf.stage
                bid = 2 * (stage * num_mb + buf.microbatch) + is_grad
                done = t + (grad_seconds if is_grad else act_seconds)[stage]
                event = -1 - n_xfer
                n_xfer += 1
                x_pred.append(last)
                x_start.append(t)
                x_end.append(done)
                x_device.append(d)
                x_id.append(bid)
                x_peer.append(ins.peer)
                arrival[bid] = done
                arrival_event[bid] = event
                if not overlap:
                    t = done
                    last = event
                waiter = parked[bid]
                if waiter is not None:
                    ready.append(waiter)
            else:
                raise PipedslError(f"device {d}: the simulator does not know the instruction {ins!r}")
        else:
            finished += 1
        clocks[d] = t
        lasts[d] = last

    if finished < num_devices:
        d = next(d for d, b in enumerate(waits_for) if b is not None)
        pair, is_grad = divmod(waits_for[d], 2)
        stage, mb = divmod(pair, num_mb)
        what = "gradient" if is_grad else "activation"
        raise PipedslError(
            f"the program cannot finish: device {d} waits for the {what} of stage {stage}, microbatch {mb}, "
            "which no device sends; build programs with pipedsl.program.lower"
        )
    return _assemble(
        program,
        seconds,
        (c_device, c_start, c_class, c_mb, c_pred),
        (x_device, x_start, x_end, x_id, x_peer, x_pred),
    )


def _assemble(
    program: Program,
    seconds: list[float],
    computes: tuple[list, ...],
    transfers: tuple[list, ...],
) -> tuple[Timeline, tuple[int, ...]]:
    """Build the Timeline (computes then transfers, each grouped by device in program
    order) from the loop's columns, and walk back the critical path."""
    c_device, c_start, c_class, c_mb, c_pred = computes
    x_device, x_start, x_end, x_id, x_peer, x_pred = transfers
    num_stages = program.schedule.num_stages
    num_mb = program.schedule.num_microbatches
    n_comp, n_xfer = len(c_start), len(x_start)

    # Stable sorts keep each device's events in the order the loop settled them, which
    # is that device's program order.
    c_dev = np.array(c_device, dtype=np.int64)
    x_dev = np.array(x_device, dtype=np.int64)
    c_order = np.argsort(c_dev, kind="stable")
    x_order = np.argsort(x_dev, kind="stable")
    cls = np.array(c_class, dtype=np.int64)[c_order]
    start = np.array(c_start, dtype=np.float64)[c_order]
    # The same float addition as the loop's ``t += seconds``, so ends match bit for bit.
    end = start + np.array(seconds, dtype=np.float64)[cls]
    pair, is_grad = np.divmod(np.array(x_id, dtype=np.int64)[x_order], 2)
    x_stage, x_mb = np.divmod(pair, num_mb)
    names = ("act", "grad")
    timeline = Timeline(
        name=program.schedule.name,
        num_devices=len(program.devices),
        origin="simulated",
        device=np.concatenate([c_dev[c_order], x_dev[x_order]]),
        kind=np.concatenate([(cls // num_stages).astype(np.int8), np.full(n_xfer, _SEND_CODE, np.int8)]),
        stage=np.concatenate([cls % num_stages, x_stage]),
        microbatch=np.concatenate([np.array(c_mb, np.int64)[c_order], x_mb]),
        start=np.concatenate([start, np.array(x_start, np.float64)[x_order]]),
        end=np.concatenate([end, np.array(x_end, np.float64)[x_order]]),
        peer=np.concatenate([np.full(n_comp, -1, np.int64), np.array(x_peer, np.int64)[x_order]]),
        buffer=("",) * n_comp + tuple(map(names.__getitem__, is_grad.tolist())),
    )
    if n_comp == 0:
        return timeline, ()
    c_row = np.empty(n_comp, np.int64)
    c_row[c_order] = np.arange(n_comp)
    x_row = np.empty(n_xfer, np.int64)
    x_row[x_order] = np.arange(n_comp, n_comp + n_xfer)
    # The path ends at the compute that ends last (the first such row, for determinism).
    name: int | None = int(c_order[int(np.argmax(end))])
    path = []
    while name is not None:
        if name >= 0:
            path.append(int(c_row[name]))
            name = c_pred[name]
        else:
            path.append(int(x_row[-1 - name]))
            name = x_pred[-1 - name]
    path.reverse()
    return timeline, tuple(path)


def _peak_memory(instructions: tuple[Instruction, ...], costs: StageCosts) -> tuple[int, int]:
    """(peak residual sets, peak residual bytes) of one device's program.

    Sampled before each compute and at the end, i.e. after every compute's trailing
    frees (see the module docstring).
    """
    held_bytes = {
        BufferKind.RESIDUAL.value: costs.residual_bytes,
        BufferKind.WEIGHT_RESIDUAL.value: costs.weight_residual_bytes,
    }
    live = peak_live = held = peak_held = 0
    for ins in instructions:
        tp = type(ins)
        if tp is Compute:
            if live > peak_live:
                peak_live = live
            if held > peak_held:
                peak_held = held
            for buf in ins.writes:
                table = held_bytes.get(buf.kind._value_)
                if table is not None:
                    live += 1
                    held += table[buf.stage]
        elif tp is Free:
            buf = ins.buffer
            table = held_bytes.get(buf.kind._value_)
            if table is not None:
                live -= 1
                held -= table[buf.stage]
    return max(peak_live, live), max(peak_held, held)
