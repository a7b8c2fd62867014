"""Loops of actions run as whole columns (pipedsl.lang.vector) give what the closures give.

Each body runs twice: in one long loop (the column path) and, as the oracle, in short
loops of 8 iterations with the loop variable rebuilt by an assignment (a body with an
assignment, and any loop under 16 iterations, always runs on the closures). Errors must
come out the same, message and position, whichever path met them.
"""

from __future__ import annotations

import pytest

from pipedsl.errors import ScheduleEvalError
from pipedsl.lang.vector import MIN_ITERATIONS
from pipedsl.library import parse

TOP = "def f(x) = (x * 3 + 1) % 7\n  def g(x, y) = min(x, y) - max(y, 2 * x)"


def _schedule(loop: str, *, stages: str = "pp", place: str = "s -> s") -> str:
    return (
        "schedule t(pp = 2, microbatches = 4, lo = 0, hi = 40) {\n"
        f"  {TOP}\n"
        f"  stages {stages}\n"
        "  devices pp\n"
        "  microbatches microbatches\n"
        f"  place {place}\n"
        "  on device d {\n"
        f"    {loop}\n"
        "  }\n"
        "}\n"
    )


def _both(body: str, **kw: str) -> tuple[str, str]:
    """(one long loop, the same iterations in loops of 8) around ``body`` (reads ``i``)."""
    assert 8 < MIN_ITERATIONS
    whole = _schedule(f"for i in lo .. hi {{ {body} }}", **kw)
    pieces = _schedule(
        f"for c in 0 .. (hi - lo + 7) / 8 {{ for j in 0 .. min(8, hi - lo - 8 * c) {{ i = lo + 8 * c + j  {body} }} }}",
        **kw,
    )
    return whole, pieces


def _orders(text: str, **params: int) -> list[list[tuple[str, object]]]:
    schedule = parse(text, **params)
    return [[(str(a), a.pos) for a in order] for order in schedule.orders]


def _error(text: str, **params: int) -> tuple[str, object]:
    with pytest.raises(ScheduleEvalError) as info:
        parse(text, **params)
    return info.value.message, info.value.pos


BODIES = [
    "F(i % 4)",
    "F(f(i) % 4, d)  B(g(i, d) % 4)",
    "if i % 3 == 0 { F(1) } else if i % 3 == 1 and d == 0 { B(2) } else { W(i / 5 % 4) }",
    "if not (i > 20 or i < 5) { I(f(-i) % 4) }  F(max(i % 4, d, 1))",
    "if i * i > 100 { F(i % 4) }",
]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("span", [(0, 40), (-37, 3), (5, 21)])
def test_long_loops_emit_what_short_loops_emit(body: str, span: tuple[int, int]) -> None:
    whole, pieces = _both(body)
    lo, hi = span
    # Positions differ between the two texts; kinds, stages and microbatches must not.
    strip = [[a for a, _ in o] for o in _orders(whole, lo=lo, hi=hi)]
    assert strip == [[a for a, _ in o] for o in _orders(pieces, lo=lo, hi=hi)]
    assert sum(map(len, strip)) > MIN_ITERATIONS


def test_actions_keep_the_position_of_their_call() -> None:
    text = _schedule("for i in 0 .. 32 { F(i % 4)\n      B(i % 4) }")
    for order in parse(text).orders:
        assert {a.pos.line for a in order if a.kind.value == "F"} == {9}
        assert {a.pos.line for a in order if a.kind.value == "B"} == {10}


def test_a_division_by_zero_that_never_runs_is_no_error() -> None:
    whole, pieces = _both("if i != 20 { F(100 / (i - 20) % 4) }")
    assert [[a for a, _ in o] for o in _orders(whole)] == [[a for a, _ in o] for o in _orders(pieces)]


@pytest.mark.parametrize(
    "body",
    ["F(100 / (i - 20))", "F(i % (i - 33))", "F(i * 1000000000 * 1000000000)", "F(f(i) * 4611686018427387904)"],
)
def test_errors_are_the_closures_errors(body: str) -> None:
    whole, pieces = _both(body)
    message, pos = _error(whole)
    assert message == _error(pieces)[0]
    assert "evaluating d = 0" in message
    assert pos is not None and pos.line == 9


def test_the_action_budget_stops_at_the_same_action() -> None:
    whole, pieces = _both("F(i % 4)  B(i % 4)")
    with pytest.raises(ScheduleEvalError) as long:
        parse(whole, max_actions=50)
    with pytest.raises(ScheduleEvalError) as short:
        parse(pieces, max_actions=50)
    assert "max_actions=50" in long.value.message
    assert long.value.message == short.value.message


def test_a_missing_stage_on_a_device_of_two_is_the_closures_error() -> None:
    text = _schedule("for i in 0 .. 32 { F(i % 4) }", stages="2 * pp", place="s -> s % pp")
    message, _ = _error(text)
    assert "leaves out the stage, but device 0 holds stages 0, 2" in message
