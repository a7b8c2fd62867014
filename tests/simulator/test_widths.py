"""Output that reads at 80 and 120 columns: no line past the width, no cell cut.

The tour's commands, ``search`` and ``estimate`` run as a user runs them with ``$COLUMNS``
set; the demo's tables are drawn from a real (small) search and from runs shaped as the
demo's, without running the demo (which trains for minutes).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from pipedsl.cli.calibrate import Measurement
from pipedsl.cli.demo import RunResult, _library, _order_verdict, _results_table, best_plans_table
from pipedsl.cli.layout import command_lines, fitted_table, paragraph
from pipedsl.cli.main import main
from pipedsl.cli.planned import PlannedRun
from pipedsl.simulator import CostModel, search

WIDTHS = (80, 120)
SCHEDULE = """
schedule fill_drain(pp = 4, microbatches = 8) {
  stages pp
  devices pp
  place s -> s
  on device d {
    for i in 0 .. microbatches { F(i) }
    for i in 0 .. microbatches { B(microbatches - 1 - i) }
  }
}
"""
COMMANDS = (
    ["check", "mine.sched"],
    ["simulate", "mine.sched", "-p", "pp=8", "-p", "microbatches=32", "--comm", "0.1"],
    ["simulate", "mine.sched", "1f1b", "zb_h1", "-p", "pp=4", "-p", "microbatches=8"],
    ["search", "--model", "demo-small", "--cluster", "tpu-v5e", "--devices", "16", "--global-batch", "64",
     "--top", "5", "--jobs", "1", "--csv", "plans.csv"],
    ["search", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--gpus", "64", "--global-batch", "512",
     "--schedules", "1f1b,interleaved_1f1b,zbv", "--top", "5", "--jobs", "1"],
    ["estimate", "--model", "llama-8b", "--cluster", "tpu-v5e", "--dp", "256", "--global-batch", "1024",
     "--zero", "3", "--recompute", "full"],
    ["estimate", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--dp", "32", "--tp", "4", "--pp", "8",
     "--microbatch-size", "1", "--global-batch", "1536", "--zero", "1", "--schedule", "1f1b"],
)  # fmt: skip


def _readable(text: str, width: int) -> None:
    """No line past ``width``; no cell or word cut short (rich's ellipsis, or ``...``)."""
    for line in text.splitlines():
        assert len(line.rstrip()) <= width, line
        assert "…" not in line and "..." not in line, line


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv[:3]))
def test_commands_read_at_the_width(
    argv: list[str], width: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", str(width))
    (tmp_path / "mine.sched").write_text(SCHEDULE, encoding="utf-8")
    assert main(argv) == 0
    out = capsys.readouterr().out
    _readable(out, width)
    if argv[0] == "search":
        # Every schedule that ranks is named whole in the tables.
        for name in re.findall(r"^\s+\d+\s+([a-z][a-z0-9_]*)\s+\d+\s", out, flags=re.M):
            assert name in ("spmd", "1f1b", "interleaved_1f1b", "zbv", "gpipe", "zb_h1", "zb_h2", "eager_1f1b",
                            "looped_bfs", "dualpipev", "zb_auto", "zbv_auto", "table_example")  # fmt: skip
        assert "pipedsl run" in out


def _console(width: int) -> Console:
    return Console(width=width, record=True, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115


@pytest.mark.parametrize("width", WIDTHS)
def test_the_demos_tables_read_at_the_width(width: int) -> None:
    console = _console(width)
    _library(console)
    frame = search(
        "demo-small", "a100-80gb", 8, global_batch=32, reduce_bytes=4, flash_attention=False, dp_overlap=0.0,
        tp_overlap=0.0,
    )  # fmt: skip
    console.print(best_plans_table(frame, title_of="all in out/plans.csv", width=width))
    plans = [PlannedRun.from_row(row.to_dict()) for _, row in frame.head(3).iterrows()]
    results = [
        RunResult(
            run=Measurement(
                label=plan.label(), costs=CostModel(), predicted_s=None if plan.kind == "spmd" else 0.31,
                measured_s=0.36, times=(0.32, 0.36, 0.40), losses=(6.7347, 1.7951), panels=None,  # type: ignore[arg-type]
                plan=plan,
            ),
            predicted_s=0.2957 + 0.01 * i,
            searched_s=0.1984,
        )
        for i, plan in enumerate(plans)
    ]  # fmt: skip
    console.print(_results_table(results, width=width))
    console.print(paragraph(_order_verdict(results), width=width), soft_wrap=True)
    text = console.export_text()
    _readable(text, width)
    # Every schedule is named whole in the library table, and the runs by their rank.
    assert all(name in text for name in ("interleaved_1f1b", "dualpipev", "zbv_auto", "table_example"))
    assert f"plan {plans[0].rank}" in text


def test_a_table_says_what_it_leaves_out() -> None:
    rows = [["interleaved_1f1b", "1", "2.5"], ["interleaved_1f1b_v", "1", "3.5"]]
    console = _console(31)
    console.print(fitted_table(("schedule", "vpp", "step s"), rows, width=31, left=("schedule",), droppable=("vpp",)))
    text = console.export_text()
    assert "interleaved_1f1b_v" in text and "every row: vpp 1" in text
    console = _console(24)
    table = fitted_table(("schedule", "vpp", "step s"), rows, width=24, left=("schedule",), droppable=("step s",))
    console.print(table)
    text = " ".join(console.export_text().split())
    # Past what it may leave out, a name folds onto the next line whole, never cut.
    assert "left out at 24 columns: step s" in text and "…" not in text


def test_a_long_command_breaks_before_its_options() -> None:
    command = (
        "pipedsl run --spmd -p microbatches=4 --model transformer --dp 64 --tp 16 --zero 3 --microbatch-size 2"
        " --recompute save_dots --sequence-parallel --fused-attention"
    )
    lines = command_lines(command, width=60).splitlines()
    assert all(len(line) <= 60 for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    assert " ".join(line.removesuffix(" \\").strip() for line in lines) == command
    assert any(line.strip().startswith("--dp 64") for line in lines) or "--dp 64" in lines[0]
