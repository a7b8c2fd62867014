"""A step run as one program over the pipeline devices, priced tick by tick (pipedsl.simulator.ticked)."""

from __future__ import annotations

import dataclasses

import pytest

import pipedsl
from pipedsl.simulator import tick_timing
from pipedsl.simulator.estimate import prepare
from pipedsl.simulator.hardware import load_cluster, load_model
from pipedsl.simulator.pipelines import Pipelines
from pipedsl.simulator.plan import Plan
from pipedsl.stage_costs import StageCosts
from pipedsl.ticks import tick_table


def test_a_step_is_its_ticks_slowest_actions_and_transfers_and_one_dispatch() -> None:
    # GPipe, 2 devices, 2 microbatches: ticks 0F0 | 0F1 1F0 | 1F1 | 1B0 | 0B0 1B1 | 0B1.
    schedule = pipedsl.load("gpipe", pp=2, microbatches=2)
    costs = StageCosts(
        forward=(1.0, 1.0), backward=(2.0, 3.0), input_grad=(1.0, 1.0), weight_grad=(1.0, 1.0),
        activation_transfer=(0.5, 0.0), gradient_transfer=(0.0, 0.25), residual_bytes=(0, 0),
        weight_residual_bytes=(0, 0), overlap_sends=True, dispatch=0.1,
    )  # fmt: skip
    timed = tick_timing(tick_table(schedule), costs)
    # Computes 1 + 1 + 1 + 3 + 3 + 2, activations moved after ticks 0 and 1, gradients after 3 and 4.
    assert timed.ticks.tolist() == [1.5, 1.5, 1.0, 3.25, 3.25, 2.0]
    assert timed.makespan == pytest.approx(12.6)
    busy = 2 * (1 + 1) + 2 * (2 + 3)
    assert timed.bubble_ratio == pytest.approx(1 - busy / (2 * 12.6))


def test_uniform_1f1b_ticks_give_the_textbook_bubble_at_equal_forward_and_backward() -> None:
    # With F = B every tick lasts one unit: 1F1B's 2(m + p - 1) ticks, bubble (p - 1)/(m + p - 1).
    schedule = pipedsl.load("1f1b", pp=4, microbatches=8)
    costs = StageCosts(
        forward=(1.0,) * 4, backward=(1.0,) * 4, input_grad=(0.5,) * 4, weight_grad=(0.5,) * 4,
        activation_transfer=(0.0,) * 4, gradient_transfer=(0.0,) * 4, residual_bytes=(0,) * 4,
        weight_residual_bytes=(0,) * 4, overlap_sends=True,
    )  # fmt: skip
    timed = tick_timing(tick_table(schedule), costs)
    assert timed.makespan == 2 * (8 + 4 - 1)
    assert timed.bubble_ratio == pytest.approx(3 / 11)


def test_a_plan_the_executor_runs_as_one_program_is_priced_by_its_ticks() -> None:
    model = dataclasses.replace(load_model("llama-8b"), tied_embeddings=False)
    cluster = load_cluster("h100-80gb")
    plan = Plan(pp=4, global_batch=8, microbatch_size=1, schedule="1f1b", framework="pipedsl")
    pipelines = Pipelines()
    prepared = prepare(model, cluster, plan, pipelines=pipelines)
    assert prepared.shapes.ticked
    assert prepared.key is not None
    ticked = pipelines.tick_timing(prepared.key, prepared.cost_model())
    result = prepared.finish()
    assert result.pipeline_time_s == pytest.approx(ticked.makespan)
    # Ticks keep the devices in step: never faster than the event simulation of the same actions.
    assert ticked.makespan >= pipelines.timing(prepared.key, prepared.cost_model()).makespan - 1e-12
    # A leaf two stages share (tied embeddings), data parallelism or another framework: tasks apart.
    tied = dataclasses.replace(model, tied_embeddings=True)
    assert not prepare(tied, cluster, plan, pipelines=pipelines).shapes.ticked
    assert not prepare(model, cluster, dataclasses.replace(plan, dp=2, global_batch=16)).shapes.ticked
    assert not prepare(model, cluster, dataclasses.replace(plan, framework="megatron")).shapes.ticked
    # A cluster calibrated on CPU devices prices a dispatch per task: the executor runs its tasks apart there.
    calibrated = dataclasses.replace(cluster, action_overhead_s=50e-6)
    assert not prepare(model, calibrated, plan).shapes.ticked
