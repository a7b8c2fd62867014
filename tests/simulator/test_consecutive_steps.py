"""Consecutive training steps: a device's update after its own last compute, the next
step's first compute after the update, and the barrier a whole-model update makes."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipedsl.cli import main
from pipedsl.errors import PipedslError
from pipedsl.library import library_path, load
from pipedsl.program import lower
from pipedsl.simulator import CostModel, simulate
from pipedsl.simulator.engine import steps_timing

# The last stage updates the most (an output layer's parameters): a device that finishes
# its gradients early spends that time while device 0 starts the next step.
_LAST_HEAVY = (0.5, 0.5, 0.5, 3.0)


def _zb_h1() -> object:
    return load(library_path("zb_h1"), pp=4, microbatches=8)


def test_two_zb_h1_steps_take_less_than_twice_one_where_the_update_is_per_device() -> None:
    sim = simulate(_zb_h1(), CostModel(forward=1, backward=2, update=_LAST_HEAVY), steps=2)
    one, two = sim.steps_s
    # The first step: the last device's update ends last (27 s of its computes, then 3 s).
    assert one == pytest.approx(sim.makespan + 3.0)
    assert two < 2 * one
    # Device 0 ends the first step at 27 s, updates for 0.5 s, and starts the next one.
    assert two == pytest.approx(27.5 + one)
    assert sim.steady_step == pytest.approx(27.5)


def test_a_barrier_makes_two_steps_twice_one_with_the_slowest_update() -> None:
    costs = CostModel(forward=1, backward=2, update=_LAST_HEAVY, update_barrier=True)
    sim = simulate(_zb_h1(), costs, steps=2)
    assert sim.steps_s == pytest.approx((sim.makespan + 3.0, 2 * (sim.makespan + 3.0)))


def test_equal_updates_save_nothing_where_device_0_ends_the_step() -> None:
    # ZB-H1 with even stages: device 0's last W ends the step, and the next step's first
    # F waits for it whatever the update.
    sim = simulate(_zb_h1(), CostModel(forward=1, backward=2, update=0.5), steps=3)
    assert sim.steps_s == pytest.approx((27.5, 55.0, 82.5))


def test_a_v_placement_overlaps_its_drain_with_the_next_warm_up() -> None:
    schedule = load(library_path("zbv"), pp=4, microbatches=8)
    sim = simulate(schedule, CostModel(forward=1, backward=2, update=0.5), steps=3)
    assert sim.steady_step is not None and sim.steady_step < sim.makespan
    barrier = simulate(schedule, CostModel(forward=1, backward=2, update=0.5, update_barrier=True), steps=3)
    assert barrier.steady_step == pytest.approx(sim.makespan + 1.0)  # two stages' updates per device


def test_updates_are_summed_per_device_and_dispatched_as_a_program() -> None:
    schedule = load(library_path("zbv"), pp=4, microbatches=8)
    assert CostModel(update=(1, 2, 3, 4, 5, 6, 7, 8)).device_updates(schedule) == (9, 9, 9, 9)
    assert CostModel(update=2.0, per_device=True).device_updates(schedule) == (2, 2, 2, 2)
    program = lower(_zb_h1())
    plain = CostModel(forward=1, backward=2).resolve(program.schedule)
    dispatched = CostModel(forward=1, backward=2, dispatch=0.25, update_barrier=True).resolve(program.schedule)
    with_dispatch = steps_timing(program.arrays, dispatched, (0.5,) * 4, steps=1, barrier=True)
    assert with_dispatch[0] == pytest.approx(
        simulate(program, CostModel(forward=1, backward=2, dispatch=0.25)).makespan + 0.75
    )
    assert steps_timing(program.arrays, plain, (0.0,) * 4, steps=2, barrier=False) == pytest.approx((27.0, 54.0))


def test_devices_that_share_compute_share_it_across_steps() -> None:
    costs = CostModel(forward=1, backward=2, update=_LAST_HEAVY, speedup=(1.0, 1.5, 1.8, 2.0))
    sim = simulate(_zb_h1(), costs, steps=2)
    assert len(sim.steps_s) == 2 and sim.steps_s[1] < 2 * sim.steps_s[0]
    serial = simulate(_zb_h1(), costs.with_changes(serial=True), steps=2)
    # One compute at a time: nothing overlaps, two steps are every compute and update in turn.
    assert serial.steps_s[1] == pytest.approx(2 * (4 * 8 * 3 + sum(_LAST_HEAVY)))  # 96 one-second computes


def test_bad_steps_and_updates_are_refused() -> None:
    with pytest.raises(PipedslError, match="steps must be a whole number"):
        simulate(_zb_h1(), CostModel(), steps=0)
    program = lower(_zb_h1())
    with pytest.raises(PipedslError, match="updates gives 2 devices"):
        steps_timing(program.arrays, CostModel().resolve(program.schedule), (1.0, 1.0), steps=2, barrier=False)
    with pytest.raises(PipedslError, match="update lists 3 values"):
        simulate(_zb_h1(), CostModel(update=(1.0, 1.0, 1.0)), steps=2)
    assert simulate(_zb_h1(), CostModel()).steps_s == ()


def test_simulate_steps_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", str(library_path("zb_h1")), "-p", "pp=4", "-p", "microbatches=8", "--f", "1"]
    assert main([*args, "--steps", "2", "--update", "0.5,0.5,0.5,3", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["steps_s"] == pytest.approx([30.0, 57.5]) and found["steady_step"] == pytest.approx(27.5)
    assert main([*args, "--steps", "2", "--update", "0.5,0.5,0.5,3", "--update-barrier"]) == 0
    assert "2 consecutive steps 60 s" in capsys.readouterr().out


def test_the_planner_prices_a_step_in_a_long_run_without_an_update_barrier() -> None:
    from pipedsl.simulator import estimate, load_cluster, load_model
    from pipedsl.simulator.plan import Plan

    model, cluster = load_model("llama-70b"), load_cluster("h100-80gb")
    base = {"tp": 8, "pp": 4, "dp": 2, "global_batch": 64}
    barrier = estimate(model, cluster, Plan(**base, schedule="zbv", vpp=2))
    free = estimate(model, cluster, Plan(**base, schedule="zbv", vpp=2, update_barrier=False))
    assert barrier.step_time_s == pytest.approx(
        barrier.pipeline_time_s + barrier.dp_tail_s + barrier.optimizer_s, rel=0.05
    )
    # ZB-V's device 0 finishes early: the next step starts while the others drain.
    assert free.step_time_s < barrier.step_time_s
    assert free.pipeline_time_s == barrier.pipeline_time_s


def test_search_prices_its_pipelines_without_the_barrier_when_asked(tmp_path: Path) -> None:
    argv = ["search", "--model", "llama-70b", "--cluster", "h100-80gb", "--gpus", "64", "--global-batch", "64"]
    argv += ["--schedules", "zbv", "--top", "1", "--csv"]

    def best_zbv(name: str, *extra: str) -> float:
        assert main([*argv, str(tmp_path / name), *extra]) == 0
        plans = pd.read_csv(tmp_path / name)
        return float(plans[plans.schedule == "zbv"].step_time_s.min())

    # ZB-V's device 0 ends its step early: without the barrier the next step starts sooner.
    assert best_zbv("free.csv", "--no-update-barrier") < best_zbv("barrier.csv")
