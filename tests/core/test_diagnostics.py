"""Errors like a good compiler's: every independent error of a file at once, each at its
place, with suggestions for the usual slips (a misspelt keyword, ``=`` for ``==``, a
``{`` never closed) and the values behind a failed ``require``."""

from __future__ import annotations

import pytest

from pipedsl.errors import MAX_REPORTED, PipedslError, ScheduleEvalError, ScheduleSyntaxError
from pipedsl.library import parse
from pipedsl.validate import validate


def _errors(text: str) -> PipedslError:
    with pytest.raises(PipedslError) as info:
        parse(text, file="e.sched")
    return info.value


def _where(err: PipedslError) -> list[tuple[int, int, str]]:
    return [(e.pos.line, e.pos.column, e.message) for e in err.errors if e.pos is not None]


SLIPS = """\
schedule t(pp = 2) {
  stage pp
  devices pp
  place s -> s
  on device d {
    fro i in 0 .. 2 { F(i) }
    if d = 0 { B(0) }
    F(1 ]
  }
}
"""


def test_every_syntax_error_is_reported_with_a_suggestion() -> None:
    err = _errors(SLIPS)
    assert type(err) is ScheduleSyntaxError
    assert _where(err) == [
        (2, 3, "unexpected name `stage`; did you mean `stages`?"),
        (6, 5, "unexpected name `fro`; did you mean `for`?"),
        (7, 10, "unexpected `=`; did you mean `==`? (`=` gives a name a value, `==` compares)"),
        (8, 9, "unexpected `]`; expected one of `)` or `,`"),
    ]
    text = str(err)
    assert text.startswith("e.sched:2:3: unexpected name `stage`")
    assert "\n        fro i in 0 .. 2 { F(i) }\n        ^\n" in text  # each with its line and caret
    assert text.endswith("\n4 errors")


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        pytest.param("schedule t {\n  stages 1\n  devices 1\n", 1, 12, id="end-of-file"),
        pytest.param(
            "schedule t {\n  stages 1 devices 1 place s -> 0\n  on device d {\n"
            "    for i in 0 .. 2 {\n      F(i)\n\n  }\n}\n",
            4,
            21,
            id="by-indentation",
        ),
    ],
)
def test_an_unclosed_brace_is_reported_at_the_brace(text: str, line: int, column: int) -> None:
    err = _errors(text)
    assert _where(err) == [
        (
            line,
            column,
            f"this `{{` is never closed: the file ends at line {text.rstrip().count(chr(10)) + 1}"
            " while its block is still open",
        )
    ]


def test_bad_characters_are_each_reported_once() -> None:
    # (`;` is a token now: it separates the statements of a policy block.)
    err = _errors("schedule t { x = 3 $ y = 4 @ z = 5 }")
    assert [(c, m) for _, c, m in _where(err)] == [
        (20, "unexpected character '$'"),
        (28, "unexpected character '@'"),
    ]


def test_independent_evaluation_errors_are_all_reported_and_echoes_are_not() -> None:
    text = """\
schedule t(pp = 2, m = 1) {
  require m >= pp, "need m >= pp"
  x = 1 / 0
  y = x + 1
  z = wrong + 1
  stages pp
  devices 0
  place s -> s
  on device d { F(0) }
}
"""
    err = _errors(text)
    assert isinstance(err, ScheduleEvalError)
    # `y` uses the failed `x` and `place` needs the failed `devices`: no echo of either.
    assert _where(err) == [
        (2, 3, "requirement failed: need m >= pp (m = 1, pp = 2)"),
        (3, 9, "division by zero: 1 / 0"),
        (5, 7, "unknown name `wrong`"),
        (7, 3, "devices must be at least 1, got 0"),
    ]


def test_a_failed_require_shows_the_values_it_read() -> None:
    top = _errors("schedule t(pp = 3, vpp = 2) { k = pp * vpp  require k < 4 }")
    assert top.message == "requirement failed (k = 6, pp = 3, vpp = 2)"
    body = _errors(
        'schedule t { stages 1 devices 1 place s -> 0 on device d { for i in 0 .. 3 { require i < 2, "small" F(i) } } }'
    )
    assert body.message == "requirement failed: small (i = 2) (evaluating d = 0)"


def test_the_report_is_capped() -> None:
    lines = "\n".join(f"  x{i} = {i} / 0" for i in range(MAX_REPORTED + 5))
    err = _errors(f"schedule t {{\n{lines}\n}}\n")
    assert len(err.errors) == MAX_REPORTED
    assert err.omitted == 5
    assert str(err).endswith(f"... and 5 more\n{MAX_REPORTED + 5} errors")
    many_syntax = "schedule t {\n" + "\n".join("  x = = 1" for _ in range(50)) + "\n}\n"
    err = _errors(many_syntax)
    assert isinstance(err, ScheduleSyntaxError)
    # 50 syntax errors, and the repaired text's one semantic error: no `stages`.
    assert len(err.errors) == MAX_REPORTED and err.omitted == 31
    assert str(err).endswith("51 errors")


@pytest.mark.parametrize("limit", [float("nan"), -1, 2.5, True])
def test_validate_refuses_a_limit_that_is_not_a_count(limit: object) -> None:
    schedule = parse("schedule t { stages 1 devices 1 place s -> 0 device 0: 0F0 0B0 }")
    with pytest.raises(PipedslError, match="max_inflight must be a whole number >= 0"):
        validate(schedule, max_inflight=limit)  # type: ignore[arg-type]
