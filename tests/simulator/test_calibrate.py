"""Calibration recovers the cost model that produced a timeline, and the machine
calibration recovers the latency, bandwidth and compute rate that produced its measurements."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pipedsl
from pipedsl.cli.machine import MachineCalibration, _alone_stages, _step_shapes, _tensor_shapes, recalibrated
from pipedsl.cli.machine_fit import (
    fit_alone,
    fit_compute,
    fit_idle_share,
    fit_ring,
    fit_split,
    fit_sync,
    pipeline_sequences,
    priced_step,
    step_plan,
)
from pipedsl.cli.timed import Step, TimedSteps, interleaved_medians
from pipedsl.errors import PipedslError
from pipedsl.simulator import Cluster, CostModel, Model, Plan, estimate, simulate
from pipedsl.simulator.cost_fit import CalibrationError, fit_costs
from pipedsl.timeline import Event, EventKind, Timeline


def _library(name: str, **params: int) -> pipedsl.Schedule:
    return pipedsl.load(pipedsl.library_path(name), **params)


def test_fit_recovers_uneven_stage_costs_and_latency() -> None:
    truth = CostModel(forward=(1.0, 1.5, 2.0, 1.0), backward=(2.0, 3.0, 4.0, 2.5), latency=0.25)
    timeline = simulate(_library("1f1b", pp=4, microbatches=8), truth).timeline
    fit = fit_costs([timeline], num_stages=4)
    assert fit.forward == (1.0, 1.5, 2.0, 1.0)
    assert fit.backward == (2.0, 3.0, 4.0, 2.5)
    assert fit.input_grad is None and fit.weight_grad is None
    assert fit.transfer == 0.25


def test_fitted_model_predicts_the_run_it_was_fitted_on() -> None:
    truth = CostModel(forward=(1.0, 2.0), input_grad=(1.0, 1.5), weight_grad=(0.5, 0.75), latency=0.1)
    sched = _library("zb_h1", pp=2, microbatches=4)
    measured = simulate(sched, truth)
    fit = fit_costs([measured.timeline], num_stages=2)
    predicted = simulate(sched, fit.cost_model())
    assert predicted.makespan == pytest.approx(measured.makespan, rel=1e-12)
    # The fused backward a 1F1B run would need is derived from the split halves.
    assert fit.cost_model().resolve(_library("1f1b", pp=2, microbatches=4)).backward == (1.5, 2.25)


def test_median_ignores_outliers() -> None:
    events = [Event(0, EventKind.F, 0, m, 0.0, 1.0) for m in range(4)] + [Event(0, EventKind.F, 0, 4, 0.0, 50.0)]
    timeline = Timeline.from_events(events, name="x", num_devices=1, origin="measured")
    assert fit_costs([timeline], num_stages=1).forward == (1.0,)


def test_errors_name_what_is_missing() -> None:
    with pytest.raises(CalibrationError, match="no measured timeline"):
        fit_costs([], num_stages=2)
    only_stage0 = Timeline.from_events(
        [Event(0, EventKind.F, 0, 0, 0.0, 1.0)], name="x", num_devices=2, origin="measured"
    )
    with pytest.raises(CalibrationError, match="stage 1"):
        fit_costs([only_stage0], num_stages=2)
    empty = Timeline.from_events([], name="x", num_devices=1, origin="measured")
    with pytest.raises(CalibrationError, match="no forward"):
        fit_costs([empty], num_stages=1)
    assert np.isfinite(fit_costs([only_stage0], num_stages=1).forward[0])


def test_calibrate_command_fits_predicts_and_saves_costs(tmp_path: Path) -> None:
    """The whole loop on this machine: run, record, fit, simulate, measure, save; every
    schedule is compiled and calibrated before any is timed (their steps take turns)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipedsl",
            "calibrate",
            "zb_h1",
            "1f1b",
            "-p",
            "microbatches=4",
            "--steps",
            "2",
            "--microbatch-size",
            "2",
            "--save-costs",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "predicted" in done.stdout and "measured" in done.stdout
    lines = done.stdout.splitlines()
    calibrated = [i for i, line in enumerate(lines) if "compiled and calibrated" in line]
    timed = [i for i, line in enumerate(lines) if "per step" in line]
    assert len(calibrated) == len(timed) == 2 and max(calibrated) < min(timed)
    assert (tmp_path / "1f1b.toml").is_file()
    fitted = CostModel.from_toml(tmp_path / "zb_h1.toml")
    stages = _library("zb_h1", pp=2, microbatches=4)
    resolved = fitted.resolve(stages)
    assert all(t > 0 for t in resolved.forward + resolved.weight_grad)
    assert simulate(stages, fitted).makespan > 0


