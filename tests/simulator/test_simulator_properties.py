"""Invariants of the simulation on random valid schedules under random cost models.

Schedules come from two sources: random linear extensions of the dependency graph with
random placements and random backward splits (every such order is valid, since the
global order itself is an execution), and the library's schedules with random
parameters. Costs are small multiples of 1/4, so every sum is exact in floating point
and the checks compare with ``==``.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipedsl.ir import Action, Kind, Schedule
from pipedsl.library import library_path, load
from pipedsl.program import Compute, Program, Recv, Send, lower
from pipedsl.simulator import CostModel, Simulation, simulate
from pipedsl.timeline import EventKind
from pipedsl.validate import dependencies, peak_inflight

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
QUARTERS = st.integers(0, 12).map(lambda q: q / 4)


@st.composite
def random_schedules(draw: st.DrawFn) -> Schedule:
    devices = draw(st.integers(1, 4))
    stages = draw(st.integers(devices, 2 * devices + 1))
    extra = [draw(st.integers(0, devices - 1)) for _ in range(stages - devices)]
    placement = tuple(draw(st.permutations(list(range(devices)) + extra)))
    microbatches = draw(st.integers(1, 4))
    split = {(s, m) for s in range(stages) for m in range(microbatches) if draw(st.booleans())}
    pending = [Action(Kind.F, s, m) for s in range(stages) for m in range(microbatches)]
    for s in range(stages):
        for m in range(microbatches):
            pending += [Action(Kind.I, s, m), Action(Kind.W, s, m)] if (s, m) in split else [Action(Kind.B, s, m)]
    done: set[tuple[Kind, int, int]] = set()
    orders: list[list[Action]] = [[] for _ in range(devices)]
    while pending:
        ready = [a for a in pending if all(k in done for k in dependencies(a, num_stages=stages, split=split))]
        action = ready[draw(st.integers(0, len(ready) - 1))]
        pending.remove(action)
        done.add(action.key)
        orders[placement[action.stage]].append(action)
    return Schedule(
        name="random",
        num_stages=stages,
        num_devices=devices,
        num_microbatches=microbatches,
        placement=placement,
        orders=tuple(map(tuple, orders)),
    )


@st.composite
def library_schedules(draw: st.DrawFn) -> Schedule:
    names = ["gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv", "dualpipev"]
    name = draw(st.sampled_from(names))
    pp = draw(st.integers(1, 4))
    if name == "interleaved_1f1b":
        return load(library_path(name), pp=pp, vpp=draw(st.integers(1, 3)), microbatches=pp * draw(st.integers(1, 3)))
    least = {"zbv": 2 * pp - 1, "dualpipev": 2 * pp}.get(name, pp)
    return load(library_path(name), pp=pp, microbatches=draw(st.integers(least, least + 4)))


@st.composite
def cost_models(draw: st.DrawFn, num_stages: int) -> CostModel:
    def per_stage() -> float | tuple[float, ...]:
        if draw(st.booleans()):
            return draw(QUARTERS)
        return tuple(draw(QUARTERS) for _ in range(num_stages))

    bandwidth = draw(st.sampled_from([None, 4.0]))
    return CostModel(
        forward=per_stage(),
        backward=per_stage() if draw(st.booleans()) else None,
        input_grad=per_stage() if draw(st.booleans()) else None,
        weight_grad=per_stage() if draw(st.booleans()) else None,
        latency=draw(QUARTERS),
        bandwidth=bandwidth,
        activation_bytes=draw(st.integers(0, 8)),
        residual_bytes=tuple(draw(st.integers(0, 50)) for _ in range(num_stages)),
        weight_residual_bytes=draw(st.integers(0, 50)),
        overlap_sends=draw(st.booleans()),
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[Schedule, CostModel]:
    schedule = draw(st.one_of(random_schedules(), library_schedules()))
    return schedule, draw(cost_models(schedule.num_stages))


def _rows(sim: Simulation) -> tuple[dict[tuple[str, int, int], int], dict[tuple[str, int, int], int]]:
    """Compute rows by (kind, stage, microbatch) and send rows by (buffer, stage, microbatch)."""
    tl = sim.timeline
    computes, sends = {}, {}
    for row, event in enumerate(tl.events()):
        if event.kind is EventKind.SEND:
            sends[(event.buffer, event.stage, event.microbatch)] = row
        else:
            computes[(event.kind.value, event.stage, event.microbatch)] = row
    return computes, sends


def _check_program_replay(program: Program, sim: Simulation) -> None:
    """Walk each device's instructions against the timeline: every compute starts exactly
    when the device is free and its received inputs have arrived, and not earlier."""
    tl = sim.timeline
    computes, sends = _rows(sim)
    overlap = sim.costs.overlap_sends
    for dev in program.devices:
        t = 0.0
        for ins in dev.instructions:
            if isinstance(ins, Compute):
                a = ins.action
                row = computes[(a.kind.value, a.stage, a.microbatch)]
                assert tl.start[row] == t
                t = float(tl.end[row])
            elif isinstance(ins, Recv):
                t = max(t, float(tl.end[sends[(ins.buffer.kind.value, ins.buffer.stage, ins.buffer.microbatch)]]))
            elif isinstance(ins, Send):
                row = sends[(ins.buffer.kind.value, ins.buffer.stage, ins.buffer.microbatch)]
                assert tl.start[row] == t
                assert int(tl.peer[row]) == ins.peer
                if not overlap:
                    t = float(tl.end[row])


def _dependency_lower_bound(schedule: Schedule, costs: CostModel) -> float:
    """The longest chain of data dependencies, with transfers between devices, ignoring
    device order: no execution can be shorter."""
    resolved = costs.resolve(schedule)
    seconds = {
        Kind.F: resolved.forward,
        Kind.B: resolved.backward,
        Kind.I: resolved.input_grad,
        Kind.W: resolved.weight_grad,
    }
    split = {(a.stage, a.microbatch) for _, a in schedule.actions() if a.kind is Kind.I}
    finish: dict[tuple[Kind, int, int], float] = {}

    def hop(dep_stage: int, stage: int, dep_kind: Kind) -> float:
        if schedule.placement[dep_stage] == schedule.placement[stage]:
            return 0.0
        if dep_kind is Kind.F:
            return resolved.activation_transfer[dep_stage]
        return resolved.gradient_transfer[dep_stage]

    def end(key: tuple[Kind, int, int]) -> float:
        if key not in finish:
            kind, stage, mb = key
            ready = 0.0
            for dep in dependencies(Action(kind, stage, mb), num_stages=schedule.num_stages, split=split):
                ready = max(ready, end(dep) + hop(dep[1], stage, dep[0]))
            finish[key] = ready + seconds[kind][stage]
        return finish[key]

    return max(end(a.key) for _, a in schedule.actions())


@SETTINGS
@given(cases())
def test_timeline_invariants(case: tuple[Schedule, CostModel]) -> None:
    schedule, costs = case
    program = lower(schedule)
    sim = simulate(program, costs)
    tl = sim.timeline
    resolved = costs.resolve(schedule)
    compute = tl.compute_mask

    # Each device runs exactly its order, one compute at a time, each lasting its cost.
    for d in range(schedule.num_devices):
        rows = np.flatnonzero(compute & (tl.device == d))
        actions = [
            (EventKind(k).value, s, m)
            for k, s, m in zip(
                (tuple(EventKind)[i] for i in tl.kind[rows]), tl.stage[rows], tl.microbatch[rows], strict=True
            )
        ]
        assert actions == [(a.kind.value, a.stage, a.microbatch) for a in schedule.orders[d]]
        starts, ends = tl.start[rows], tl.end[rows]
        assert np.all(ends[:-1] <= starts[1:])
        seconds = {"F": resolved.forward, "B": resolved.backward, "I": resolved.input_grad, "W": resolved.weight_grad}
        for (kind, stage, _), s, e in zip(actions, starts, ends, strict=True):
            assert e - s == seconds[kind][stage]

    # Every compute starts after its inputs arrive; a transfer leaves after its producer.
    computes, sends = _rows(sim)
    split = {(a.stage, a.microbatch) for _, a in schedule.actions() if a.kind is Kind.I}
    for _, action in schedule.actions():
        row = computes[(action.kind.value, action.stage, action.microbatch)]
        for dep_kind, dep_stage, mb in dependencies(action, num_stages=schedule.num_stages, split=split):
            dep = computes[(dep_kind.value, dep_stage, mb)]
            assert tl.end[dep] <= tl.start[row]
            if schedule.placement[dep_stage] != schedule.placement[action.stage]:
                buffer = "act" if dep_kind is Kind.F else "grad"
                send = sends[(buffer, dep_stage, mb)]
                assert tl.start[send] >= tl.end[dep]
                assert tl.end[send] <= tl.start[row]

    _check_program_replay(program, sim)

    # The makespan bounds.
    assert sim.makespan == tl.makespan
    assert sim.makespan >= max(d.busy for d in sim.devices)
    assert sim.makespan >= _dependency_lower_bound(schedule, costs)
    assert 0.0 <= sim.bubble_ratio <= 1.0
    assert all(d.busy + d.bubble == sim.makespan for d in sim.devices)

    # The critical path is a gapless chain from 0 to the makespan.
    path = sim.critical_events()
    assert path[0].start == 0.0
    assert path[-1].end == sim.makespan
    assert all(a.end == b.start for a, b in zip(path, path[1:]))
    assert sum(e.duration for e in path) == sim.makespan

    # Memory follows the schedule's order.
    assert tuple(d.peak_inflight for d in sim.devices) == peak_inflight(schedule)


@SETTINGS
@given(cases())
def test_results_identical_run_to_run(case: tuple[Schedule, CostModel]) -> None:
    schedule, costs = case
    first, second = simulate(schedule, costs), simulate(schedule, costs)
    for column in ("device", "kind", "stage", "microbatch", "start", "end", "peer"):
        assert np.array_equal(getattr(first.timeline, column), getattr(second.timeline, column))
    assert first.timeline.buffer == second.timeline.buffer
    assert first.critical_path == second.critical_path
    assert first.to_json() == second.to_json()


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(1, 4))
def test_slower_links_never_shorten_the_step(case: tuple[Schedule, CostModel], factor: int) -> None:
    schedule, costs = case
    slower = costs.with_changes(latency=costs.latency * factor + 0.25)
    assert simulate(schedule, slower).makespan >= simulate(schedule, costs).makespan


def test_per_device_statistics_add_up() -> None:
    schedule = load(library_path("zbv"), pp=3, microbatches=6)
    sim = simulate(schedule, CostModel(forward=1, latency=0.25))
    per_device: dict[int, float] = defaultdict(float)
    for event in sim.timeline.events():
        if event.kind is not EventKind.SEND:
            per_device[event.device] += event.duration
    assert [d.busy for d in sim.devices] == [per_device[d] for d in range(3)]
    assert sim.busy == sum(per_device.values())
