"""Results as data: a run appends one line, and bench/RESULTS.md is drawn from the lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipedsl.errors import PipedslError
from pipedsl.results import RESULTS_ENV, append_result, main, read_results, render

ROOT = Path(__file__).resolve().parents[2]


def test_bench_results_md_is_drawn_from_the_data() -> None:
    page = render(read_results(ROOT / "bench" / "results"))
    assert (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8") == page, (
        "bench/RESULTS.md differs from bench/results/: run `make results`"
    )


def test_every_recorded_run_names_its_command_machine_and_figures() -> None:
    results = read_results(ROOT / "bench" / "results")
    assert {"bench_parse", "bench_simulate", "bench_search", "demo", "test_suite"} <= set(results)
    for benchmark, runs in results.items():
        assert runs, benchmark
        for run in runs:
            assert run.benchmark == benchmark and run.command and run.figures and run.machine, run


def test_a_run_appends_one_line_with_what_reproduces_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not a checkout, even where the temporary folder lies inside one.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    first = append_result("bench_x", {"best_s": 0.25, "actions": 262_144}, command="python bench/x.py", folder=tmp_path)
    second = append_result(
        "bench_x", {"best_s": 0.5, "rate": "fast"}, command="python bench/x.py -r 2", folder=tmp_path
    )
    assert first == second == tmp_path / "bench_x.jsonl"
    lines = first.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    record = json.loads(lines[0])
    assert record["figures"] == {"best_s": 0.25, "actions": 262_144}
    assert record["command"] == "python bench/x.py"
    assert len(record["load"]) == 3 and record["machine"]["cores"] >= 1
    # The commit is unknown rather than some other folder's.
    assert record["commit"] is None
    assert [r.figures["best_s"] for r in read_results(tmp_path)["bench_x"]] == [0.25, 0.5]


def test_the_page_puts_the_newest_run_first_with_every_figure(tmp_path: Path) -> None:
    rows = [
        {"benchmark": "b", "date": "2026-01-01", "commit": "abc", "machine": {"text": "two cores"}, "load": "quiet",
         "command": "python bench/b.py", "figures": {"x_s": 1.0}},
        {"benchmark": "b", "date": "2026-02-01", "commit": None, "machine": {"text": "two cores"}, "load": [1, 2, 3],
         "command": "python bench/b.py --fast", "figures": {"x_s": 0.5, "y": "a|b"}, "note": "after the change"},
    ]  # fmt: skip
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    page = render(read_results(tmp_path), folder="here")
    table = [line for line in page.splitlines() if line.startswith("| 2026")]
    assert table == [
        "| 2026-02-01 |  | two cores | 1.00 / 2.00 / 3.00 | `python bench/b.py --fast` | 0.5 | a\\|b |",
        "| 2026-01-01 | `abc` | two cores | quiet | `python bench/b.py` | 1 |  |",
    ]
    assert "- 2026-02-01: after the change" in page and "From `here/b.jsonl`." in page


def test_nothing_is_written_without_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    assert append_result("demo", {"x": 1}, command="pipedsl demo") is None
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "results"))
    assert append_result("demo", {"x": 1}, command="pipedsl demo") == tmp_path / "results" / "demo.jsonl"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad.jsonl:2: not JSON"),
        ("[1, 2]", r"bad.jsonl:2: expected one JSON object per line"),
        ('{"benchmark": "b"}', r"bad.jsonl:2: the run lacks date, commit, machine, load, command, figures"),
        ('{"benchmark": "b", "date": "d", "commit": null, "machine": {}, "load": "x", "command": "c", '
         '"figures": {"f": [1]}}', r"bad.jsonl:2: a run's figure 'f' must be a number or a text"),
    ],
)  # fmt: skip
def test_a_bad_line_is_named_by_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    good = {"benchmark": "b", "date": "d", "commit": None, "machine": {}, "load": "x", "command": "c", "figures": {}}
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(PipedslError, match=message):
        read_results(tmp_path)


def test_a_figure_that_is_not_a_number_or_text_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PipedslError, match="figure 'top' must be a number or a text, got list"):
        append_result("b", {"top": [1, 2]}, command="c", folder=tmp_path)  # type: ignore[dict-item]
    assert not (tmp_path / "b.jsonl").exists()


def test_the_command_writes_the_page_and_reports_bad_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    append_result("b", {"x_s": 2.0}, command="python bench/b.py", folder=tmp_path)
    page = tmp_path / "RESULTS.md"
    assert main([str(tmp_path), "-o", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == render(read_results(tmp_path), folder=tmp_path.as_posix())
    (tmp_path / "c.jsonl").write_text("oops\n", encoding="utf-8")
    assert main([str(tmp_path)]) == 2
    assert "c.jsonl:1: not JSON" in capsys.readouterr().err


def test_a_run_in_a_checkout_records_its_commit(tmp_path: Path) -> None:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("1", encoding="utf-8")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], check=True, capture_output=True, text=True)
    append_result("b", {"x": 1}, command=sys.executable, folder=tmp_path / "results")
    (tmp_path / "f").write_text("2", encoding="utf-8")
    append_result("b", {"x": 2}, command=sys.executable, folder=tmp_path / "results")
    clean, changed = read_results(tmp_path / "results")["b"]
    assert clean.commit == changed.commit == head.stdout.strip()
    assert not clean.dirty and changed.dirty
