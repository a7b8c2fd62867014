"""The policy form of the language: text to a Policy, its errors at their positions, and the
commands that load one (check, show, convert, simulate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipedsl.cli import main
from pipedsl.errors import ScheduleEvalError, ScheduleInvalid, ScheduleSyntaxError
from pipedsl.ir import Kind, Schedule
from pipedsl.library import load, parse
from pipedsl.policy import UNSATISFIABLE, Policy

Capture = pytest.CaptureFixture[str]

HEAD = """\
schedule auto(pp = 4, microbatches = 8) {
  stages pp
  devices pp
  place s -> s
"""


def policy_text(body: str) -> str:
    return HEAD + "  policy on device d {\n" + body + "\n  }\n}\n"


def parsed(body: str, **params: int) -> Policy:
    loaded = parse(policy_text(body), **params)
    assert isinstance(loaded, Policy)
    return loaded


def test_every_statement_becomes_a_field() -> None:
    p = parsed(
        "split backward; limit inflight <= pp - d; limit activations <= 1000 * (d + 1);"
        " prefer I > F > W; W only in idle time; warmup 2 * (pp - d) - 1;"
    )
    assert (p.num_stages, p.num_devices, p.num_microbatches, p.placement) == (4, 4, 8, (0, 1, 2, 3))
    assert p.split_backward and p.idle_w
    assert p.max_inflight == (4, 3, 2, 1)
    assert p.max_activation_bytes == (1000, 2000, 3000, 4000)
    assert p.priority == (Kind.I, Kind.F, Kind.W)
    assert p.warmup == (7, 5, 3, 1)
    assert p.params == (("pp", 4), ("microbatches", 8))
    assert p.position("inflight") is not None and p.position("inflight").line == 6  # type: ignore[union-attr]
    p.check()


def test_defaults_and_parameters() -> None:
    p = parsed("", pp=2, microbatches=3)
    assert (p.split_backward, p.max_inflight, p.priority, p.warmup) == (False, None, (Kind.B, Kind.F), None)
    assert parsed("split backward").priority == (Kind.I, Kind.F, Kind.W)
    assert parsed("prefer F > B").priority == (Kind.F, Kind.B)
    assert "in flight <= [4, 3, 2, 1]" in parsed("split backward; limit inflight <= pp - d").describe()


@pytest.mark.parametrize(
    ("body", "error", "message", "line"),
    [
        ("split backward; split backward", ScheduleEvalError, "stated twice", 6),
        ("split backward; prefer I > F", ScheduleEvalError, "must name each of F, I, W once", 6),
        ("prefer I > F > W", ScheduleEvalError, "full backward", 6),
        ("prefer X > F", ScheduleSyntaxError, "`X` is not an action kind", 6),
        ("W only in idle time", ScheduleEvalError, "needs `split backward`", 6),
        ("split backward; I only in idle time", ScheduleEvalError, "only W can be kept", 6),
        ("limit inflight <= nope", ScheduleEvalError, "unknown name `nope`", 6),
        ("limit memory <= 3", ScheduleSyntaxError, "`inflight` or `activations`", 6),
        (
            "limit inflight <= 3 warmup 2",
            ScheduleSyntaxError,
            "unexpected name `warmup`; expected one of `;` or `}`",
            6,
        ),
        ("limit inflight <= pp / (d - 1)", ScheduleEvalError, "division by zero", 6),
    ],
)
def test_mistakes_are_reported_where_they_are(body: str, error: type, message: str, line: int) -> None:
    with pytest.raises(error) as info:
        parse(policy_text(body))
    assert message in info.value.message
    assert info.value.pos is not None and info.value.pos.line == line


def test_a_policy_and_orders_do_not_mix() -> None:
    with pytest.raises(ScheduleEvalError, match="not both"):
        parse(policy_text("split backward").replace("  policy", "  device 0: 0F0\n  policy"))
    text = policy_text("split backward").replace("  }\n}", "  }\n  on device d { F(0) }\n}")
    with pytest.raises(ScheduleEvalError, match="not both"):
        parse(text)
    with pytest.raises(ScheduleEvalError, match="declare `place` before"):
        parse("schedule a(microbatches = 2) { stages 1 devices 1 policy on device d { } }")


def test_words_of_the_policy_form_stay_free_as_names_elsewhere() -> None:
    text = (
        HEAD
        + "  on device d {\n    warmup = pp - d\n    split = 0\n    for i in 0 .. microbatches { F(i) B(i) }\n  }\n}\n"
    )
    assert isinstance(parse(text), Schedule)


def test_unsatisfiable_limits_carry_the_limits_position() -> None:
    p = parsed("split backward; limit inflight <= d - 1")
    with pytest.raises(ScheduleInvalid, match="device 0 may hold at most -1") as info:
        p.check()
    assert info.value.rule == UNSATISFIABLE
    assert info.value.pos == p.position("inflight")
    with pytest.raises(ScheduleInvalid, match="needs 1"):
        parsed("split backward; warmup d").check()


def test_the_library_loads_policies() -> None:
    loaded = load("zb_auto", pp=3, microbatches=5, max_inflight=4)
    assert isinstance(loaded, Policy)
    assert (loaded.max_inflight, loaded.label) == ((4, 4, 4), "zb_auto(pp=3, microbatches=5, max_inflight=4)")
    assert loaded.source is not None and loaded.source.endswith("zb_auto.sched")


def run(capsys: Capture, *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_show_and_convert_synthesise_against_the_default_costs(capsys: Capture, tmp_path: Path) -> None:
    code, out, err = run(capsys, "check", "zb_auto", "-p", "pp=2", "-p", "microbatches=4")
    assert (code, err) == (0, "")
    assert "peak in-flight per device 2 2" in out and "default cost model (F=1 B=2F" in out
    code, out, err = run(capsys, "show", "zb_auto", "-p", "pp=2", "-p", "microbatches=2")
    assert code == 0 and "note:" in err
    assert (
        out.splitlines()[0]
        == "zb_auto(pp=2, microbatches=2, max_inflight=2): policy: split backward; in flight <= 2; prefer I > F > W"
    )
    assert "device 1: 1F0 1I0 1F1 1I1 1W0 1W1" in out
    target = tmp_path / "zb.sched"
    code, _, _ = run(capsys, "convert", "zb_auto", "-p", "pp=2", "-p", "microbatches=2", "--to", "sched", "-o", target)
    assert code == 0
    table = load(target)
    assert isinstance(table, Schedule) and table.format_grid() == out.split("\n", 2)[2].strip()


def test_check_reports_an_unsatisfiable_limit_at_its_line(capsys: Capture) -> None:
    code, out, err = run(capsys, "check", "zb_auto", "-p", "max_inflight=0")
    assert code == 1 and out == ""
    assert "zb_auto.sched:23:5: [unsatisfiable-policy] device 0 may hold at most 0" in err
    assert "limit inflight <= max_inflight" in err


def test_simulate_synthesises_against_its_cost_options(capsys: Capture) -> None:
    argv = ["simulate", "schedules/zb_auto.sched", "-p", "pp=8", "-p", "microbatches=24", "-p", "max_inflight=16"]
    code, out, err = run(capsys, *argv, "--f", "1", "--i", "1", "--w", "1", "--comm", "0.1", "--json")
    assert (code, err) == (0, "")
    result = json.loads(out)
    assert result["peak_inflight"] <= 16
    # 15 microbatches ahead hide the 0.1 s hops: only the staggered start, 7 × 1.1 s, is idle.
    assert result["makespan"] == pytest.approx(7 * 1.1 + 24 * 3)
