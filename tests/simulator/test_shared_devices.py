"""Pipeline devices that share their devices (``Plan.shared_devices``: a pipeline on one
chip), priced as the local backend runs them: one program of every action, back to back,
with nothing sent and no dispatch per action, every stage's state on the one device."""

from __future__ import annotations

import dataclasses
import json

import pytest
from bench_scripts import BENCH, bench_script

from pipedsl.simulator.candidates import candidate_plans
from pipedsl.simulator.estimate import estimate
from pipedsl.simulator.hardware import Cluster, Model, load_cluster
from pipedsl.simulator.plan import Plan, PlanError
from pipedsl.simulator.search import search

MODEL = Model(
    name="tiny",
    layers=4,
    hidden=128,
    ffn_hidden=512,
    heads=4,
    seq_len=64,
    vocab=512,
    dtype_bytes=4,
    tied_embeddings=False,
)

# One device with a dispatch cost per action and slow links: what sharing must not pay.
ONE = Cluster(
    name="one chip", gpu="test", peak_flops=1e12, matmul_efficiency=1.0, kernel_launch_s=2e-6,
    action_overhead_s=1e-4, step_overhead_s=1e-3, memory_bytes=2**34, hbm_bandwidth=1e11, gpus_per_node=1,
    intra_node_bandwidth=1e6, intra_node_latency=1e-3, inter_node_bandwidth=1e6, inter_node_latency=1e-3,
)  # fmt: skip


def _plan(schedule: str | None, pp: int, **options: object) -> Plan:
    return Plan(
        pp=pp, schedule=schedule, global_batch=8, microbatch_size=2, shared_devices=pp > 1, flash_attention=False,
        **options,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize(("schedule", "pp"), [("1f1b", 2), ("gpipe", 4), ("zb_h1", 2), ("interleaved_1f1b", 2)])
def test_a_shared_pipeline_is_every_action_back_to_back_without_dispatch_or_transfers(schedule: str, pp: int) -> None:
    vpp = 2 if schedule == "interleaved_1f1b" else 1
    e = estimate(MODEL, ONE, _plan(schedule, pp, vpp=vpp))
    m = e.plan.microbatches
    # Each stage's forward and backward for every microbatch, one after another: a split
    # backward's halves sum to the fused one, since no action pays a dispatch.
    assert e.pipeline_time_s == pytest.approx(m * sum(e.stage_forward_s) + m * sum(e.stage_backward_s), rel=1e-12)
    assert e.bubble == 0.0 and e.plan.gpus == 1
    assert e.simulation is not None
    timeline = e.simulation.timeline
    # One compute at a time, never idle between them; what is sent takes no time.
    assert timeline.busy().sum() == pytest.approx(timeline.makespan, rel=1e-12)
    assert (timeline.transfer_time() == 0.0).all()
    # The same pipeline on devices of its own pays the dispatch of every task and the links.
    own = dataclasses.replace(e.plan, shared_devices=False)
    apart = estimate(MODEL, dataclasses.replace(ONE, gpus_per_node=8), own)
    undispatched = estimate(MODEL, dataclasses.replace(ONE, gpus_per_node=8, action_overhead_s=0.0), own)
    assert apart.plan.gpus == pp and apart.stage_forward_s == e.stage_forward_s
    assert apart.pipeline_time_s > undispatched.pipeline_time_s


def test_a_shared_pipeline_holds_every_stage_on_its_device() -> None:
    spmd = estimate(MODEL, ONE, _plan(None, 1))
    shared = estimate(MODEL, ONE, _plan("gpipe", 4))
    apart = estimate(
        MODEL, dataclasses.replace(ONE, gpus_per_node=4), dataclasses.replace(shared.plan, shared_devices=False)
    )
    # The whole model's weights, gradients and optimizer state, as the one-stage plan's,
    # and, as it runs one microbatch through every stage at a time, its activations too.
    assert (shared.memory.weights, shared.memory.gradients, shared.memory.optimizer) == (
        spmd.memory.weights,
        spmd.memory.gradients,
        spmd.memory.optimizer,
    )
    assert shared.memory.activations == pytest.approx(spmd.memory.activations, rel=1e-6)
    assert shared.memory.total > apart.memory.total


def test_the_search_offers_shared_pipelines_when_asked_and_ranks_them_on_one_device() -> None:
    plans = list(candidate_plans(MODEL, ONE, 1, global_batch=8))
    assert plans and all(p.pp == 1 for p in plans)
    shared = [p for p in candidate_plans(MODEL, ONE, 1, global_batch=8, shared_pipelines=True) if p.pp > 1]
    assert shared and all(p.shared_devices and p.gpus == 1 for p in shared)
    assert {p.pp for p in shared} == {2, 4}  # pp x vpp divides the 4 layers
    frame = search(MODEL, ONE, 1, global_batch=8, flash_attention=False, shared_pipelines=True, schedules=["1f1b"])
    rows = frame[frame["kind"] == "pipeline"]
    assert len(rows) and rows["shared_devices"].all() and (rows["bubble"] == 0.0).all()
    assert "shared" in Plan(pp=2, schedule="1f1b", global_batch=8, shared_devices=True).label


def test_a_plan_without_a_pipeline_shares_nothing() -> None:
    with pytest.raises(PlanError, match="shared_devices"):
        Plan(pp=1, global_batch=8, shared_devices=True)


def test_a_calibrated_tpu_predicts_the_steps_measured_on_it() -> None:
    # The TPU v5e chip that bench/clusters/tpu-v5-lite.toml was calibrated on ran the
    # benchmark's plans (bench/results/bench_against_jit.jsonl, the real size, one program
    # per step): priced there by the benchmark's own code, each within 10% of measured.
    bench = bench_script("bench_against_jit")
    cluster = load_cluster(BENCH / "clusters" / "tpu-v5-lite.toml")
    assert cluster.devices_word == "chips"  # a TPU, though not a torus
    runs = [json.loads(line) for line in (BENCH / "results" / "bench_against_jit.jsonl").read_text().splitlines()]
    measured = [
        (name, run["figures"][f"{name}_step_ms"] / 1e3)
        for run in runs
        if run["figures"].get("platform") == "tpu"
        and run["figures"].get("dispatch") == "loop"
        and run["figures"].get("size") == "real"
        for name in bench.PLANS
        if f"{name}_step_ms" in run["figures"]
    ]
    assert {name for name, _ in measured} == set(bench.PLANS)
    for name, seconds in measured:
        predicted = bench.predicted_step_s(bench.REAL, bench.PLANS[name], cluster)
        assert predicted == pytest.approx(seconds, rel=0.10), name
