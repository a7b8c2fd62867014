"""The library's policy schedules: each synthesises into a valid order over the grid of
sizes, keeps its limit, and shows the bubble its header claims."""

from __future__ import annotations

import pytest

from pipedsl.errors import ScheduleInvalid
from pipedsl.interop import from_csv, from_json, to_csv, to_json, to_sched_text
from pipedsl.library import library_path, load, parse
from pipedsl.policy import UNSATISFIABLE, Policy
from pipedsl.simulator import CostModel, simulate
from pipedsl.synthesize import synthesize
from pipedsl.validate import validate

UNIFORM = CostModel(forward=1, input_grad=1, weight_grad=1)


def policy(name: str, **params: int) -> Policy:
    loaded = load(library_path(name), **params)
    assert isinstance(loaded, Policy)
    return loaded


# name -> (stages for pp, default in-flight limit for pp, smallest microbatches for pp)
POLICIES = {
    "zb_auto": (lambda pp: pp, lambda pp: pp, lambda pp: 1),
    "zb_h2": (lambda pp: pp, lambda pp: 2 * pp - 1, lambda pp: pp),
    "zbv_auto": (lambda pp: 2 * pp, lambda pp: 2 * pp, lambda pp: 1),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("pp", range(2, 9))
def test_every_policy_synthesises_a_valid_order_over_the_grid(name: str, pp: int) -> None:
    stages, limit, smallest = POLICIES[name]
    for m in sorted({smallest(pp), pp, 2 * pp, 4 * pp}):
        if m < smallest(pp):
            continue
        loaded = policy(name, pp=pp, microbatches=m)
        schedule = synthesize(loaded, UNIFORM)
        assert (schedule.num_stages, schedule.num_devices, schedule.num_microbatches) == (stages(pp), pp, m)
        assert schedule.source == str(library_path(name))
        report = validate(schedule, max_inflight=limit(pp))
        assert report.num_actions == 3 * stages(pp) * m


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zb_auto_at_1f1b_memory_has_zb_h1s_bubble_and_at_2pp_minus_1_none(pp: int) -> None:
    m = 3 * pp
    ours = simulate(synthesize(policy("zb_auto", pp=pp, microbatches=m), UNIFORM), UNIFORM)
    assert ours.makespan == pytest.approx(simulate(load("zb_h1", pp=pp, microbatches=m), UNIFORM).makespan)
    costs = CostModel(forward=1, input_grad=2, weight_grad=1)
    wide = synthesize(policy("zb_auto", pp=pp, microbatches=m, max_inflight=2 * pp - 1), costs)
    assert simulate(wide, costs).makespan == pytest.approx((pp - 1) + 4 * m)


@pytest.mark.parametrize(("f", "i", "w"), [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5)])
def test_zb_h2_idles_only_for_the_staggered_start(f: float, i: float, w: float) -> None:
    costs = CostModel(forward=f, input_grad=i, weight_grad=w)
    for pp in (2, 4, 6):
        m = 2 * pp
        schedule = synthesize(policy("zb_h2", pp=pp, microbatches=m), costs)
        assert simulate(schedule, costs).makespan == pytest.approx((pp - 1) * f + m * (f + i + w))


def test_zbv_auto_beats_zbv_when_w_is_the_heaviest_half() -> None:
    costs = CostModel(forward=1, input_grad=1, weight_grad=2)
    ours = simulate(synthesize(policy("zbv_auto", pp=8, microbatches=32), costs), costs)
    theirs = simulate(load("zbv", pp=8, microbatches=32), costs)
    assert ours.makespan < theirs.makespan
    assert max(d.peak_inflight for d in ours.devices) <= max(d.peak_inflight for d in theirs.devices)


def test_a_limit_below_one_is_reported_at_its_line() -> None:
    bad = policy("zb_auto", max_inflight=0)
    with pytest.raises(ScheduleInvalid, match="at most 0 microbatches in flight") as info:
        bad.check()
    assert info.value.rule == UNSATISFIABLE
    assert info.value.pos is not None and "limit inflight <= max_inflight" in info.value.pos.line_text
    with pytest.raises(ScheduleInvalid, match="owns 2 stages"):
        synthesize(policy("zbv_auto", max_inflight=1))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_synthesised_orders_round_trip_through_csv_json_and_sched(name: str) -> None:
    schedule = synthesize(
        policy(name, pp=3, microbatches=6), CostModel(forward=1, input_grad=2, weight_grad=1, latency=0.1)
    )
    for back in (from_csv(to_csv(schedule)), from_json(to_json(schedule)), parse(to_sched_text(schedule))):
        assert isinstance(back, type(schedule))
        assert (back.orders, back.placement, back.num_microbatches) == (schedule.orders, schedule.placement, 6)


# (pp, microbatches): pp 4 and 8, 8 to 32 microbatches (zbv needs at least 2pp - 1).
NEVER_SLOWER_SHAPES = [(4, 8), (4, 32), (8, 16), (8, 24)]


@pytest.mark.parametrize(("pp", "m"), NEVER_SLOWER_SHAPES)
def test_zbv_auto_is_never_slower_than_zbv(pp: int, m: int) -> None:
    # W from half of F to twice it, link latency from none to a fifth of F, with and
    # without a dispatch per task: the synthesised V order never loses to the written one.
    for w in (0.5, 2.0):
        for latency in (0.0, 0.05, 0.2):
            for dispatch in (0.0, 0.1):
                costs = CostModel(forward=1, input_grad=1, weight_grad=w, latency=latency, dispatch=dispatch)
                ours = simulate(synthesize(policy("zbv_auto", pp=pp, microbatches=m), costs), costs).makespan
                written = simulate(load("zbv", pp=pp, microbatches=m), costs).makespan
                assert ours <= written * (1 + 1e-12), (w, latency, dispatch, ours, written)


@pytest.mark.parametrize("limit", ["pp", "2pp-1"])
def test_zb_auto_is_never_slower_than_a_flat_library_order_within_its_limit(limit: str) -> None:
    # Every explicit library order with zb_auto's placement that keeps its in-flight limit
    # (1F1B, eager 1F1B, ZB-H1 at pp; GPipe too when microbatches fit) is a floor.
    pp, m = 4, 8
    max_inflight = pp if limit == "pp" else 2 * pp - 1
    loaded = policy("zb_auto", pp=pp, microbatches=m, max_inflight=max_inflight)
    for w in (0.5, 2.0):
        for latency in (0.0, 0.2):
            costs = CostModel(forward=1, input_grad=1, weight_grad=w, latency=latency, dispatch=0.05)
            ours = simulate(synthesize(loaded, costs), costs).makespan
            compared = 0
            for name in ("1f1b", "eager_1f1b", "gpipe", "zb_h1"):
                written = load(name, pp=pp, microbatches=m)
                assert not isinstance(written, Policy)
                if max(validate(written).peak_inflight) > max_inflight:
                    continue
                compared += 1
                assert ours <= simulate(written, costs).makespan * (1 + 1e-12), (name, w, latency)
            assert compared >= 2


def test_a_library_order_is_kept_only_where_it_is_strictly_faster() -> None:
    # The case: zbv_auto's own variants lose to the written zbv here, so the order
    # kept is zbv's; without the library, a slower order of the variants.
    costs = CostModel(forward=1, input_grad=1, weight_grad=0.5)
    loaded = policy("zbv_auto", pp=8, microbatches=24)
    written = load("zbv", pp=8, microbatches=24)
    assert synthesize(loaded, costs).orders == written.orders
    assert simulate(synthesize(loaded, costs, library=False), costs).makespan > simulate(written, costs).makespan
