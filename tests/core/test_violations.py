"""Validation lists every violation, as the language's errors do: each family of rules
reports all it finds (up to MAX_REPORTED, then a count), actions out of place together
with missing ones, misorders together with deadlocks, every deadlock down the orders; and
a text repaired after its syntax errors is still validated."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import one_f_one_b
from pipedsl.cli import main
from pipedsl.errors import MAX_REPORTED, ScheduleInvalid, ScheduleSyntaxError, SourcePos
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.library import parse
from pipedsl.validate import validate


def _violations(schedule: Schedule) -> ScheduleInvalid:
    with pytest.raises(ScheduleInvalid) as info:
        validate(schedule)
    return info.value


def _rules(err: ScheduleInvalid) -> list[tuple[str | None, str | None]]:
    return [(e.rule, e.action) for e in err.errors if isinstance(e, ScheduleInvalid)]


def _two_devices(first: list[tuple[Kind, int]], second: list[tuple[Kind, int]], microbatches: int) -> Schedule:
    orders = tuple(tuple(Action(k, d, m) for k, m in order) for d, order in enumerate((first, second)))
    return Schedule("t", 2, 2, microbatches, (0, 1), orders)


F, B = Kind.F, Kind.B


def test_every_misorder_is_listed() -> None:
    # Device 1 of 1F1B(2, 4) with every B before its F: four misorders, not the first alone.
    base = one_f_one_b(2, 4)
    last = tuple(Action(B if a.kind is F else F, a.stage, a.microbatch) for a in base.orders[1])
    err = _violations(Schedule(base.name, 2, 2, 4, base.placement, (base.orders[0], last)))
    assert _rules(err) == [("dependency-order", f"1B{m}") for m in range(4)]
    assert "action 1B2 on device 1 comes before 1F2, which it needs" in str(err)
    assert str(err).endswith("4 errors")


def test_a_deadlock_further_down_the_orders_is_found_too() -> None:
    # Device 0 runs B(m) before F(m + 1), device 1 F(m + 1) before B(m): the pair waits
    # on each other at microbatch 0, and again at microbatch 2 once past the first wait.
    first = [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2), (F, 3), (B, 3)]
    second = [(F, 0), (F, 1), (B, 0), (B, 1), (F, 2), (F, 3), (B, 2), (B, 3)]
    err = _violations(_two_devices(first, second, 4))
    assert _rules(err) == [("deadlock", "0B0"), ("deadlock", "0B2")]
    assert "device 0 waits at 0B2 for 1B2 on device 1; device 1 waits at 1F3 for 0F3 on device 0" in str(err)


def test_a_misorder_behind_a_deadlock_is_listed_with_it() -> None:
    # The devices block on each other before device 1 reaches its B2 ahead of F2.
    first = [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]
    second = [(F, 0), (F, 1), (B, 0), (B, 1), (B, 2), (F, 2)]
    err = _violations(_two_devices(first, second, 3))
    assert _rules(err) == [("deadlock", "0B0"), ("dependency-order", "1B2")]


def test_misplaced_and_missing_actions_are_listed_together() -> None:
    base = one_f_one_b(3, 4)
    here = SourcePos("t.sched", 9, 9)
    orders = [list(o) for o in base.orders]
    orders[0].append(Action(F, 7, 0, here))  # a stage out of range
    orders[1].remove(Action(F, 1, 2))  # 1B2 without its forward
    orders[2].insert(0, Action(F, 0, 3, here))  # stage 0 is device 0's
    broken = Schedule(base.name, 3, 3, 4, base.placement, tuple(map(tuple, orders)))
    err = _violations(broken)
    assert _rules(err) == [("stage-range", "7F0"), ("wrong-device", "0F3"), ("missing-action", "1B2")]


def test_the_list_stops_at_the_limit_and_counts_the_rest() -> None:
    count = MAX_REPORTED + 7
    order = tuple(Action(B, 0, m) for m in range(count)) + tuple(Action(F, 0, m) for m in range(count))
    err = _violations(Schedule("t", 1, 1, count, (0,), (order,)))
    assert len(err.errors) == MAX_REPORTED and err.omitted == 7
    assert str(err).endswith(f"... and 7 more\n{count} errors")


BOTH = """\
schedule both(pp = 2, microbatches = 2) {
  require pp >= 1 "pp must be positive"
  stages pp
  devices pp
  place s -> s
  on device d {
    for i in 0 .. microbatches { B(i) F(i) }
  }
}
"""


def test_a_repaired_text_is_still_validated() -> None:
    # Line 2 lacks its comma; the repaired schedule still runs each B before its F.
    with pytest.raises(ScheduleSyntaxError) as info:
        parse(BOTH, file="both.sched")
    err = info.value
    assert [(e.pos.line, type(e).__name__) for e in err.errors if e.pos] == [
        (2, "ScheduleSyntaxError"),
        *[(7, "ScheduleInvalid")] * 4,
    ]
    assert {e.action for e in err.errors if isinstance(e, ScheduleInvalid)} == {"0B0", "0B1", "1B0", "1B1"}


def test_check_prints_each_violation_at_its_line_with_a_caret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "both.sched"
    path.write_text(BOTH)
    assert main(["check", str(path)]) == 2  # the syntax error's code
    err = capsys.readouterr().err.splitlines()
    heads = [line for line in err if line.startswith(f"{path}:")]
    assert heads[0].startswith(f"{path}:2:19: unexpected message")
    assert all(h.startswith(f"{path}:7:34: [dependency-order]") for h in heads[1:])
    assert len(heads) == 5 and err[-1] == "5 errors"
    body = err.index(heads[1])
    assert err[body + 1] == "        for i in 0 .. microbatches { B(i) F(i) }"
    assert err[body + 2].index("^") == err[body + 1].index("B(i)")
