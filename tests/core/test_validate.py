"""Validation: each rule on a table of hand-made faults, then properties over random schedules.

Random valid schedules come from a random topological order of every action projected
onto the devices, so they are valid by construction; each corruption then breaks exactly
one rule, and the validator must name that rule.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import (
    Shape,
    all_actions,
    gpipe,
    needs,
    one_f_one_b,
    one_f_one_b_split,
    random_schedule,
    shapes,
    valid_schedules,
)
from pipedsl.errors import PipedslError, ScheduleInvalid, SourcePos
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.library import load
from pipedsl.program import lower
from pipedsl.synthesize import synthesize
from pipedsl.validate import peak_inflight, validate

# --- helpers -------------------------------------------------------------------------


def with_positions(schedule: Schedule) -> Schedule:
    """Give every action a distinct position: line = device + 1, column = index + 1."""
    orders = tuple(
        tuple(replace(a, pos=SourcePos("t.sched", d + 1, i + 1)) for i, a in enumerate(order))
        for d, order in enumerate(schedule.orders)
    )
    return replace(schedule, orders=orders)


def edit(schedule: Schedule, device: int, fn: Callable[[list[Action]], None]) -> Schedule:
    """A copy of ``schedule`` with device ``device``'s order changed in place by ``fn``."""
    orders = [list(o) for o in schedule.orders]
    fn(orders[device])
    return replace(schedule, orders=tuple(tuple(o) for o in orders))


def rule_of(schedule: Schedule, **kwargs: int) -> ScheduleInvalid:
    with pytest.raises(ScheduleInvalid) as info:
        validate(schedule, **kwargs)
    return info.value


# --- one table row per rule ------------------------------------------------------------

BASE = with_positions(one_f_one_b(3, 4))
SPLIT = with_positions(one_f_one_b_split(2, 2))


def _swap(order: list[Action], i: int, j: int) -> None:
    order[i], order[j] = order[j], order[i]


HERE = SourcePos("t.sched", 9, 9)
"""Where a planted action comes from; every other action sits at (device + 1, index + 1)."""

# (rule, the faulty schedule, the action to blame, and its line and column), or None
# for the last two where no single action is to blame.
CASES: list[tuple[str, Schedule, str | None, tuple[int, int] | None]] = [
    ("shape", replace(BASE, placement=(0, 1)), None, None),
    ("shape", replace(BASE, placement=(0, 1, 5)), None, None),
    ("shape", replace(BASE, orders=BASE.orders[:2]), None, None),
    ("shape", replace(BASE, num_microbatches=0), None, None),
    ("shape", replace(BASE, num_devices=4, placement=(0, 1, 2), orders=BASE.orders + ((),)), None, None),
    ("stage-range", edit(BASE, 0, lambda o: o.append(Action(Kind.F, 7, 0, HERE))), "7F0", (9, 9)),
    ("microbatch-range", edit(BASE, 1, lambda o: o.append(Action(Kind.B, 1, 4, HERE))), "1B4", (9, 9)),
    ("wrong-device", edit(BASE, 0, lambda o: o.insert(0, Action(Kind.F, 2, 0, HERE))), "2F0", (9, 9)),
    ("duplicate-action", edit(BASE, 2, lambda o: o.append(replace(o[0], pos=HERE))), "2F0", (9, 9)),
    ("mixed-backward", edit(BASE, 2, lambda o: o.append(Action(Kind.W, 2, 0, HERE))), "2W0", (9, 9)),
    # Device 1 of 1F1B(3, 4) runs F0 F1 B0 F2 B1 F3 B2 B3.
    ("missing-action", edit(BASE, 1, lambda o: o.remove(Action(Kind.F, 1, 2))), "1B2", (2, 7)),
    ("missing-action", edit(BASE, 1, lambda o: o.remove(Action(Kind.B, 1, 2))), "1F2", (2, 4)),
    # Device 0 of the split 1F1B(2, 2) runs F0 F1 I0 W0 I1 W1; device 1 F0 I0 W0 F1 I1 W1.
    ("missing-action", edit(SPLIT, 0, lambda o: o.remove(Action(Kind.W, 0, 1))), "0I1", (1, 5)),
    ("missing-action", edit(SPLIT, 0, lambda o: o.remove(Action(Kind.I, 0, 1))), "0W1", (1, 6)),
    ("dependency-order", edit(SPLIT, 1, lambda o: _swap(o, 1, 2)), "1W0", (2, 3)),
    # The last device runs F0 B0 F1 B1 ...: B0 moved before F0 needs F0 on its own device.
    ("dependency-order", edit(BASE, 2, lambda o: _swap(o, 0, 1)), "2B0", (3, 2)),
    # Device 0 waits at 0B0 for 1B0, device 1 waits at 1F1 for 0F1, which sits behind 0B0.
    (
        "deadlock",
        with_positions(
            replace(
                gpipe(2, 2),
                orders=tuple(
                    tuple(Action(k, d, m) for k, m in order)
                    for d, order in enumerate(
                        [
                            [(Kind.F, 0), (Kind.B, 0), (Kind.F, 1), (Kind.B, 1)],
                            [(Kind.F, 0), (Kind.F, 1), (Kind.B, 0), (Kind.B, 1)],
                        ]
                    )
                ),
            )
        ),
        "0B0",
        (1, 2),
    ),
]


