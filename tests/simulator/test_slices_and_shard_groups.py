"""Shard groups (``Plan.fsdp``) and slices in the estimator and the search: FSDP inside a TPU
slice or a GPU node, data parallelism across them, the cross-slice reduction over DCN."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipedsl.cli import main
from pipedsl.simulator.candidates import candidate_plans, shard_groups
from pipedsl.simulator.data_parallel import dp_group, replica_group
from pipedsl.simulator.estimate import estimate
from pipedsl.simulator.hardware import DescriptionError, load_cluster, load_model
from pipedsl.simulator.network import expected_maximum, slice_wait_s
from pipedsl.simulator.plan import Plan, PlanError
from pipedsl.simulator.search import search_plans
from pipedsl.simulator.torus import TorusGroup

V5E = load_cluster("tpu-v5e")
LLAMA_8B = load_model("llama-8b")


def _fsdp(dp: int, fsdp: int | None, **more: object) -> Plan:
    return Plan(dp=dp, fsdp=fsdp, global_batch=dp, zero=3, recompute="full", **more)  # type: ignore[arg-type]


def test_a_multi_slice_step_is_the_one_slice_step_and_the_dcn_reduction_left_exposed() -> None:
    one = estimate(LLAMA_8B, V5E, _fsdp(256, None))
    four = estimate(LLAMA_8B, dataclasses.replace(V5E, slices=4), _fsdp(1024, 256))
    # The same work per chip: the forward and backward are the one slice's.
    assert four.pipeline_time_s == pytest.approx(one.pipeline_time_s, rel=1e-9)
    # Each chip's gradient shard is all-reduced across the four slices over DCN after the
    # backward, layer by layer; what the backward does not hide is the tail, and at each
    # layer's reduction the step waits for the slowest slice.
    sliced = dataclasses.replace(V5E, slices=4)
    wait = slice_wait_s(LLAMA_8B.layers, sliced)
    assert wait == pytest.approx(LLAMA_8B.layers * V5E.slice_jitter_s * expected_maximum(4)) and wait > 0
    assert four.dp_tail_s > one.dp_tail_s + wait
    assert four.step_time_s == pytest.approx(four.pipeline_time_s + four.dp_tail_s + four.optimizer_s, rel=1e-12)
    assert four.step_time_s > one.step_time_s
    # The ZeRO group stays inside one slice; the replicas cross them over DCN.
    plan = _fsdp(1024, 256)
    group, replicas = dp_group(plan, sliced), replica_group(plan, sliced)
    assert isinstance(group, TorusGroup) and group.slices == 1 and group.ranks == 256
    assert isinstance(replicas, TorusGroup) and replicas.slices == 4 and replicas.ranks == 4


def test_the_slices_wait_grows_with_the_layers_not_the_step() -> None:
    # Twice the layers at half the microbatch: the same work per chip, twice the meetings of
    # the slices, so twice the wait for the slowest of them.
    sliced = dataclasses.replace(V5E, slices=4)
    deep = dataclasses.replace(LLAMA_8B, layers=2 * LLAMA_8B.layers)
    two = Plan(dp=1024, fsdp=256, global_batch=2048, microbatch_size=2, zero=3, recompute="full")
    shallow_step = estimate(LLAMA_8B, sliced, two).dp_tail_s
    deep_step = estimate(deep, sliced, _fsdp(1024, 256)).dp_tail_s
    assert slice_wait_s(deep.layers, sliced) == pytest.approx(2 * slice_wait_s(LLAMA_8B.layers, sliced))
    assert deep_step - shallow_step == pytest.approx(slice_wait_s(LLAMA_8B.layers, sliced), rel=0.1)


def test_a_torus_prices_its_slices_wait_per_layer_and_gpu_nodes_per_step() -> None:
    with pytest.raises(DescriptionError, match="give slice_jitter_s"):
        dataclasses.replace(V5E, straggler_cv=0.01)
    with pytest.raises(DescriptionError, match="slice_jitter_s = 0.01 needs a torus"):
        dataclasses.replace(load_cluster("h100-80gb"), slice_jitter_s=0.01)


def test_shard_groups_shard_the_state_over_the_group_only() -> None:
    grouped = estimate(LLAMA_8B, load_cluster("h100-80gb"), _fsdp(64, 8)).memory
    flat = estimate(LLAMA_8B, load_cluster("h100-80gb"), _fsdp(64, None)).memory
    assert grouped.weights == pytest.approx(8 * flat.weights, rel=1e-6)
    assert grouped.optimizer == pytest.approx(8 * flat.optimizer, rel=1e-6)


def test_shard_groups_are_checked() -> None:
    with pytest.raises(PlanError, match="fsdp must be a whole number dividing dp=8"):
        Plan(dp=8, fsdp=3, global_batch=8, zero=3)
    with pytest.raises(PlanError, match="zero=0 shards nothing"):
        Plan(dp=8, fsdp=4, global_batch=8)
    assert Plan(dp=8, fsdp=8, global_batch=8, zero=3).fsdp is None
    assert Plan(dp=8, fsdp=2, global_batch=8, zero=1).replicas == 4


def test_the_search_offers_fsdp_in_a_slice_or_node_and_data_parallelism_across() -> None:
    sliced = dataclasses.replace(V5E, slices=4)
    assert shard_groups(sliced, 1024, dp=1024, tp=1, cp=1) == (None, 256)
    assert shard_groups(V5E, 256, dp=256, tp=1, cp=1) == (None,)
    assert shard_groups(load_cluster("h100-80gb"), 64, dp=32, tp=2, cp=1) == (None, 4)
    plans = list(candidate_plans(LLAMA_8B, sliced, 1024, global_batch=1024, schedules=["1f1b"]))
    assert any(p.fsdp == 256 and p.pp == 1 and p.zero == 3 for p in plans)
    ranked = search_plans("llama-8b", "h100-80gb", 16, global_batch=64, schedules=["1f1b"], top=50)
    assert any(p.fsdp < p.dp and p.plan.fsdp == p.fsdp for p in ranked)


def test_estimate_and_search_take_slices(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "--model", "llama-8b", "--cluster", "tpu-v5e", "--zero", "3", "--recompute", "full", "--json"]
    assert main([*base, "--dp", "256", "--global-batch", "256"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*base, "--slices", "4", "--dp", "1024", "--fsdp", "256", "--global-batch", "1024"]) == 0
    four = json.loads(capsys.readouterr().out)
    assert four["plan"]["fsdp"] == 256 and four["step_time_s"] > one["step_time_s"]
    assert four["dp_tail_s"] > one["dp_tail_s"]
    assert main([*base, "--dp", "512", "--global-batch", "512"]) != 0
    assert "ask for 2 slices of 256" in capsys.readouterr().err
    found = main(
        ["search", "--model", "llama-8b", "--cluster", "tpu-v5e", "--slices", "4", "--devices", "1024",
         "--schedules", "1f1b", "--top", "3"]
    )  # fmt: skip
    assert found == 0
    assert "4 slices joined by DCN" in capsys.readouterr().out
