"""Policy schedules in the plan search: the in-flight limits memory allows, ranked."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipedsl import library
from pipedsl.analysis import chain_lower_bound, peak_held, peak_inflight
from pipedsl.cli.planned import PlannedRun
from pipedsl.policy import Policy
from pipedsl.program import lower
from pipedsl.simulator.estimate import DoesNotFit, prepare
from pipedsl.simulator.hardware import Cluster, Model, load_cluster
from pipedsl.simulator.pipelines import Pipelines
from pipedsl.simulator.plan import Plan
from pipedsl.simulator.policy_plans import LimitedPlan, candidate_limits, fitting_limit, prepare_plan, takes_limit
from pipedsl.simulator.search import search_plans
from pipedsl.synthesize import synthesize

MODEL = Model(name="gpt-small", layers=8, hidden=1024, ffn_hidden=4096, heads=16, seq_len=1024, vocab=32000)
PLAN = Plan(dp=1, tp=1, pp=4, microbatch_size=2, global_batch=32, schedule="zb_auto")


def _cluster(model_gib: float) -> Cluster:
    """A100s with ``model_gib`` GiB per GPU usable (1 GiB more, reserved)."""
    return dataclasses.replace(
        load_cluster("a100-80gb"), memory_bytes=int((1 + model_gib) * 2**30), reserved_bytes=2**30
    )


def test_only_policy_schedules_with_a_limit_parameter_take_one() -> None:
    assert takes_limit("zb_auto") and takes_limit("zbv_auto")
    assert not takes_limit("zb_h2")  # a policy, but its limit is fixed at 2pp - 1
    assert not takes_limit("1f1b") and not takes_limit(None)


def test_candidate_limits_stay_between_the_stages_on_a_device_and_what_fits() -> None:
    assert candidate_limits(8, 8, 1, 40) == (8, 15, 40)
    assert candidate_limits(8, 8, 1, 10) == (8, 10)  # 2pp - 1 does not fit
    assert candidate_limits(16, 8, 2, 40) == (16, 40)  # 2pp - 1 is below the default
    assert candidate_limits(16, 8, 2, 5) == (5,)  # the default does not fit
    assert candidate_limits(4, 4, 2, 1) == ()  # not one microbatch on both stages


def test_a_plan_whose_memory_admits_only_a_smaller_limit_gets_that_limit() -> None:
    cluster = _cluster(2.0)
    pipelines = Pipelines(keep_simulations=False)
    # At its default limit (pp = 4 in flight) the plan does not fit.
    with pytest.raises(DoesNotFit):
        prepare(MODEL, cluster, PLAN, pipelines=pipelines, fits_first=True)
    largest = fitting_limit(prepare(MODEL, cluster, PLAN, pipelines=pipelines))
    assert 1 <= largest < PLAN.pp
    found = prepare_plan(MODEL, cluster, PLAN, pipelines=pipelines)
    assert [p.limit for p in found if isinstance(p, LimitedPlan)] == [largest]
    done = found[0].finish()
    assert done.inflight_limit == largest and done.fits
    # The order behind the estimate keeps the limit.
    assert isinstance(found[0], LimitedPlan)
    policy = library.load("zb_auto", pp=4, microbatches=16, max_inflight=largest)
    assert isinstance(policy, Policy)
    assert max(peak_inflight(synthesize(policy, found[0].costs))) <= largest


def test_more_memory_adds_larger_limits_and_the_largest_is_fastest_here() -> None:
    # Unfused attention (its scores written to memory) makes the input-gradient half long
    # enough that the in-flight limit changes the step; with FlashAttention every limit
    # gives this small model the same step.
    plan = dataclasses.replace(PLAN, flash_attention=False)
    found = prepare_plan(MODEL, _cluster(6.0), plan, pipelines=Pipelines(keep_simulations=False))
    limits = [p.limit for p in found if isinstance(p, LimitedPlan)]
    assert limits == [4, 7]  # pp, and 2pp - 1 = the most that fits
    times = [p.finish().step_time_s for p in found]
    assert times[1] < times[0]


@pytest.mark.parametrize("schedule, vpp, gib", [("zb_auto", 1, 4.0), ("zbv_auto", 2, 8.0)])
def test_the_lower_bound_holds_at_every_limit(schedule: str, vpp: int, gib: float) -> None:
    plan = dataclasses.replace(PLAN, schedule=schedule, vpp=vpp)
    found = prepare_plan(MODEL, _cluster(gib), plan, pipelines=Pipelines(keep_simulations=False))
    assert len(found) >= 2
    for p in found:
        assert p.lower_bound_s <= p.finish().step_time_s
    # A smaller limit's bound is no lower: the few microbatches in flight bound the pace.
    bounds = [p.lower_bound_s for p in found]
    assert bounds == sorted(bounds, reverse=True)


@pytest.mark.parametrize("schedule, vpp", [("zb_auto", 1), ("zbv_auto", 2)])
def test_the_lower_bound_holds_for_every_plan_and_limit_of_a_search(schedule: str, vpp: int) -> None:
    # Unfused attention makes memory tight, so that small limits (where a microbatch that
    # a V placement admits holds both its stages' places) are among those tried.
    plans = [
        dataclasses.replace(PLAN, schedule=schedule, vpp=vpp, pp=pp, microbatch_size=b, flash_attention=False)
        for pp in (2, 4)
        for b in (1, 2, 4)
    ]
    checked = 0
    for gib in (3.0, 6.0, 12.0):
        pipelines = Pipelines(keep_simulations=False)
        for plan in plans:
            try:
                found = prepare_plan(MODEL, _cluster(gib), plan, pipelines=pipelines)
            except DoesNotFit:
                continue
            for p in found:
                assert p.lower_bound_s <= p.finish().step_time_s
                checked += 1
    assert checked >= 20


def test_no_limit_fits_raises_does_not_fit() -> None:
    with pytest.raises(DoesNotFit):
        prepare_plan(MODEL, _cluster(1.2), PLAN, pipelines=Pipelines(keep_simulations=False))


def test_the_search_ranks_policy_plans_within_the_memory_budget_deterministically() -> None:
    cluster = _cluster(3.0)

    def run() -> list[tuple[object, ...]]:
        ranked = search_plans(MODEL, cluster, 8, global_batch=32, schedules=["zb_auto", "1f1b"])
        return [(*p.row().values(), p.plan) for p in ranked]

    first = run()
    assert first == run()
    ranked = search_plans(MODEL, cluster, 8, global_batch=32, schedules=["zb_auto", "1f1b"])
    policy = [p for p in ranked if p.schedule == "zb_auto"]
    assert policy and all(p.inflight_limit >= 1 for p in policy)
    assert all(p.inflight_limit == 0 for p in ranked if p.schedule != "zb_auto")
    assert all(p.memory_bytes_per_gpu <= cluster.usable_bytes for p in ranked)
    best = policy[0]
    base = prepare(MODEL, cluster, best.plan, pipelines=Pipelines())
    assert best.inflight_limit <= fitting_limit(base)
    # Some policy plan runs above its default limit (pp), which only memory allowed.
    assert any(p.inflight_limit > p.pp for p in policy)


def test_a_planned_run_passes_the_limit_to_the_schedule() -> None:
    row = {"kind": "pipeline", "schedule": "zb_auto", "dp": 1, "tp": 1, "pp": 4, "vpp": 1, "microbatch_size": 2}
    planned = PlannedRun.from_row({**row, "microbatches": 16, "zero": 0, "inflight_limit": 6})
    assert planned.params() == {"pp": 4, "microbatches": 16, "max_inflight": 6}
    assert "-p max_inflight=6" in planned.command()
    assert "max_inflight" not in PlannedRun.from_row({**row, "microbatches": 16, "zero": 0}).params()


def test_an_spmd_plan_keeps_one_microbatch_at_a_time_as_priced() -> None:
    # The simulator prices an SPMD plan's memory at one microbatch's activations
    # (gradient accumulation); the schedule it runs must keep no more.
    row = {"kind": "spmd", "schedule": "", "dp": 8, "tp": 1, "pp": 1, "vpp": 1, "microbatch_size": 2}
    planned = PlannedRun.from_row({**row, "microbatches": 4, "zero": 1})
    schedule = planned.schedule_of()
    assert schedule.num_stages == 1
    assert peak_inflight(schedule) == (1,)


@pytest.mark.parametrize("schedule", ["zb_auto", "zbv_auto"])
def test_policy_plans_are_costed_as_the_default_order_would_be_without_making_it(schedule: str) -> None:
    # No order is synthesised while costing (prepare with a layout); what the limits and the
    # synthesis later use is what preparing the default order gives.
    plan = dataclasses.replace(PLAN, schedule=schedule, vpp=2 if schedule == "zbv_auto" else 1)
    cluster = _cluster(8.0)
    pipelines = Pipelines(keep_simulations=False)
    found = prepare_plan(MODEL, cluster, plan, pipelines=pipelines)
    assert pipelines.layout(pipelines.key(plan)).placement == found[0].placement
    ordered = prepare(MODEL, cluster, plan, pipelines=Pipelines(keep_simulations=False))
    for name in ("key", "placement", "work", "residual", "device_params"):
        assert getattr(found[0], name) == getattr(ordered, name), name
    assert all(p.lower_bound_s > 0 for p in found)


def test_a_shape_is_read_once_and_answers_each_question_as_computed_afresh() -> None:
    # One Pipelines evaluates a policy shape once for its layout, its default order and
    # the plans' limits, and its remembered peaks and bounds are what the arrays give.
    pipelines = Pipelines(keep_simulations=False)
    key = pipelines.key(PLAN)
    policy = pipelines.policy(key)
    assert pipelines.policy(key) is policy
    assert pipelines.layout(key).placement == policy.placement
    assert policy == library.load("zb_auto", pp=4, microbatches=16)
    arrays = lower(pipelines.schedule(key)).arrays.actions
    residual, weight_residual = (5, 7, 7, 11), (6, 3, 3, 4)
    seconds = np.array([[1.0, 1.5, 1.5, 2.0], [2.0, 3.0, 3.0, 4.0], [1.0, 1.5, 1.5, 2.0], [1.0, 1.5, 1.5, 2.0]])
    for _ in range(2):
        assert pipelines.peak_residual_bytes(key, residual, weight_residual) == tuple(
            int(p) for p in peak_held(arrays, residual, weight_residual)
        )
        assert pipelines.lower_bound_s(key, seconds) == chain_lower_bound(arrays, seconds)
    assert pipelines.lower_bound_s(key, 2 * seconds) == chain_lower_bound(arrays, 2 * seconds)


def test_a_limited_plan_on_devices_that_share_cores_shares_them_among_its_busy_devices() -> None:
    # As every pipeline does (estimate's module docstring): one core for a node of eight,
    # the plan's four devices priced at an eighth of a core each. Busy together they get
    # a quarter each (twice as fast), one alone the whole core; the cores do the same
    # work, so the pipeline part is no less than the devices' mean busy time at twice the
    # rate, and the lower bound holds.
    alone = _cluster(6.0)
    shared = dataclasses.replace(alone, host_cores=1.0)
    pipelines = Pipelines(keep_simulations=False)
    for apart, together in zip(
        prepare_plan(MODEL, alone, PLAN, pipelines=pipelines), prepare_plan(MODEL, shared, PLAN, pipelines=pipelines)
    ):
        assert isinstance(apart, LimitedPlan) and isinstance(together, LimitedPlan)
        a, t = apart.finish(), together.finish()
        assert a.bubble > 0
        assert a.pipeline_time_s * (1 - a.bubble) / 2 * (1 - 1e-9) <= t.pipeline_time_s < a.pipeline_time_s / 2
        assert together.lower_bound_s <= t.step_time_s
