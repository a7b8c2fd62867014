"""The calibration package (pipedsl.simulator.calibration): its one fitter recovers the
numbers that produced its measurements, from recorded timelines, from a machine's
measurements (CPU and GPU) and from published runs alike, and its report accounts for
every parameter and step. Nothing here runs JAX: the measurements are made up from a
cluster the test knows."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

import pipedsl
from pipedsl.errors import PipedslError
from pipedsl.library import load
from pipedsl.program import lower
from pipedsl.simulator import Cluster, CostModel, Model, Plan, estimate, load_cluster, simulate
from pipedsl.simulator.calibration.fitter import Parameter, Step, grid_search, least_squares
from pipedsl.simulator.calibration.machine import (
    APART_SHAPE,
    MachineMeasurements,
    apart_tasks,
    busy_counts,
    cluster_toml,
    compute_shapes,
    fit_machine,
    fit_matmul,
    fit_ring,
    priced_step,
    tensor_degrees,
)
from pipedsl.simulator.calibration.report import quantity
from pipedsl.simulator.calibration.timelines import CalibrationError, fit_costs, timeline_report
from pipedsl.tasks import task_starts
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


def test_the_timeline_fit_reports_each_time_with_its_actions_and_each_step_reproduced() -> None:
    truth = CostModel(forward=(1.0, 2.0), input_grad=(1.0, 1.5), weight_grad=(0.5, 0.75), latency=0.1)
    sched = _library("zb_h1", pp=2, microbatches=4)
    recorded = [simulate(sched, truth).timeline] * 2
    fit = fit_costs(recorded, num_stages=2)
    report = timeline_report(fit, sched, recorded, fit.cost_model(), platform="cpu")
    lines = {p.name: p for p in report.parameters}
    assert set(lines) == {"F stage 0", "F stage 1", "I stage 0", "I stage 1", "W stage 0", "W stage 1", "transfer"}
    assert lines["F stage 1"].value == 2.0 and lines["F stage 1"].source == "median of 8 recorded actions"
    assert lines["transfer"].source == "median of 16 recorded sends"
    assert len(report.steps) == 2 and report.worst < 1e-12
    # A fit that does not reproduce its runs shows it.
    slower = fit.cost_model().with_changes(forward=(2.0, 4.0))
    assert timeline_report(fit, sched, recorded, slower, platform="cpu").worst > 0.1


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
_ALPHA, _LINK = 2e-4, 5e8
_REDUCES = {(n, s): 2 * (n - 1) * _ALPHA + 2 * (n - 1) / n * s / _LINK for n in (2, 8) for s in (4096, 1 << 22)}


def test_each_task_pays_the_dispatch_overhead_once() -> None:
    overhead = 1e-3
    slow = dataclasses.replace(_CPU, action_overhead_s=overhead)
    # pp = 1 is one program (the executor fuses a single pipeline device's step): no dispatch.
    spmd = Plan(dp=2, microbatch_size=2, global_batch=12)
    assert estimate(_TINY, slow, spmd).pipeline_time_s == estimate(_TINY, _CPU, spmd).pipeline_time_s
    # A zero-bubble pipeline runs I and W apart; each task (pipedsl.tasks) is one dispatch, on
    # its device's timeline, whatever the actions it holds.
    zb = Plan(pp=2, microbatch_size=1, global_batch=4, schedule="zb_h1")
    split, free = estimate(_TINY, slow, zb), estimate(_TINY, _CPU, zb)
    assert split.stage_forward_s == free.stage_forward_s and split.stage_backward_s == free.stage_backward_s
    assert split.simulation is not None and free.simulation is not None
    starts = task_starts(lower(load("zb_h1", pp=2, microbatches=4)).arrays)
    tasks = np.bincount(lower(load("zb_h1", pp=2, microbatches=4)).arrays.actions.device, weights=starts)
    busy = split.simulation.timeline.busy() - free.simulation.timeline.busy()
    np.testing.assert_allclose(busy, tasks * overhead, rtol=1e-9)
    assert tasks.sum() < 2 * 3 * 4  # fewer tasks than actions
    assert split.step_time_s > free.step_time_s + tasks.max() * overhead * 0.99
    with pytest.raises(PipedslError, match="action_overhead_s must be a number >= 0"):
        dataclasses.replace(_CPU, action_overhead_s=-1.0)


def test_ring_fit_recovers_latency_and_bandwidth() -> None:
    fitted_alpha, fitted_bandwidth = fit_ring(_REDUCES)
    assert fitted_alpha == pytest.approx(_ALPHA, rel=1e-6)
    assert fitted_bandwidth == pytest.approx(_LINK, rel=1e-6)


def test_matmul_fit_recovers_the_peak_and_the_size_at_half_of_it() -> None:
    peak, half = 800e12, 2e10
    times = {n: 2.0 * n**3 / (peak * (2.0 * n**3) / (2.0 * n**3 + half)) for n in (1024, 8192)}
    assert fit_matmul(times) == pytest.approx((peak, half), rel=1e-6)
    # A larger product no faster than the smaller: one rate for both, nothing at half.
    flat = {n: 2.0 * n**3 / 1e12 for n in (1024, 8192)}
    assert fit_matmul(flat) == pytest.approx((1e12, 0.0), rel=1e-6)


def test_least_squares_recovers_what_the_steps_call_for_and_drops_a_fixed_cost_they_do_not() -> None:
    truth = dataclasses.replace(_CPU, peak_flops=3e9, kernel_launch_s=2e-4)
    shapes = compute_shapes(_TINY, 4)
    steps = [
        Step(f"{shape}", priced_step(dataclasses.replace(_TINY, layers=shape[0]), truth, 8, shape[1], shape[2]),
             lambda c, shape=shape: priced_step(dataclasses.replace(_TINY, layers=shape[0]), c, 8, shape[1], shape[2]))
        for shape in shapes
    ]  # fmt: skip
    parameters = [
        Parameter("peak_flops", "FLOP/s", 1e6, 1e15, 1e9),
        Parameter("kernel_launch_s", "s", 1e-9, 1.0, 1e-4, fixed_cost=True),
        Parameter("step_overhead_s", "s", 1e-7, 10.0, 1e-3, fixed_cost=True),
    ]
    fitted = least_squares(_CPU, parameters, steps)
    assert fitted.cluster.peak_flops == pytest.approx(3e9, rel=1e-4)
    assert fitted.cluster.kernel_launch_s == pytest.approx(2e-4, rel=1e-4)
    assert fitted.cluster.step_overhead_s == 0.0  # the truth has none
    assert max(abs(e) for e in fitted.errors()) < 1e-6
    assert fitted.fitted == ("peak_flops", "kernel_launch_s", "step_overhead_s")


def test_grid_search_takes_each_block_in_turn_and_averages_each_group_first() -> None:
    # One group's error counts as much as another's, whatever their sizes; the second
    # block is searched at the best of the first.
    def step(group: str, target: float) -> Step:
        return Step(group, target, lambda c: c.matmul_efficiency + c.kernel_launch_s, group=group, cluster="a")

    steps = [step("three", 0.7)] * 3 + [step("two", 0.5)] * 2
    grid = {"matmul_efficiency": (0.5, 0.6, 0.7, 0.8), "kernel_launch_s": (0.0, 0.1)}
    clusters, error = grid_search({"a": _CPU}, grid, (("matmul_efficiency",), ("kernel_launch_s",)), steps)
    # Averaged over steps 0.7 would win (0.16 against 0.17); over groups 0.5 does (0.14 against 0.2).
    assert clusters["a"].matmul_efficiency == 0.5 and clusters["a"].kernel_launch_s == 0.0
    assert error == pytest.approx(abs(0.5 / 0.7 - 1) / 2)
    # The second block, searched at the first's best: a launch cost that brings the
    # price to 0.6 leaves both groups off by more.
    assert grid_search({"a": _CPU}, grid, (("matmul_efficiency", "kernel_launch_s"),), steps)[0]["a"] == clusters["a"]


def _cpu_measurements(truth: Cluster, model: Model, *, busy: bool = True) -> MachineMeasurements:
    """What pipedsl calibrate would measure on a CPU machine that ``truth`` describes."""
    steps = {
        s: priced_step(dataclasses.replace(model, layers=s[0]), truth, 8, s[1], s[2]) for s in compute_shapes(model, 4)
    }
    return MachineMeasurements(
        platform="cpu", device_kind="cpu", devices=8, host_cores=truth.host_cores, memory_bytes=truth.memory_bytes,
        memory_source="the host's memory over the 8 devices", bandwidth=truth.hbm_bandwidth, all_reduce_s=_REDUCES,
        dispatch_s=truth.action_overhead_s, step_s=steps, microbatch_size=4, dtype="float32",
        busy_s={n: priced_step(model, truth, n, 4) for n in busy_counts(8, truth.host_cores)} if busy else {},
        tensor_s={t: priced_step(model, truth, 8, 4, tp=t) for t in tensor_degrees(model, 8)}, seconds=30.0,
    )  # fmt: skip


_TRUTH = dataclasses.replace(
    _CPU, peak_flops=3e9, kernel_launch_s=2e-4, step_overhead_s=5e-3, host_cores=2.0,
    busy_rates=(0.3, 0.45, 0.575, 0.7, 0.775, 0.85, 0.925, 1.0),
    hbm_bandwidth=2e9, intra_node_bandwidth=_LINK, intra_node_latency=_ALPHA, inter_node_bandwidth=_LINK,
    inter_node_latency=_ALPHA, action_overhead_s=1e-4, collective_latency_s=6e-4,
)  # fmt: skip


def test_a_cpu_machine_is_fitted_back_to_the_cluster_that_produced_its_measurements() -> None:
    model = dataclasses.replace(_TINY, layers=4)
    fitted = fit_machine(model, _cpu_measurements(_TRUTH, model)).cluster
    for name in ("peak_flops", "kernel_launch_s", "step_overhead_s", "intra_node_latency",
                 "intra_node_bandwidth", "hbm_bandwidth", "action_overhead_s", "host_cores",
                 "collective_latency_s"):  # fmt: skip
        assert getattr(fitted, name) == pytest.approx(getattr(_TRUTH, name), rel=1e-3), name
    # The collectives' fixed cost comes from the tensor-parallel steps: 2-way only, as the
    # model has two heads; without them it is not fitted.
    assert tensor_degrees(model, 8) == (2,) and tensor_degrees(dataclasses.replace(model, heads=4), 8) == (2, 4)
    alone = dataclasses.replace(_cpu_measurements(_TRUTH, model), tensor_s={})
    assert fit_machine(model, alone).cluster.collective_latency_s == 0.0
    # The node's rate at n busy devices is the measured throughput over the all-busy one
    # (n / seconds on n devices against 8 / seconds on 8), linear between the counts.
    measured = _cpu_measurements(_TRUTH, model)
    every = measured.step_s[measured.largest_step]
    ratio = {n: n / s / (8 / every) for n, s in measured.busy_s.items()}
    assert [fitted.busy_rates[n - 1] for n in (1, 2, 4, 8)] == pytest.approx([ratio[1], ratio[2], ratio[4], 1.0])
    assert fitted.busy_rates[2] == pytest.approx((ratio[2] + ratio[4]) / 2)
    assert fitted.busy_rates[5] == pytest.approx(ratio[4] + (1.0 - ratio[4]) / 2)
    # Fewer busy devices reach less of the node's rate than all of them, as the truth has it.
    assert list(fitted.busy_rates) == sorted(fitted.busy_rates)
    # Without the steps on fewer devices, each busy device gets its share of the cores.
    assert fit_machine(model, _cpu_measurements(_TRUTH, model, busy=False)).cluster.busy_rates == ()
    assert (busy_counts(8, 2.0), busy_counts(8, 8.0), busy_counts(6, 1.5), busy_counts(8, None)) == (
        (1, 2, 4),
        (),
        (1, 2, 4),
        (),
    )


def test_the_report_gives_every_fitted_number_its_measurement_and_every_step_its_error() -> None:
    model = dataclasses.replace(_TINY, layers=4)
    calibration = fit_machine(model, _cpu_measurements(_TRUTH, model))
    report = calibration.report
    named = {p.name.split("[")[0] for p in report.parameters}  # busy_rates[0] names busy_rates
    # Every field the calibration set is accounted for; the rest keep their defaults.
    changed = {f.name for f in dataclasses.fields(Cluster) if getattr(calibration.cluster, f.name) != f.default}
    assert (
        changed - {"name", "gpu", "peak_flops", "matmul_efficiency", "inter_node_bandwidth", "inter_node_latency"}
        <= named
    )
    assert all(p.source for p in report.parameters)
    # The training steps on every device are reproduced; the steps on fewer devices show how
    # far the measured rates, applied to the compute alone, are from them.
    fitted = len(compute_shapes(model, 4)) + len(tensor_degrees(model, 8))
    assert len(report.steps) == fitted + 3
    assert max(abs(s.error) for s in report.steps[:fitted]) < 1e-3 and report.worst < 0.1
    assert "8 devices, tp=2" in report.steps[fitted - 1].name
    text = calibration.describe()
    assert "platform: cpu" in text and "busy_rates[3]" in text and "4 devices (the other 4 idle)" in text
    assert re.search(r"peak_flops\s+3 GFLOP/s", text)
    # A step the model cannot reproduce shows its error.
    busy = calibration.measurements.busy_s
    off = dataclasses.replace(calibration.measurements, busy_s={**busy, 2: busy[2] / 100})
    assert fit_machine(model, off).report.worst > 0.5
    assert quantity(2.5e-4, "s") == "250 µs" and quantity(2.0, "cores") == "2 cores"


def test_the_cluster_file_reads_back_as_the_calibrated_cluster(tmp_path: Path) -> None:
    model = dataclasses.replace(_TINY, layers=4)
    calibration = fit_machine(model, _cpu_measurements(_TRUTH, model))
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(calibration))
    assert load_cluster(path) == calibration.cluster
    assert "# busy_rates[1]: the step below on 2 of the 8 devices: its throughput over" in path.read_text()


def test_a_gpu_machine_takes_its_rate_from_products_and_shares_no_cores() -> None:
    peak, half = 800e12, 2e10
    products = {(dtype, n): 2.0 * n**3 / (rate * (2.0 * n**3) / (2.0 * n**3 + half))
                for dtype, rate in (("bfloat16", peak), ("float32", peak / 16)) for n in (1024, 8192)}  # fmt: skip
    # A compiler that fuses most elementwise work away moves 0.3 of its unfused traffic.
    truth = dataclasses.replace(
        _CPU, peak_flops=peak, matmul_half_flops=half, kernel_launch_s=5e-6, step_overhead_s=2e-3, hbm_bandwidth=4e12,
        elementwise_traffic=0.3,
    )  # fmt: skip
    model = dataclasses.replace(_TINY, layers=4, dtype_bytes=2)
    steps = {
        s: priced_step(dataclasses.replace(model, layers=s[0]), truth, 1, s[1], s[2]) for s in compute_shapes(model, 4)
    }
    # The step of APART_SHAPE dispatched task by task: 3e-4 s more per task (pipedsl.tasks:
    # each microbatch's F and B, one task).
    tasks = apart_tasks(APART_SHAPE[2])
    assert tasks == APART_SHAPE[2]
    apart = steps[APART_SHAPE] + tasks * 3e-4
    measured = MachineMeasurements(
        platform="gpu", device_kind="NVIDIA H200", devices=1, host_cores=None, memory_bytes=140 * 2**30,
        memory_source="the device allocator's limit", bandwidth=4e12, all_reduce_s={}, dispatch_s=0.0, step_s=steps,
        microbatch_size=4, dtype="bfloat16", matmul_s=products, apart_s=apart,
    )  # fmt: skip
    calibration = fit_machine(model, measured)
    fitted = calibration.cluster
    assert fitted.host_cores is None and fitted.gpu == "NVIDIA H200" and fitted.memory_bytes == 140 * 2**30
    assert (fitted.peak_flops, fitted.matmul_half_flops) == pytest.approx((peak, half), rel=1e-6)
    assert fitted.kernel_launch_s == pytest.approx(5e-6, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(2e-3, rel=1e-3)
    assert fitted.elementwise_traffic == pytest.approx(0.3, rel=1e-3)
    assert fitted.action_overhead_s == pytest.approx(3e-4, rel=1e-9)
    assert "dispatched task by task" in calibration.describe()
    # Without that step the cost per task is the tiny program's dispatch.
    assert fit_machine(model, dataclasses.replace(measured, apart_s=None)).cluster.action_overhead_s == 0.0
    text = calibration.describe()
    assert "platform: gpu" in text and "float32 8192³" in text and "host_cores" not in text
    assert "one device: no link to measure" in text


def test_every_cluster_field_is_a_documented_physical_quantity() -> None:
    # docs/cost-model.md states each term with its unit and where it is measured; a
    # field that is not there is a term nobody can name.
    page = (Path(__file__).resolve().parents[2] / "docs" / "cost-model.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \|", page, flags=re.MULTILINE))
    assert {f.name for f in dataclasses.fields(Cluster)} == listed
