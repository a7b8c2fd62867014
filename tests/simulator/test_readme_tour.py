"""The README's tour runs as written: its schedule, and each of its planning commands.

The tour's `pipedsl run` lines, and the plot of the timeline a run records, need the
executor; the executor tier runs those commands' shapes (tests/executor/test_executor_cli.py).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import pipedsl
from pipedsl.cli.main import main
from pipedsl.simulator import CostModel, simulate

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TOUR = README[README.index("## A five-minute tour") : README.index("## Commands")]
BLOCKS = re.findall(r"```(?:python)?\n(.*?)```", TOUR, flags=re.S)
SCHEDULE = next(b for b in BLOCKS if b.lstrip().startswith("#") and "schedule " in b)


def _commands() -> list[str]:
    """The tour's `pipedsl` command lines (continuations joined, comments dropped), but
    `run` and what reads a run's recorded timeline."""
    lines = []
    for block in BLOCKS:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("pipedsl ") and not line.startswith("pipedsl run ") and "measured.json" not in line:
                lines.append(line)
    return lines


def test_the_tour_has_its_steps() -> None:
    verbs = {shlex.split(c)[1] for c in _commands()}
    assert verbs == {"check", "simulate", "plot", "trace", "search", "estimate"}
    assert "pipedsl run mine.sched" in TOUR and "pipedsl.validate(sched)" in TOUR


@pytest.mark.parametrize("command", _commands())
def test_each_tour_command_runs_as_written(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.sched").write_text(SCHEDULE, encoding="utf-8")
    argv = shlex.split(command)[1:]
    code = main(argv)
    out, err = capsys.readouterr()
    # The one line the tour says fails: the schedule holds every microbatch at once.
    expected = 1 if "--max-inflight 8" in command else 0
    assert code == expected, err
    if "-o" in argv:
        assert (tmp_path / argv[argv.index("-o") + 1]).stat().st_size > 0
    if argv[0] == "search":  # the user's schedule ranked, named by its schedule line
        assert pipedsl.parse(SCHEDULE).name in out


def test_the_tour_schedule_ties_with_1f1b_and_holds_more() -> None:
    # What the tour says of step 3: the same makespan as 1F1B, more microbatches in flight.
    mine = pipedsl.parse(SCHEDULE, pp=4, microbatches=8)
    ours = simulate(pipedsl.lower(mine), CostModel())
    theirs = simulate(pipedsl.lower(pipedsl.load("1f1b", pp=4, microbatches=8)), CostModel())
    assert ours.makespan == theirs.makespan
    assert max(pipedsl.validate(mine).peak_inflight) == 8 > max(pipedsl.validate(pipedsl.load("1f1b")).peak_inflight)


def test_the_python_snippet_prints_numbers_as_people_write_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.sched").write_text(SCHEDULE, encoding="utf-8")
    snippet = next(b for b in BLOCKS if b.startswith("import pipedsl"))
    exec(compile(snippet, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert out == "makespan 33.30 s, bubble 27.9%\npeak in-flight per device (8, 8, 8, 8)\n"