@pytest.mark.parametrize(
    ("rule", "schedule", "blamed", "where"), CASES, ids=[f"{case[0]}-{i}" for i, case in enumerate(CASES)]
)
def test_each_rule_is_named_and_points_at_the_action(
    rule: str, schedule: Schedule, blamed: str | None, where: tuple[int, int] | None
) -> None:
    err = rule_of(schedule)
    assert err.rule == rule, str(err)
    assert err.action == blamed
    if where is None:
        assert err.pos is None
    else:
        assert err.pos is not None and (err.pos.line, err.pos.column) == where
        assert str(err).startswith(f"t.sched:{where[0]}:{where[1]}: [{rule}]")


def test_deadlock_message_names_the_cycle() -> None:
    err = rule_of(CASES[-1][1])
    assert "device 0 waits at 0B0 for 1B0 on device 1" in err.message
    assert "device 1 waits at 1F1 for 0F1 on device 0" in err.message


def test_max_inflight_is_checked_only_when_asked() -> None:
    schedule = gpipe(4, 6)
    assert validate(schedule).peak_inflight == (6, 6, 6, 6)
    assert validate(schedule, max_inflight=6).num_actions == 48
    err = rule_of(schedule, max_inflight=5)
    assert err.rule == "max-inflight" and "all 4 devices hold 6 microbatches in flight" in err.message


@pytest.mark.parametrize("build", [gpipe, one_f_one_b, one_f_one_b_split])
@pytest.mark.parametrize(("pp", "m"), [(1, 1), (2, 2), (4, 8), (8, 3)])
def test_builders_are_valid(build: Callable[[int, int], Schedule], pp: int, m: int) -> None:
    report = validate(build(pp, m))
    per_pair = 3 if build is one_f_one_b_split else 2
    assert report.num_actions == pp * m * per_pair


@pytest.mark.parametrize(("pp", "m"), [(1, 1), (2, 5), (4, 4), (4, 8), (6, 2)])
def test_peak_inflight_of_textbook_schedules(pp: int, m: int) -> None:
    assert validate(gpipe(pp, m)).peak_inflight == (m,) * pp
    expected_1f1b = tuple(min(pp - d, m) for d in range(pp))
    assert validate(one_f_one_b(pp, m)).peak_inflight == expected_1f1b
    # Splitting B into I then W frees the activation at W, which follows I at once.
    assert validate(one_f_one_b_split(pp, m)).peak_inflight == expected_1f1b


# --- random schedules ------------------------------------------------------------------


def _device_local_orders(
    num_devices: int,
    placement: tuple[int, ...],
    num_mb: int,
    split: set[tuple[int, int]],
    rng: random.Random,
    extra: dict[Action, tuple[Action, ...]],
) -> list[list[Action]]:
    """Per device, a random order that respects only that device's own dependencies
    (plus ``extra`` edges, consumer -> producers); cross-device waits are left to chance."""
    num_stages = len(placement)
    orders = []
    for device in range(num_devices):
        mine = [a for a in all_actions(num_stages, num_mb, split) if placement[a.stage] == device]
        local = {
            a: tuple(n for n in needs(a, num_stages, split) + extra.get(a, ()) if placement[n.stage] == device)
            for a in mine
        }
        order: list[Action] = []
        placed: set[Action] = set()
        while mine:
            action = rng.choice([a for a in mine if all(n in placed for n in local[a])])
            mine.remove(action)
            placed.add(action)
            order.append(action)
        orders.append(order)
    return orders


