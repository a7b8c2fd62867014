"""``pipedsl calibrate`` on this machine and the demo's reading of its runs: the cluster file
it writes describes the devices it measured, each schedule given is compiled and
calibrated before any is timed, and the demo claims an order of two plans only where
their predictions differ by more than the spread of their measurements."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pipedsl
from helpers import fresh_process_env
from pipedsl.cli.calibrate import Measurement
from pipedsl.cli.planned import PlannedRun
from pipedsl.cli.timed import Step, TimedSteps, interleaved_medians, round_times
from pipedsl.cli.workload import DEMO_MODEL
from pipedsl.simulator import Cluster, CostModel, Model, load_cluster, simulate
from pipedsl.simulator.calibration.machine import compute_shapes, tensor_degrees
from pipedsl.simulator.workers import available_cores

ROOT = Path(__file__).resolve().parents[2]


def _pipedsl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # A fresh process without the device count: the command must give JAX its devices itself;
    # on CPU, whatever else the machine has (the GPU path is the same fit on other numbers).
    env = fresh_process_env() | {"JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "pipedsl", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )


def _assert_cost_per_action(out: Path, cluster: Cluster) -> None:
    """The cluster's cost per task is what its comment says was measured: the step
    dispatched task by task against it as one program, the difference over its tasks
    (none where a loaded machine happened to time the step apart faster)."""
    said = re.search(
        r"dispatched task by task \(([\d.]+) ms\) against as one program \(([\d.]+) ms\), over its (\d+) tasks",
        out.read_text(),
    )
    assert said is not None
    apart, fused, tasks = float(said[1]), float(said[2]), int(said[3])
    assert cluster.action_overhead_s * 1e3 == pytest.approx(max(apart - fused, 0.0) / tasks, abs=0.01 / tasks)


@pytest.mark.slow
def test_calibrate_writes_this_machines_cluster_and_runs_schedules_against_their_fit(tmp_path: Path) -> None:
    out, costs = tmp_path / "machine.toml", tmp_path / "costs"
    done = _pipedsl(
        "calibrate", "zb_h1", "1f1b", "-p", "microbatches=4", "--devices", "2", "--microbatch-size", "1",
        "--steps", "2", "--out", str(out), "--save-costs", str(costs),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # The cluster of the devices measured, on the platform measured, with its measurements.
    cluster = load_cluster(out)
    assert isinstance(cluster, Cluster) and cluster.gpus_per_node == 2 and cluster.gpu == "cpu"
    assert cluster.host_cores == available_cores() and cluster.peak_flops > 0
    _assert_cost_per_action(out, cluster)
    assert "(platform: cpu)" in done.stdout
    for name in (
        "peak_flops",
        "kernel_launch_s",
        "step_overhead_s",
        "hbm_bandwidth",
        "intra_node_latency",
        "collective_latency_s",
        "host_cores",
    ):
        assert re.search(rf"^  {name} ", done.stdout, flags=re.MULTILINE), name
    reproduced = re.findall(r"train step: .* measured +([\d.]+) ms +model +([\d.]+) ms +([+-][\d.]+)%", done.stdout)
    # The data-parallel steps, then the 2-way tensor-parallel one (no busy steps: 2 devices, 2 cores or more).
    assert len(reproduced) == len(compute_shapes(DEMO_MODEL, 1)) + len(tensor_degrees(DEMO_MODEL, 2))
    assert "2 devices, tp=2" in done.stdout
    assert all(float(m) > 0 and float(p) > 0 for m, p, _ in reproduced)
    # Every schedule is compiled and calibrated before any is timed (their steps take turns),
    # trains (the loss goes down), and its saved cost model prices no more than predicted.
    lines = done.stdout.splitlines()
    calibrated = [i for i, line in enumerate(lines) if "compiled and calibrated" in line]
    timed = [line for line in lines if "per step" in line]
    assert len(calibrated) == len(timed) == 2 and max(calibrated) < lines.index(
        next(x for x in lines if "per step" in x)
    )
    for name, line in zip(("zb_h1", "1f1b"), timed, strict=True):
        first, last, predicted = re.search(r"loss ([\d.]+) -> ([\d.]+); predicted ([\d.]+) ms", line).groups()  # type: ignore[union-attr]
        assert float(last) < float(first)
        schedule = pipedsl.load(pipedsl.library_path(name), pp=2, microbatches=4)
        fitted = CostModel.from_toml(costs / f"{name}.toml")
        assert 0 < simulate(schedule, fitted).makespan * 1e3 <= float(predicted) + 0.1


def test_calibrate_rejects_a_model_the_schedule_cannot_split_before_it_measures() -> None:
    done = _pipedsl("calibrate", "1f1b", "-p", "pp=3", "-p", "microbatches=3", timeout=120)
    assert done.returncode == 2
    assert "split evenly" in done.stderr and "Traceback" not in done.stderr
    assert "Calibrating this machine" not in done.stdout


def test_the_calibration_times_its_steps_in_rounds_each_on_its_own_devices() -> None:
    from pipedsl.executor.models import transformer

    def build(layers: int) -> object:
        return transformer(num_stages=1, layers_per_stage=layers, vocab=16, dim=8, heads=2, seq=4)

    steps = {
        "all": Step(build(1), 2, microbatches=2),
        "one": Step(build(1), 2, devices=1),
        "tensor": Step(build(1), 2, tp=2),  # Megatron's sharding of the weights, sequence parallel
    }
    with TimedSteps(steps, 2) as timed:
        with pytest.raises(ValueError, match="no round"):
            timed.take()
        timed.timed_round()
        timed.timed_round()
        assert set(timed.take()) == set(steps)
        with pytest.raises(ValueError, match="no round"):
            timed.take()  # the rounds taken are forgotten
        timed.timed_round()
        assert set(timed.take()) == set(steps)


def test_interleaved_measurements_take_turns() -> None:
    order: list[str] = []
    medians = interleaved_medians({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, repeats=2)
    assert order == ["a", "b", "a", "b", "a", "b"]  # one warm-up each, then in turns
    assert set(medians) == {"a", "b"}
    assert round_times([0.3, 0.1, 0.2, 0.4, 0.5]) == (0.3, 0.2, 0.4)
    assert round_times([0.25]) == (0.25, 0.25, 0.25)


# --- the demo's reading of its runs ---------------------------------------------------------


def _result(label: str, predicted: float, searched: float, times: tuple[float, ...]) -> object:
    from pipedsl.cli.demo import RunResult

    run = Measurement(
        label=label, costs=CostModel(), predicted_s=predicted, measured_s=round_times(list(times))[0], times=times,
        losses=(1.0, 0.5), panels=None,  # type: ignore[arg-type]
    )  # fmt: skip
    return RunResult(run=run, predicted_s=predicted, searched_s=searched)


def test_the_demo_claims_no_order_for_predictions_closer_than_the_measured_spread() -> None:
    from pipedsl.cli.demo import _order_verdict, first_is_fastest, pairs_agreeing, within_spread

    # Spreads (interquartile ranges) in seconds; the larger of a pair's counts.
    assert within_spread([1.0, 1.01, 2.0], [0.02, 0.02, 0.2]) == [(0, 1)]
    assert within_spread([1.0, 1.1, 1.3], [0.02, 0.02, 0.35]) == [(0, 2), (1, 2)]
    # Orders are counted over the pairs the prediction tells apart only.
    assert pairs_agreeing([1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [0.0] * 3) == (3, 3)
    assert pairs_agreeing([1.0, 3.0, 2.0], [10.0, 20.0, 30.0], [0.0] * 3) == (2, 3)
    assert pairs_agreeing([1.0, 1.01, 3.0], [20.0, 10.0, 30.0], [0.05] * 3) == (2, 2)
    fast = _result("A", 0.100, 0.100, (0.100, 0.110, 0.120, 0.130, 0.140))
    close = _result("B", 0.105, 0.110, (0.095, 0.100, 0.105, 0.110, 0.115))
    slow = _result("C", 0.200, 0.200, (0.200, 0.210, 0.220, 0.230, 0.240))
    first, fastest, holds = first_is_fastest([fast, close, slow])  # type: ignore[list-item]
    assert (first, fastest, holds) == (fast, close, True)  # B measured faster, within A's spread
    said = _order_verdict([fast, close, slow])  # type: ignore[list-item]
    assert "A and B: predicted 100.0 and 105.0 ms" in said and "no order claimed" in said
    assert "2 of 2 pairs of runs that the prediction orders are ordered as measured" in said
    assert "is within the measured spread of the fastest, B" in said
    apart = _result("D", 0.090, 0.090, (0.300, 0.310, 0.320, 0.330, 0.340))
    assert "is not the fastest measured: B is" in _order_verdict([apart, close])  # type: ignore[list-item]


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


def test_the_demo_prices_its_runs_again_as_the_search_would_on_another_machine() -> None:
    from pipedsl.cli.demo import _search, repriced, runnable_plans

    machine = Cluster(
        name="cpu", gpu="cpu", peak_flops=2e9, matmul_efficiency=1.0, host_cores=2.0, memory_bytes=2**32,
        hbm_bandwidth=1e9, gpus_per_node=8, intra_node_bandwidth=1e9, intra_node_latency=1e-4,
        inter_node_bandwidth=1e9, inter_node_latency=1e-4,
    )  # fmt: skip
    plans: list[PlannedRun] = runnable_plans(_search(machine), 8)
    plans = [next(p for p in plans if p.kind == kind) for kind in ("spmd", "hybrid")] + plans[:4]
    assert repriced(plans, machine) == pytest.approx([p.planned_s for p in plans], rel=1e-12)
    slower = repriced(plans, dataclasses.replace(machine, peak_flops=1e9))
    assert all(s > p.planned_s for s, p in zip(slower, plans, strict=True))  # type: ignore[operator]


# --- one device: the calibration, and pipelines that share it --------------------------------


@pytest.mark.slow
def test_calibrate_on_one_device_writes_a_cluster_naming_its_platform_that_the_search_reads(tmp_path: Path) -> None:
    out = tmp_path / "one.toml"
    done = _pipedsl("calibrate", "--devices", "1", "--microbatch-size", "1", "--steps", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "# platform: cpu; device kind: cpu" in out.read_text()
    cluster = load_cluster(out)
    # One device: nothing to send, so no link is measured; its memory and dispatch are.
    assert cluster.gpus_per_node == 1 and cluster.intra_node_latency == 0.0 and not cluster.busy_rates
    assert cluster.hbm_bandwidth > 0 and cluster.memory_bytes > 0
    _assert_cost_per_action(out, cluster)
    found = _pipedsl("search", "--model", "demo-small", "--cluster", str(out), "--gpus", "1", "--top", "3")
    assert found.returncode == 0, found.stderr
    assert "dp=1 tp=1" in found.stdout


@pytest.mark.slow
def test_the_demo_on_one_device_runs_pipelines_that_share_it_against_their_prediction(tmp_path: Path) -> None:
    done = _pipedsl("demo", "--devices", "1", "--top", "2", "--steps", "1", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "(local backend, 1 device)" in done.stdout
    import csv

    with open(tmp_path / "out" / "runs.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert rows and all(float(r["predicted_s"]) > 0 and float(r["measured_s"]) > 0 for r in rows)
    # Every plan on one device runs its step as one program: its recorded steps, dispatched
    # apart, predict no step it takes, so no figure is fitted to its run.
    assert all(r["fitted_s"] == "" for r in rows)
    # The machine it calibrated, for `pipedsl search --cluster`.
    assert load_cluster(tmp_path / "out" / "cluster.toml").gpus_per_node == 1
    plans = [line for line in done.stdout.splitlines() if line.startswith("plan ") and "(pipeline)" in line]
    assert plans and all(" shared " in line for line in plans)


def test_a_plan_whose_pipeline_devices_share_one_device_runs_as_one_program() -> None:
    import jax

    from pipedsl.cli.calibrate import _pipeline
    from pipedsl.cli.workload import Workload

    tiny = Workload(
        Model(
            name="tiny-llama", layers=2, hidden=32, ffn_hidden=64, heads=4, kv_heads=2, seq_len=8, vocab=64,
            dtype_bytes=2, gated_ffn=True, biases=False, learned_positions=False, tied_embeddings=False, dropout=False,
        )
    )  # fmt: skip
    plan = PlannedRun(
        schedule="1f1b", kind="pipeline", dp=1, tp=1, pp=2, vpp=1, microbatches=2, microbatch_size=2, zero=0,
        shared_devices=True,
    )  # fmt: skip
    assert plan.devices == 1 and " shared " in plan.label()
    pipe, params, batch = _pipeline(plan.schedule_of(), 2, "local", plan, tiny)
    try:
        assert pipe.backend.fuse == "loop" and tiny.precision == "bf16"
        assert {d for mesh in pipe.backend.meshes for d in mesh.devices.flat} == {jax.devices()[0]}
        import optax

        optimizer, state, losses = optax.adam(1e-2), None, []
        for _ in range(3):
            params, state, loss = pipe.train_step(params, state, batch, optimizer=optimizer)
            losses.append(float(loss))
        assert losses[-1] < losses[0]
    finally:
        pipe.close()


def test_an_accelerator_trains_the_widest_small_llama_whose_state_fits_an_eighth_of_its_memory() -> None:
    from pipedsl.cli.workload import accelerator_workload

    v5e, small = accelerator_workload(16 * 2**30), accelerator_workload(2**30)
    assert v5e.precision == small.precision == "bf16" and v5e.model.gated_ffn and v5e.model.dtype_bytes == 2
    assert v5e.model.hidden == 1024 and small.model.hidden < 1024
    for w in (v5e, small):
        assert w.model.num_params * 18 * 8 <= {v5e: 16 * 2**30, small: 2**30}[w]
        assert w.model.layers % 4 == 0 and w.model.heads % w.model.num_kv_heads == 0


def test_the_bandwidth_leaves_out_a_calls_fixed_cost_where_it_is_most_of_a_small_update() -> None:
    from pipedsl.cli.machine import _bandwidth

    # Told that a dispatch takes a second, the 4 MB update is mostly fixed cost: the slope
    # between it and larger updates (within 1/16 of 256 MB) is taken instead.
    bandwidth, told = _bandwidth(1, dispatch_s=1.0, memory_bytes=256 * 2**20)
    assert bandwidth > 0 and "slope" in told and "16 MB" in told
    direct, said = _bandwidth(1, dispatch_s=0.0, memory_bytes=256 * 2**20)
    assert direct > 0 and said.startswith("an elementwise update of 4 MB")
