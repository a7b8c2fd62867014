"""The core's synthesiser over its own cost description: a policy becomes a valid Schedule
without the simulator, under the uniform default costs or under per-stage StageCosts."""

from __future__ import annotations

import dataclasses

import pytest

import pipedsl
from pipedsl.errors import PipedslError
from pipedsl.ir import Kind
from pipedsl.policy import Policy
from pipedsl.stage_costs import StageCosts
from pipedsl.validate import peak_inflight, validate


def _policy(**params: int) -> Policy:
    policy = pipedsl.load("zb_auto", **params)
    assert isinstance(policy, Policy)
    return policy


def test_a_policy_synthesises_in_the_core_under_the_uniform_costs() -> None:
    policy = _policy(pp=4, microbatches=8, max_inflight=4)
    schedule = pipedsl.synthesize(policy)
    validate(schedule)
    assert (schedule.name, schedule.num_stages, schedule.num_microbatches) == ("zb_auto", 4, 8)
    assert max(peak_inflight(schedule)) <= 4
    assert any(a.kind is Kind.W for _, a in schedule.actions())
    assert pipedsl.synthesize(policy, StageCosts.uniform(policy)) == schedule


def test_stage_costs_steer_the_order_and_must_fit_the_policy() -> None:
    policy = _policy(pp=2, microbatches=4, max_inflight=2)
    uniform = StageCosts.uniform(policy)
    # A dear W on the first stage: the synthesiser times another order than under uniform costs.
    dear = dataclasses.replace(uniform, weight_grad=(6.0, 1.0), backward=(7.0, 2.0))
    assert pipedsl.synthesize(policy, dear).orders != pipedsl.synthesize(policy).orders
    with pytest.raises(PipedslError, match="stage costs are for 3 stages but the schedule has 2"):
        pipedsl.synthesize(policy, StageCosts.uniform(_policy(pp=3, microbatches=4)))
