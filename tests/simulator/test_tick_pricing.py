"""A step run as one program over the pipeline devices, priced tick by tick (pipedsl.simulator.ticked)."""

from __future__ import annotations

import pytest

import pipedsl
from pipedsl.simulator import tick_timing
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