def test_calibrate_rejects_a_model_the_schedule_cannot_split() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pipedsl", "calibrate", "1f1b", "-p", "pp=3", "-p", "microbatches=3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "split evenly" in done.stderr and "Traceback" not in done.stderr


# --- the machine calibrated once (pipedsl.cli.machine), and what the estimate makes of it ---

_CPU = Cluster(
    name="cpu",
    gpu="CPU device",
    peak_flops=1e9,
    matmul_efficiency=1.0,
    memory_bytes=2**32,
    hbm_bandwidth=1e9,
    gpus_per_node=8,
    intra_node_bandwidth=1e9,
    intra_node_latency=1e-4,
    inter_node_bandwidth=1e9,
    inter_node_latency=1e-4,
)
_TINY = Model(name="tiny", layers=2, hidden=64, ffn_hidden=256, heads=2, seq_len=16, vocab=128)


def test_each_action_pays_the_dispatch_overhead_and_a_fused_backward_pays_it_once() -> None:
    overhead = 1e-3
    slow = dataclasses.replace(_CPU, action_overhead_s=overhead)
    spmd = Plan(dp=2, microbatch_size=2, global_batch=12)  # 3 microbatches: F and a fused B each
    gap = estimate(_TINY, slow, spmd).pipeline_time_s - estimate(_TINY, _CPU, spmd).pipeline_time_s
    assert gap == pytest.approx(3 * 2 * overhead)
    # A zero-bubble pipeline runs I and W apart: three actions per microbatch per stage.
    zb = Plan(pp=2, microbatch_size=1, global_batch=4, schedule="zb_h1")
    split = estimate(_TINY, slow, zb)
    assert split.stage_forward_s[0] - estimate(_TINY, _CPU, zb).stage_forward_s[0] == pytest.approx(overhead)
    assert split.step_time_s > estimate(_TINY, _CPU, zb).step_time_s + 4 * 3 * overhead
    with pytest.raises(PipedslError, match="action_overhead_s must be a number >= 0"):
        dataclasses.replace(_CPU, action_overhead_s=-1.0)