def _has_cycle(schedule: Schedule) -> bool:
    """Whether data dependencies plus device orders form a cycle (Kahn's algorithm)."""
    split = {(a.stage, a.microbatch) for _, a in schedule.actions() if a.kind is Kind.I}
    edges: dict[Action, list[Action]] = {a: [] for _, a in schedule.actions()}
    indegree = dict.fromkeys(edges, 0)
    for _, action in schedule.actions():
        for need in needs(action, schedule.num_stages, split):
            edges[need].append(action)
            indegree[action] += 1
    for order in schedule.orders:
        for before, after in zip(order, order[1:]):
            edges[before].append(after)
            indegree[after] += 1
    queue = [a for a, n in indegree.items() if n == 0]
    seen = 0
    while queue:
        action = queue.pop()
        seen += 1
        for nxt in edges[action]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                queue.append(nxt)
    return seen < len(edges)


FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(valid_schedules())
def test_random_valid_schedules_validate(schedule: Schedule) -> None:
    report = validate(schedule)
    assert report.num_actions == schedule.num_actions
    for device, peak in enumerate(report.peak_inflight):
        assert 1 <= peak <= schedule.num_microbatches * len(schedule.stages_on(device))


@FAST
@given(valid_schedules(), st.randoms(use_true_random=False))
def test_dropped_action_is_missing(schedule: Schedule, rng: random.Random) -> None:
    device = rng.randrange(schedule.num_devices)
    broken = edit(schedule, device, lambda o: o.pop(rng.randrange(len(o))))
    assert rule_of(broken).rule == "missing-action"


@FAST
@given(valid_schedules(), st.randoms(use_true_random=False))
def test_duplicated_action_is_a_duplicate(schedule: Schedule, rng: random.Random) -> None:
    device = rng.randrange(schedule.num_devices)
    broken = edit(schedule, device, lambda o: o.insert(rng.randrange(len(o) + 1), rng.choice(o)))
    assert rule_of(broken).rule == "duplicate-action"


@FAST
@given(valid_schedules(), st.randoms(use_true_random=False))
def test_misplaced_action_is_on_the_wrong_device(schedule: Schedule, rng: random.Random) -> None:
    if schedule.num_devices == 1:
        return
    source, target = rng.sample(range(schedule.num_devices), 2)
    action = rng.choice(schedule.orders[source])
    moved = edit(schedule, source, lambda o: o.remove(action))
    broken = edit(moved, target, lambda o: o.insert(rng.randrange(len(o) + 1), action))
    err = rule_of(broken)
    assert err.rule == "wrong-device" and err.action == str(action)


@FAST
@given(valid_schedules(), st.randoms(use_true_random=False))
def test_swap_across_a_dependency_is_a_misorder(schedule: Schedule, rng: random.Random) -> None:
    # A forward and its own backward (B or I) always share a device.
    forward = rng.choice([a for _, a in schedule.actions() if a.kind is Kind.F])
    device = schedule.placement[forward.stage]
    order = schedule.orders[device]
    backward = next(
        a
        for a in order
        if a.kind in (Kind.B, Kind.I) and (a.stage, a.microbatch) == (forward.stage, forward.microbatch)
    )
    broken = edit(schedule, device, lambda o: _swap(o, o.index(forward), o.index(backward)))
    err = rule_of(broken)
    assert err.rule == "dependency-order" and err.action == str(backward)


@st.composite
def cyclic_schedules(draw: st.DrawFn) -> Schedule:
    """Per-device orders that keep every device's own dependencies but wait on each other:
    across a boundary s | s+1, device A runs backward (m0, s) before F(m1, s) while device
    B runs F(m1, s+1) before backward (m0, s+1)."""
    num_devices, placement, num_mb, split = draw(shapes(max_devices=4))
    boundaries = [s for s in range(len(placement) - 1) if placement[s] != placement[s + 1]]
    if num_devices < 2 or num_mb < 2 or not boundaries:
        num_devices, placement, num_mb = 2, (0, 1), 2
        split, boundaries = set(), [0]
    s = draw(st.sampled_from(boundaries))
    m0, m1 = draw(st.permutations(range(num_mb)))[:2]

    def backward(stage: int, mb: int) -> Action:
        return Action(Kind.I if (stage, mb) in split else Kind.B, stage, mb)

    extra = {
        Action(Kind.F, s, m1): (backward(s, m0),),
        backward(s + 1, m0): (Action(Kind.F, s + 1, m1),),
    }
    rng = draw(st.randoms(use_true_random=False))
    orders = _device_local_orders(num_devices, placement, num_mb, split, rng, extra)
    return random_schedule(num_devices, placement, num_mb, orders)


