"""What a user's mistakes in a schedule file are told: every violation of a rule family
(up to a limit), the keyword a near twin was meant to be, a folder or a pipe named for
what it is, and a conversion that would write over its own source refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import pipedsl
from pipedsl.cli import main
from pipedsl.errors import MAX_REPORTED, PipedslError, ScheduleInvalid, ScheduleSyntaxError

DRAIN_SHORT = """\
schedule short(pp = 2, microbatches = 2) {
  stages pp
  devices pp
  place s -> s
  on device d {
    for i in 0 .. microbatches { F(i) }
    for i in 0 .. microbatches - 1 { B(i) }
  }
}
"""


def test_validation_reports_every_missing_backward() -> None:
    with pytest.raises(ScheduleInvalid) as caught:
        pipedsl.validate(pipedsl.parse(DRAIN_SHORT, file="s.sched"))
    errors = caught.value.errors
    assert [(e.rule, e.message) for e in errors] == [
        ("missing-action", "stage 0, microbatch 1 has no backward (0B1, or 0I1 and 0W1)"),
        ("missing-action", "stage 1, microbatch 1 has no backward (1B1, or 1I1 and 1W1)"),
    ]
    assert str(caught.value).endswith("2 errors")


def test_validation_reports_at_most_the_limit_and_counts_the_rest() -> None:
    with pytest.raises(ScheduleInvalid) as caught:
        pipedsl.validate(pipedsl.parse(DRAIN_SHORT, file="s.sched", pp=30, microbatches=30))
    assert len(caught.value.errors) == MAX_REPORTED
    assert caught.value.omitted == 30 - MAX_REPORTED
    assert f"{30} errors" in str(caught.value)


def test_every_action_on_the_wrong_device_is_reported() -> None:
    text = "schedule t { stages 2 devices 2 place s -> s device 0: 1F0 0F0 0B0 device 1: 0F0 1F0 1B0 0B0 1B0 }"
    with pytest.raises(ScheduleInvalid) as caught:
        pipedsl.validate(pipedsl.parse(text))
    rules = [e.rule for e in caught.value.errors]
    assert rules.count("wrong-device") == 3 and "duplicate-action" in rules


@pytest.mark.parametrize(
    ("line", "word", "meant"),
    [("  device 2", "device", "devices"), ("  stage pp", "stage", "stages")],
)
def test_a_misspelt_keyword_is_suggested_where_it_is(line: str, word: str, meant: str) -> None:
    text = f"schedule t(pp = 2) {{\n{line}\n  place s -> s\n  on device d {{ F(0) B(0) }}\n}}\n"
    with pytest.raises(ScheduleSyntaxError) as caught:
        pipedsl.parse(text, file="t.sched")
    first = caught.value
    assert f"`{word}`; did you mean `{meant}`?" in first.message
    assert first.pos is not None and (first.pos.line, first.pos.column) == (2, 3)


def test_a_keyword_before_an_assignment_is_not_blamed() -> None:
    with pytest.raises(ScheduleSyntaxError, match="unexpected `=`; expected a number"):
        pipedsl.parse("schedule t { device = 0 }")


def test_a_folder_or_a_pipe_is_named_for_what_it_is(tmp_path: Path) -> None:
    folder = tmp_path / "folder.sched"
    folder.mkdir()
    with pytest.raises(PipedslError, match="is a directory, not a schedule file"):
        pipedsl.load(folder)
    # Whatever its name: a folder without a schedule's extension is a folder too.
    (tmp_path / "plain").mkdir()
    with pytest.raises(PipedslError, match="is a directory, not a schedule file"):
        pipedsl.load(tmp_path / "plain")
    pipe = tmp_path / "pipe.sched"
    os.mkfifo(pipe)
    # Refused without opening it: opening a FIFO with no writer would block.
    with pytest.raises(PipedslError, match="not a regular file"):
        pipedsl.load(pipe)
    with pytest.raises(PipedslError, match="no such file"):
        pipedsl.load(tmp_path / "missing.sched")


def test_convert_does_not_write_over_its_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "mine.sched"
    text = pipedsl.library_path("1f1b").read_text()
    source.write_text(text)
    assert main(["convert", str(source), "--to", "sched", "-o", str(tmp_path / "." / "mine.sched")]) == 2
    assert "which this command reads" in capsys.readouterr().err
    assert source.read_text() == text
    assert main(["convert", str(source), "--to", "sched", "-o", str(source), "--force"]) == 0
    assert source.read_text() != text and "device 0:" in source.read_text()


def test_check_says_an_activation_byte_limit_is_not_tested_at_zero_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "p.sched"
    policy.write_text(
        "schedule p(pp = 2, microbatches = 4) {\n  stages pp\n  devices pp\n  place s -> s\n"
        "  policy on device d {\n    split backward; limit activations <= 1; prefer I > F > W\n  }\n}\n"
    )
    assert main(["check", str(policy)]) == 0
    err = capsys.readouterr().err
    assert "activation-byte limit is not tested here" in err
    limited = tmp_path / "q.sched"
    limited.write_text(policy.read_text().replace("limit activations <= 1", "limit inflight <= 2"))
    assert main(["check", str(limited)]) == 0
    assert "not tested" not in capsys.readouterr().err


def test_semantic_errors_are_reported_after_a_recoverable_syntax_error() -> None:
    text = """\
schedule t(pp = 2, microbatches = 2) {
  stages pp
  devices pp
  place s -> s
  on device d {
    x = (d + 1
    for i in 0 .. microbatches { F(i) B(i) }
    y = unknown_name + 1
  }
}
"""
    with pytest.raises(ScheduleSyntaxError) as caught:
        pipedsl.parse(text, file="t.sched")
    found = [(type(e).__name__, e.pos.line if e.pos else None, e.message) for e in caught.value.errors]
    assert found == [
        ("ScheduleSyntaxError", 7, "unexpected `for`; expected `)`"),
        ("ScheduleEvalError", 8, "unknown name `unknown_name`"),
    ]