def test_ring_fit_recovers_latency_and_bandwidth() -> None:
    alpha, bandwidth = 2e-4, 5e8
    times = {(n, s): 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bandwidth for n in (2, 8) for s in (4096, 1 << 22)}
    fitted_alpha, fitted_bandwidth = fit_ring(times)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_demo_counts_the_pairs_of_runs_its_prediction_orders_as_measured() -> None:
    from pipedsl.cli.demo import pairs_agreeing

    assert pairs_agreeing([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == (3, 3)
    assert pairs_agreeing([1.0, 2.0, 3.0], [30.0, 20.0, 10.0]) == (0, 3)
    assert pairs_agreeing([1.0, 3.0, 2.0], [10.0, 20.0, 30.0]) == (2, 3)


def _row(rank: int, schedule: str, dp: int, tp: int, pp: int, step_s: float) -> dict[str, object]:
    spmd = schedule == "spmd"
    return {
        "rank": rank, "kind": "spmd" if spmd else "pipeline", "schedule": schedule, "dp": dp, "tp": tp, "pp": pp,
        "vpp": 1, "microbatch_size": 8, "microbatches": 2, "zero": 1, "recompute": "none", "step_time_s": step_s,
    }  # fmt: skip


def test_demo_runs_the_best_of_each_kind_then_plans_priced_apart() -> None:
    """The best SPMD and hybrid plans, then the best plans of other schedules whose
    predictions are 10% or more from every chosen one's (no pure pipeline of 8 stages
    splits the 4-layer demo transformer)."""
    import pandas as pd

    from pipedsl.cli.demo import plans_to_run

    frame = pd.DataFrame(
        [
            _row(1, "eager_1f1b", 2, 1, 4, 0.200),
            _row(2, "gpipe", 2, 1, 4, 0.200),  # priced as plan 1: its order would be the machine's
            _row(3, "1f1b", 2, 1, 4, 0.210),  # within 10% of plan 1
            _row(4, "zb_h1", 4, 1, 2, 0.230),
            _row(5, "looped_bfs", 4, 1, 2, 0.240),  # within 10% of plan 4
            _row(6, "1f1b", 4, 1, 2, 0.270),  # a schedule not run yet, priced apart
            _row(7, "spmd", 8, 1, 1, 0.310),
            _row(8, "eager_1f1b", 4, 1, 2, 0.400),  # a schedule run already
        ]
    )
    chosen = plans_to_run(frame, 8, top=5)
    assert [p.rank for p in chosen] == [1, 4, 6, 7]
    assert [p.rank for p in plans_to_run(frame, 8, top=3)] == [1, 4, 7]


def _calibration(cluster: Cluster, step_s: dict[tuple[int, int, int], float], **more: object) -> MachineCalibration:
    fields: dict[str, object] = dict(
        tensor_step_s={}, pipeline_step_s=None, microbatch_size=4, all_reduce_s={(2, 4096): 1e-3}, seconds=1.0
    )
    return MachineCalibration(cluster=cluster, step_s=step_s, **(fields | more))  # type: ignore[arg-type]


def test_demo_says_how_far_the_machines_speed_moved_from_the_search_to_the_runs() -> None:
    from pipedsl.cli.demo import _speed_verdict

    def steps(largest: float) -> MachineCalibration:
        return _calibration(_CPU, {(1, 1, 1): 0.01, (4, 4, 1): largest, (1, 1, 4): 0.5})

    held = _speed_verdict(steps(0.050), steps(0.056))
    assert "(4 layers x 4 sequences per device) took 50.0 ms before the search and 56.0 ms in turns with the runs (+12%)" in held
    assert "held its speed (within 15%)" in held
    moved = _speed_verdict(steps(0.050), steps(0.070))
    assert "(+40%)" in moved and "ran slower during the runs" in moved and "priced at the runs' speed" in moved
    assert "ran faster during the runs" in _speed_verdict(steps(0.050), steps(0.040))


def _steps(cluster: Cluster) -> dict[tuple[int, int, int], float]:
    """The calibration's compute steps of ``_TINY`` as ``cluster`` prices them."""
    return {
        (n, m, k): priced_step(dataclasses.replace(_TINY, layers=n), cluster, 8, m, k) for n, m, k in _step_shapes(_TINY, 4)
    }


def test_compute_steps_are_the_corners_of_depth_and_microbatch() -> None:
    assert _step_shapes(_TINY, 4) == ((1, 1, 1), (1, 4, 1), (2, 1, 1), (2, 4, 1), (1, 1, 4), (2, 8, 1))
    assert _step_shapes(dataclasses.replace(_TINY, layers=1), 1) == ((1, 1, 1), (1, 1, 4), (1, 2, 1))


def test_compute_fit_recovers_the_rate_the_launch_the_step_cost_and_the_working_set() -> None:
    # Steps priced on a cluster whose kernels and steps cost a fixed time each and whose
    # compute slows with the activations kept: the fit finds all four numbers again.
    truth = dataclasses.replace(_CPU, peak_flops=3e9, kernel_launch_s=2e-4, step_overhead_s=5e-3, working_set_bytes=2e6)
    fitted = fit_compute(_TINY, _CPU, 8, _steps(truth))
    assert fitted.peak_flops == pytest.approx(3e9, rel=1e-4)
    assert fitted.kernel_launch_s == pytest.approx(2e-4, rel=1e-4)
    assert fitted.step_overhead_s == pytest.approx(5e-3, rel=1e-4)
    assert fitted.working_set_bytes == pytest.approx(2e6, rel=1e-4)


def test_idle_share_fit_recovers_the_share_and_stays_within_zero_and_one() -> None:
    shared = dataclasses.replace(_CPU, shared_cores=2)
    plan = step_plan(4, 1, pipeline_sequences(2, 4), pp=2)

    def priced(share: float) -> float:
        return estimate(_TINY, dataclasses.replace(shared, idle_share=share), plan).step_time_s

    # A pipeline with idle devices costs more the less of their time the busy ones take up.
    assert priced(0.0) > priced(0.7) > priced(1.0)
    assert fit_idle_share(_TINY, shared, 8, 4, priced(0.7)).idle_share == pytest.approx(0.7, abs=1e-6)
    assert fit_idle_share(_TINY, shared, 8, 4, priced(1.0) / 2).idle_share == pytest.approx(1.0, abs=1e-6)
    assert fit_idle_share(_TINY, shared, 8, 4, priced(0.0) * 2).idle_share == pytest.approx(0.0, abs=1e-6)
    # With tensor-parallel stages the fit sets their own share and leaves the other.
    tensor_plan = step_plan(2, 2, pipeline_sequences(2, 4, 2), pp=2)
    truth = dataclasses.replace(shared, tensor_idle_share=0.4)
    measured = estimate(_TINY, truth, tensor_plan).step_time_s
    fitted = fit_idle_share(_TINY, shared, 8, 4, measured, tensor=2)
    assert fitted.tensor_idle_share == pytest.approx(0.4, abs=1e-6) and fitted.idle_share == shared.idle_share


def test_alone_fit_recovers_the_efficiency_only_where_the_idle_share_prices_too_fast() -> None:
    model = dataclasses.replace(_TINY, layers=4)
    shared = dataclasses.replace(_CPU, shared_cores=2)
    assert (_alone_stages(8, 2), _alone_stages(8, 3), _alone_stages(8, 0)) == (4, 0, 0)
    plan = step_plan(2, 1, pipeline_sequences(4, 4), pp=4)
    # Both pipeline steps train as many sequences as the largest compute step: 4 per device.
    assert plan.global_batch == step_plan(4, 1, pipeline_sequences(2, 4), pp=2).global_batch == 8 * 4

    def priced(efficiency: float) -> float:
        return estimate(model, dataclasses.replace(shared, alone_efficiency=efficiency), plan).step_time_s

    assert priced(0.5) > priced(0.8) > priced(1.0)
    assert fit_alone(model, shared, 4, 4, priced(0.7)).alone_efficiency == pytest.approx(0.7, abs=1e-6)
    assert fit_alone(model, shared, 4, 4, priced(1.0) / 2).alone_efficiency == 1.0
    assert fit_alone(model, shared, 4, 4, priced(0.05) * 2).alone_efficiency == pytest.approx(0.05, abs=1e-6)


def test_compute_fit_leaves_out_the_terms_the_steps_do_not_call_for() -> None:
    fitted = fit_compute(_TINY, _CPU, 8, _steps(dataclasses.replace(_CPU, peak_flops=3e9)))
    assert fitted.peak_flops == pytest.approx(3e9, rel=1e-4)
    assert fitted.kernel_launch_s == 0.0 and fitted.step_overhead_s == 0.0 and fitted.working_set_bytes == 0.0


def _tensor_steps(truth: Cluster, model: Model, shapes: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], float]:
    return {(t, m): estimate(model, truth, step_plan(8 // t, t, m)).step_time_s for t, m in shapes}


def test_sync_fit_recovers_the_wait_per_collective_and_per_token() -> None:
    truth = dataclasses.replace(_CPU, collective_sync_s=2e-3, collective_sync_per_token_s=5e-6)
    model = dataclasses.replace(_TINY, layers=1, heads=4)
    shapes = _tensor_shapes(model, 8, 4)
    assert shapes == ((2, 4), (2, 16), (4, 4), (4, 16))
    fitted = fit_sync(model, _CPU, 8, _tensor_steps(truth, model, shapes))
    assert fitted.collective_sync_s == pytest.approx(2e-3, rel=1e-6)
    assert fitted.collective_sync_per_token_s == pytest.approx(5e-6, rel=1e-6)
    # A group of four waits for three others, each working on the microbatch's tokens.
    assert fitted.collective_sync(4, 64) == pytest.approx(3 * (2e-3 + 64 * 5e-6), rel=1e-6)
    # Only the heads the model splits into: tp 4 does not divide two.
    assert _tensor_shapes(dataclasses.replace(model, heads=2), 8, 4) == ((2, 4), (2, 16))


def test_sync_fit_keeps_both_terms_at_least_zero() -> None:
    model = dataclasses.replace(_TINY, layers=1, heads=4)
    shapes = ((2, 4), (4, 16))
    # Steps faster than priced without any wait: no wait at all.
    none = fit_sync(model, _CPU, 8, dict.fromkeys(shapes, 0.0))
    assert (none.collective_sync_s, none.collective_sync_per_token_s) == (0.0, 0.0)
    # Waits that a fixed part alone prices best: no part per token.
    fixed = fit_sync(model, _CPU, 8, _tensor_steps(dataclasses.replace(_CPU, collective_sync_s=3e-3), model, shapes))
    assert fixed.collective_sync_s == pytest.approx(3e-3, rel=1e-6) and fixed.collective_sync_per_token_s == 0.0


def test_the_calibration_times_the_executors_spmd_and_pipeline_steps_in_rounds() -> None:
    # The steps the calibration times, on four of the devices: one stage over all of them
    # (the data axis), one stage split over a tensor axis, and two pipeline stages each
    # over half of them; compiled once, timed in rounds at the calibration and again later.
    from pipedsl.executor.models import transformer

    def build(layers: int, stages: int) -> object:
        return transformer(num_stages=stages, layers_per_stage=layers // stages, vocab=16, dim=8, heads=2, seq=4)

    steps = {"spmd": Step(build(2, 1), 2, microbatches=2), "tensor": Step(build(1, 1), 2, 2), "pipeline": Step(build(2, 2), 2)}
    with TimedSteps(steps, 4, backward=(build(2, 2), 2)) as timed:
        with pytest.raises(ValueError, match="no round"):
            timed.take()
        timed.timed_round()
        timed.timed_round()
        first = timed.take()
        assert set(first) == set(steps) and all(t > 0 for t in first.values())
        with pytest.raises(ValueError, match="no round"):
            timed.take()  # the rounds taken are forgotten
        timed.timed_round()
        assert set(timed.take()) == set(steps)
        fused, split = timed.backward_seconds(repeats=2) or (0.0, 0.0)
        assert fused > 0 and split > 0  # timed apart from the rounds
    with TimedSteps(steps, 4) as plain:
        assert plain.backward_seconds(repeats=2) is None


def test_split_fit_prices_the_halves_as_timed_and_never_below_the_fused_backward() -> None:
    # B is one action (its work and one dispatch), I then W two: the cost is the ratio of
    # the work alone.
    cluster = dataclasses.replace(_CPU, action_overhead_s=2e-4)
    work = 0.030
    fitted = fit_split(cluster, work + 2e-4, 1.25 * work + 4e-4)
    assert fitted.split_backward_cost == pytest.approx(1.25, rel=1e-9)
    assert fit_split(cluster, 0.030, 0.029).split_backward_cost == 1.0  # noise below the fused one


def test_the_backward_halves_timed_compute_what_the_fused_backward_does() -> None:
    # What the calibration times for a split backward's cost: I then W add the same
    # parameter gradients as B, each call once more to its own accumulator.
    import jax

    from pipedsl.cli.timed import backward_halves
    from pipedsl.executor.models import transformer

    model = transformer(num_stages=2, layers_per_stage=1, vocab=16, dim=8, heads=2, seq=4)
    runs, pipe = backward_halves(model, 4, 2)
    try:
        fused, split = runs["fused"](), runs["split"]()
        assert any(float(np.abs(np.asarray(a)).max()) > 0 for a in jax.tree_util.tree_leaves(fused))
        for a, b in zip(jax.tree_util.tree_leaves(fused), jax.tree_util.tree_leaves(split), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
        twice = runs["fused"]()
        for a, b in zip(jax.tree_util.tree_leaves(twice), jax.tree_util.tree_leaves(split), strict=True):
            np.testing.assert_allclose(np.asarray(a), 2 * np.asarray(b), rtol=1e-5, atol=1e-7)
    finally:
        pipe.close()


def test_the_machine_calibrated_again_is_fitted_afresh_to_the_steps_timed_later() -> None:
    # A calibration fitted on one machine, its steps timed again on a machine half as
    # fast whose kernels, steps, collectives inside a program and idle devices cost other
    # amounts: fitted again, it finds that machine's numbers and keeps the short
    # measurements (memory bandwidth, collectives, dispatch) it had.
    model = dataclasses.replace(_TINY, heads=4, layers=4)
    first = dataclasses.replace(_CPU, shared_cores=2, peak_flops=2e9, kernel_launch_s=1e-4, action_overhead_s=7e-5)
    later = dataclasses.replace(
        first, peak_flops=1e9, kernel_launch_s=3e-4, step_overhead_s=4e-3, working_set_bytes=5e6, collective_sync_s=2e-3,
        collective_sync_per_token_s=5e-6, idle_share=0.9, tensor_idle_share=0.55, alone_efficiency=0.75,
    )  # fmt: skip

    def timed(truth: Cluster) -> dict[object, float]:
        compute = {
            ("compute", n, m, k): priced_step(dataclasses.replace(model, layers=n), truth, 8, m, k)
            for n, m, k in _step_shapes(model, 4)
        }
        one_layer = dataclasses.replace(model, layers=1)
        tensor = {("tensor", t, m): s for (t, m), s in _tensor_steps(truth, one_layer, _tensor_shapes(model, 8, 4)).items()}
        pipeline = estimate(model, truth, step_plan(4, 1, pipeline_sequences(2, 4), pp=2)).step_time_s
        alone = estimate(model, truth, step_plan(2, 1, pipeline_sequences(4, 4), pp=4)).step_time_s
        tensor_pipeline = estimate(model, truth, step_plan(2, 2, pipeline_sequences(2, 4, 2), pp=2)).step_time_s
        return compute | tensor | {("pipeline", 1): pipeline, ("pipeline", 2): tensor_pipeline, ("alone", 4): alone}

    measured_split = dataclasses.replace(first, split_backward_cost=1.3)
    calibration = _calibration(measured_split, {}, all_reduce_s={(2, 4096): 3e-4}, backward_s=(0.0302, 0.0393))
    again = recalibrated(calibration, model, timed(later))
    fitted = again.cluster
    assert fitted.peak_flops == pytest.approx(1e9, rel=1e-4)
    assert fitted.kernel_launch_s == pytest.approx(3e-4, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(4e-3, rel=1e-3)
    assert fitted.working_set_bytes == pytest.approx(5e6, rel=1e-3)
    assert fitted.collective_sync_s == pytest.approx(2e-3, rel=1e-3)
    assert fitted.collective_sync_per_token_s == pytest.approx(5e-6, rel=1e-3)
    assert fitted.idle_share == pytest.approx(0.9, abs=1e-3)
    assert fitted.tensor_idle_share == pytest.approx(0.55, abs=1e-3)
    assert fitted.alone_efficiency == pytest.approx(0.75, abs=1e-3)
    assert fitted.split_backward_cost == 1.3 and again.backward_s == (0.0302, 0.0393)  # short measurements: kept
    assert (fitted.action_overhead_s, fitted.hbm_bandwidth, fitted.intra_node_latency) == (
        first.action_overhead_s, first.hbm_bandwidth, first.intra_node_latency,
    )  # fmt: skip
    assert again.all_reduce_s == {(2, 4096): 3e-4} and again.microbatch_size == 4
    assert again.largest_step == (4, 4, 1) and again.pipeline_step_s == pytest.approx(timed(later)[("pipeline", 1)])
    assert again.alone_step_s == pytest.approx(timed(later)[("alone", 4)])
    assert "reaches 75% of its ideal speed-up (fitted to a 4-stage pipeline's step" in again.describe()
    assert "55% with tp=2 stages (fitted to such a step" in again.describe()
    assert "split into I and W costs 1.30 times the fused one (the last of 2 stages: B 30.2 ms, I then W 39.3 ms)" in again.describe()
    assert "calibrated in" not in again.describe()  # its steps were timed with something else


def test_the_demo_prices_its_runs_again_as_the_search_would_on_another_machine() -> None:
    from pipedsl.cli.demo import _search, repriced, runnable_plans

    machine = dataclasses.replace(_CPU, shared_cores=2, peak_flops=2e9)
    plans = runnable_plans(_search(machine), 8)
    plans = [next(p for p in plans if p.kind == kind) for kind in ("spmd", "hybrid")] + plans[:4]
    assert repriced(plans, machine) == pytest.approx([p.planned_s for p in plans], rel=1e-12)
    slower = repriced(plans, dataclasses.replace(machine, peak_flops=1e9))
    assert all(s > p.planned_s for s, p in zip(slower, plans, strict=True))  # type: ignore[operator]


def test_interleaved_measurements_take_turns() -> None:
    order: list[str] = []
    medians = interleaved_medians({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=2)
    assert order == ["a", "b", "a", "b", "a", "b"]  # one warm-up each, then in turns
    assert set(medians) == {"a", "b"} and all(t >= 0 for t in medians.values())


def test_the_calibration_describes_every_fitted_number_with_its_measurements() -> None:
    cluster = dataclasses.replace(_CPU, step_overhead_s=9.5e-3, collective_sync_per_token_s=4.2e-6)
    calibration = MachineCalibration(
        cluster=cluster, step_s={(1, 1, 1): 0.04, (1, 1, 4): 0.12}, tensor_step_s={(2, 4): 0.06},
        pipeline_step_s=0.083, microbatch_size=4, all_reduce_s={(2, 4096): 1e-3}, seconds=50.0,
    )  # fmt: skip
    said = calibration.describe()
    assert "9.5 ms per step, no working-set cost" in said and "1 layer x 1 x 4 microbatches 120.0 ms" in said
    slowed = dataclasses.replace(calibration, cluster=dataclasses.replace(cluster, working_set_bytes=3.25e7))
    assert "twice as long at 32.5 MB of activations kept per device" in slowed.describe()
    assert "4.20 µs per token" in said and "tp=2 x 4 60.0 ms" in said
    assert "take up 100% of an idle one's time" in said and "step, 83.0 ms" in said