@FAST
@given(cyclic_schedules())
def test_cross_device_cycle_is_a_deadlock(schedule: Schedule) -> None:
    assert _has_cycle(schedule)
    assert rule_of(schedule).rule == "deadlock"


@FAST
@given(shapes(), st.randoms(use_true_random=False))
def test_deadlock_exactly_when_the_wait_graph_has_a_cycle(shape: Shape, rng: random.Random) -> None:
    num_devices, placement, num_mb, split = shape
    orders = _device_local_orders(num_devices, placement, num_mb, split, rng, {})
    schedule = random_schedule(num_devices, placement, num_mb, orders)
    if _has_cycle(schedule):
        assert rule_of(schedule).rule == "deadlock"
    else:
        validate(schedule)


def test_peak_inflight_counts_until_the_weight_half() -> None:
    # One device, one stage: F0 F1 I0 I1 W0 W1 keeps both activations until the Ws.
    steps = [(Kind.F, 0), (Kind.F, 1), (Kind.I, 0), (Kind.I, 1), (Kind.W, 0), (Kind.W, 1)]
    order = tuple(Action(k, 0, m) for k, m in steps)
    schedule = Schedule("s", 1, 1, 2, (0,), (order,))
    assert peak_inflight(schedule) == (2,)
    assert validate(schedule).peak_inflight == (2,)


def _walk_every_action(schedule: Schedule) -> str | None:
    """The unit-step run over action objects, one action at a time (the rule as first
    written): the message of the order or deadlock error it finds, or None."""
    split = {(a.stage, a.microbatch) for _, a in schedule.actions() if a.kind is Kind.I}
    owner = {a: d for d, a in schedule.actions()}
    pointer = [0] * schedule.num_devices
    done: set[Action] = set()
    waiting: dict[Action, list[int]] = {}
    blocked_on: dict[int, Action] = {}
    ready = list(range(schedule.num_devices))
    while ready:
        device = ready.pop()
        order = schedule.orders[device]
        while pointer[device] < len(order):
            action = order[pointer[device]]
            missing = next((n for n in needs(action, schedule.num_stages, split) if n not in done), None)
            if missing is not None:
                if owner[missing] == device:
                    return f"action {action} on device {device} comes before {missing}, which it needs"
                waiting.setdefault(missing, []).append(device)
                blocked_on[device] = missing
                break
            done.add(action)
            pointer[device] += 1
            for other in waiting.pop(action, []):
                del blocked_on[other]
                ready.append(other)
    if not blocked_on:
        return None
    device, visited = min(blocked_on), []
    while device not in visited:
        visited.append(device)
        device = owner[blocked_on[device]]
    cycle = visited[visited.index(device) :]
    steps = [
        f"device {d} waits at {schedule.orders[d][pointer[d]]} for {blocked_on[d]} on device {owner[blocked_on[d]]}"
        for d in cycle
    ]
    return "the device orders wait on each other: " + "; ".join(steps)


@FAST
@given(shapes(), st.randoms(use_true_random=False), st.booleans())
def test_order_and_deadlock_errors_match_a_walk_over_every_action(
    shape: Shape, rng: random.Random, shuffle: bool
) -> None:
    num_devices, placement, num_mb, split = shape
    orders = _device_local_orders(num_devices, placement, num_mb, split, rng, {})
    if shuffle:
        for order in orders:
            rng.shuffle(order)
    schedule = random_schedule(num_devices, placement, num_mb, orders)
    expected = _walk_every_action(schedule)
    if expected is None:
        validate(schedule)
    else:
        assert rule_of(schedule).message == expected


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: validate(None), "validate: schedule must be a Schedule (from pipedsl.load or parse), got NoneType"),
        (lambda: validate("1f1b"), "validate: schedule is a loaded Schedule, not the name '1f1b'; load it first"),
        (lambda: lower(load("zb_auto")), "lower: schedule zb_auto is a policy, not an order; synthesise its order"),
        (lambda: lower(42), "lower: schedule must be a Schedule"),
        (lambda: synthesize(None), "synthesize: policy must be a Policy"),
        (lambda: synthesize(load("1f1b")), "synthesize: policy 1f1b is an order already"),
        (lambda: synthesize(load("zb_auto"), "uniform"), "synthesize: costs must be a cost model"),
    ],
)
def test_the_api_names_an_argument_it_cannot_take(call: Callable[[], object], words: str) -> None:
    with pytest.raises(PipedslError) as info:
        call()
    assert words in str(info.value)
