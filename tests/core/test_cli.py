"""The command line, in process: exit codes, messages on stderr, conversions and back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import one_f_one_b
from pipedsl import library
from pipedsl.cli import main
from pipedsl.cli.common import parse_params
from pipedsl.interop import to_csv

Capture = pytest.CaptureFixture[str]

ONE_F_ONE_B = """\
# 1F1B for the tests.
schedule one_f_one_b(pp = 4, microbatches = 8) {
  require microbatches >= pp, "1F1B needs at least as many microbatches as stages"
  stages pp
  devices pp
  place s -> s
  on device d {
    warmup = min(pp - 1 - d, microbatches)
    for i in 0 .. warmup { F(i) }
    for i in 0 .. microbatches - warmup { F(warmup + i)  B(i) }
    for i in microbatches - warmup .. microbatches { B(i) }
  }
}
"""


@pytest.fixture
def sched(tmp_path: Path) -> Path:
    path = tmp_path / "1f1b.sched"
    path.write_text(ONE_F_ONE_B)
    return path


def run(capsys: Capture, *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


# --- check ---------------------------------------------------------------------------


def test_check_prints_one_line_per_file(capsys: Capture, sched: Path, tmp_path: Path) -> None:
    csv = tmp_path / "torch.csv"
    csv.write_text(to_csv(one_f_one_b(2, 4)))
    code, out, err = run(capsys, "check", sched, csv, "-p", "microbatches=4")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines == [
        f"{sched}: ok  one_f_one_b(pp=4, microbatches=4): 4 stages, 4 devices, 4 microbatches, 32 actions, "
        "peak in-flight per device 4 3 2 1",
        f"{csv}: ok  torch: 2 stages, 2 devices, 4 microbatches, 16 actions, peak in-flight per device 2 1",
    ]


def test_check_the_library_by_name(capsys: Capture) -> None:
    names = sorted(library.library_schedules())
    code, out, err = run(capsys, "check", *names)
    assert (code, err) == (0, "")
    assert len(out.splitlines()) == len(names)


def test_check_invalid_schedule_exits_1(capsys: Capture, tmp_path: Path) -> None:
    bad = tmp_path / "bad.sched"
    text = ONE_F_ONE_B.replace("F(warmup + i)  B(i)", "B(i)  F(warmup + i)")
    bad.write_text(text)
    code, out, err = run(capsys, "check", bad, "-p", "pp=2", "-p", "microbatches=2")
    assert code == 1 and out == ""
    # Device 1 runs B(0) before F(0); the error points at the B(i) in the loop body.
    line = text.splitlines()[9]
    lines = err.splitlines()
    column = line.index("B(i)") + 1
    assert lines[0].startswith(f"{bad}:10:{column}: [dependency-order] action 1B0 on device 1 comes before 1F0")
    assert lines[1] == "    " + line
    assert lines[2].index("^") == lines[1].index("B(i)")


def test_check_verbose_says_how_transfers_meet_under_rendezvous(capsys: Capture, sched: Path) -> None:
    # 1F1B deadlocks where each transfer is a rendezvous made in program order; in the
    # exchange order its 8 transfers meet, an activation and a gradient per collective
    # but the first and the last.
    code, out, err = run(capsys, "check", sched, "-p", "pp=2", "-p", "microbatches=4", "--verbose")
    assert (code, err) == (0, "")
    assert out.splitlines()[1] == (
        f"{sched}: runs under rendezvous transfers too (as every valid schedule does): 8 transfers in one "
        "exchange order, made as 5 collectives"
    )
    assert len(run(capsys, "check", sched, "-p", "pp=2", "-p", "microbatches=4")[1].splitlines()) == 1


CROSS = """\
# Device 1 takes microbatch 1 first; device 0 sends it only after microbatch 0's backward.
schedule cross(microbatches = 2) {
  stages 2
  devices 2
  place s -> s
  on device d {
    for i in 0 .. microbatches {
      m = (i + d) % microbatches
      F(m)  B(m)
    }
  }
}
"""


def test_check_reports_a_schedule_that_cannot_run_under_rendezvous_at_its_line(capsys: Capture, tmp_path: Path) -> None:
    # Rendezvous transfers cannot meet only where buffered ones cannot either: the
    # validator's deadlock rule reports it, at the action that waits.
    path = tmp_path / "cross.sched"
    path.write_text(CROSS)
    code, out, err = run(capsys, "check", path, "--verbose")
    assert code == 1 and out == ""
    line = CROSS.splitlines()[8]
    assert err.splitlines()[0].startswith(f"{path}:9:{line.index('B(m)') + 1}: [deadlock] ")
    assert "device 0 waits at 0B0 for 1B0 on device 1" in err


def test_check_max_inflight(capsys: Capture, sched: Path) -> None:
    code, _, err = run(capsys, "check", sched, "--max-inflight", "3")
    assert code == 1
    assert err == (
        f"{sched}: [max-inflight] device 0 holds 4 microbatches in flight at its peak, above the limit of 3\n"
    )
    assert run(capsys, "check", sched, "--max-inflight", "4")[0] == 0


def test_check_reports_every_file_and_the_worst_code(capsys: Capture, sched: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.sched"
    broken.write_text("schedule x {\n  stages 2 +\n}\n")
    code, out, err = run(capsys, "check", broken, sched, "--max-inflight", "1")
    assert code == 2
    assert out == ""
    assert err.startswith(f"{broken}:3:1: ")
    assert f"{sched}: [max-inflight]" in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["-p", "foo=1"], "unknown parameter `foo`"),
        (["-p", "pp=x"], "parameter pp needs an integer value, got 'x'"),
        (["-p", "pp=\u0664"], "parameter pp needs an integer value, got '\u0664'"),
        (["-p", "pp=1_0"], "parameter pp needs an integer value, got '1_0'"),
        (["-p", "pp"], "parameter 'pp' should be NAME=VALUE"),
        (["-p", "pp=2", "-p", "pp=3"], "parameter pp is given twice: pp=2 and pp=3; keep one"),
        (["-p", "pp=9"], "requirement failed: 1F1B needs at least as many microbatches as stages"),
        (["--max-inflight", "x"], "invalid int value"),
    ],
)
def test_usage_and_evaluation_errors_exit_2(capsys: Capture, sched: Path, argv: list[str], words: str) -> None:
    code, out, err = run(capsys, "check", sched, *argv)
    assert code == 2 and out == ""
    assert words in err


def test_syntax_error_shows_the_line_and_a_caret(capsys: Capture, tmp_path: Path) -> None:
    path = tmp_path / "typo.sched"
    path.write_text(ONE_F_ONE_B.replace("place s -> s", "place s => s"))
    code, out, err = run(capsys, "check", path)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith(f"{path}:6:11: ")
    assert lines[1] == "      place s => s"
    assert lines[2] == "    " + " " * 10 + "^"


def test_missing_file_and_unknown_kind(capsys: Capture, tmp_path: Path) -> None:
    code, out, err = run(capsys, "check", tmp_path / "nope.sched")
    assert (code, out, err) == (2, "", f"{tmp_path / 'nope.sched'}: no such file\n")
    (tmp_path / "s.txt").write_text("")
    code, _, err = run(capsys, "show", tmp_path / "s.txt")
    assert code == 2 and "expected .sched, .csv or .json" in err


def test_bad_csv_cell_is_located(capsys: Capture, tmp_path: Path) -> None:
    path = tmp_path / "lowered.csv"
    path.write_text("0F0,0SEND_F0,0B0\n1F0,1B0\n")
    code, _, err = run(capsys, "check", path)
    assert code == 2
    assert err.startswith(f"{path}:1:5: cell '0SEND_F0' is a communication")


def test_usage_errors(capsys: Capture) -> None:
    assert run(capsys, "frobnicate")[0] == 2
    code, _, err = run(capsys)
    assert code == 2 and "check" in err
    assert run(capsys, "convert", "x.sched")[0] == 2  # --to is required
    assert run(capsys, "convert", "x.sched", "--to", "yaml")[0] == 2


def test_help_explains_each_command(capsys: Capture) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("check", "show", "convert"):
        assert command in out
    for command in ("check", "show", "convert"):
        code, out, _ = run(capsys, command, "--help")
        assert code == 0 and "examples:" in out and f"pipedsl {command} " in out


def test_parse_params() -> None:
    assert parse_params(["pp=4", " microbatches = 8 ", "x=-1"]) == {"pp": 4, "microbatches": 8, "x": -1}
    for bad in (["pp"], ["=3"], ["p p=3"], ["pp=3.5"], ["pp=1", "pp=2"]):
        with pytest.raises(ValueError):
            parse_params(bad)


# --- show --------------------------------------------------------------------------------


def test_show_grid(capsys: Capture, sched: Path) -> None:
    code, out, err = run(capsys, "show", sched, "-p", "pp=2", "-p", "microbatches=3")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "one_f_one_b(pp=2, microbatches=3): 2 stages on 2 devices (placement 0 1), 3 microbatches",
        "device 0: 0F0 0F1 0B0 0F2 0B1 0B2",
        "device 1: 1F0 1B0 1F1 1B1 1F2 1B2",
    ]


def test_show_lowered(capsys: Capture, sched: Path) -> None:
    code, out, _ = run(capsys, "show", sched, "-p", "pp=2", "-p", "microbatches=2", "--lowered")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "device 0 (stages 0):"
    assert "  send act(0,0) -> device 1" in lines and "  recv grad(1,0) <- device 1" in lines


def test_show_invalid_prints_the_grid_then_the_error(capsys: Capture, tmp_path: Path) -> None:
    path = tmp_path / "short.csv"
    path.write_text("0F0,0B0\n1F0\n")
    code, out, err = run(capsys, "show", path)
    assert code == 1
    assert out.splitlines()[1:] == ["device 0: 0F0 0B0", "device 1: 1F0"]
    assert err.startswith(f"{path}:2:1: [missing-action]")
    code, out, err = run(capsys, "show", path, "--lowered")
    assert code == 1 and out == "" and "[missing-action]" in err


# --- convert ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["csv", "json", "sched"])
def test_convert_and_back(capsys: Capture, sched: Path, tmp_path: Path, fmt: str) -> None:
    out_path = tmp_path / f"converted.{fmt}"
    params = ["-p", "pp=3", "-p", "microbatches=5"]
    code, out, err = run(capsys, "convert", sched, *params, "--to", fmt, "-o", out_path)
    assert (code, out, err) == (0, "", "")
    original = library.load(sched, pp=3, microbatches=5)
    converted = library.load(out_path)
    assert converted.orders == original.orders and converted.placement == original.placement
    # And back to .sched from the converted file, through stdout.
    code, out, err = run(capsys, "convert", out_path, "--to", "sched")
    assert (code, err) == (0, "")
    assert library.parse(out).orders == original.orders


def test_convert_validates_imports(capsys: Capture, tmp_path: Path) -> None:
    path = tmp_path / "torch.csv"
    row = ",0F0,0F1,0B0,0B1,0F2"
    path.write_text(row + "\n1F0,1B0,1F1,1B1\n")
    code, out, err = run(capsys, "convert", path, "--to", "sched", "-p", "microbatches=2")
    assert code == 1 and out == ""
    assert err.splitlines()[0].startswith(f"{path}:1:{row.index('0F2') + 1}: [microbatch-range] action 0F2")
    assert err.splitlines()[1] == "    " + row


def test_convert_to_an_unwritable_place(capsys: Capture, sched: Path, tmp_path: Path) -> None:
    code, _, err = run(capsys, "convert", sched, "--to", "csv", "-o", tmp_path / "no" / "such" / "dir.csv")
    assert code == 2 and "such does not exist" in err


def test_python_dash_m(sched: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pipedsl", "check", str(sched), "-p", "pp=9"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "requirement failed" in done.stderr and "Traceback" not in done.stderr


def test_the_readme_and_help_list_every_exit_code(capsys: Capture) -> None:
    from pipedsl.cli import common

    codes = {value for name, value in vars(common).items() if name.startswith("EXIT_")}
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    listed = readme[readme.index("Exit codes:") :].split("\n\n")[0]
    assert main(["--help"]) == 0
    helped = capsys.readouterr().out
    for code in codes:
        assert re.search(rf"\b{code} ", listed), (code, listed)
        assert re.search(rf"\b{code} ", helped), (code, helped)


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (("run", "1f1b", "-p", "pp=2", "--timeline"), "--timeline"),
        (("run", "1f1b", "-p", "pp=2", "--checkpoint"), "--checkpoint"),
        (("plot", "1f1b", "-p", "pp=2", "-o"), "-o"),
        (("trace", "1f1b", "-p", "pp=2", "-o"), "-o"),
        (("convert", "1f1b", "-p", "pp=2", "--to", "csv", "-o"), "-o"),
        (("search", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--gpus", "64", "--csv"), "--csv"),
        (("calibrate", "--out"), "--out"),
        (("demo", "--out"), "--out"),
    ],
)
@pytest.mark.parametrize("where", ["missing", "proc"])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(
    capsys: Capture, tmp_path: Path, command: tuple[str, ...], option: str, where: str
) -> None:
    # A folder that does not exist (made by none of these but calibrate's and the folders'
    # options, which then meet a file in the way), and /proc, where nothing can be made.
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "out" / "x.json" if where == "missing" else Path("/proc/pipedsl-test/x.json")
    code, out, err = run(capsys, *command, target)
    assert code == 2 and out == "", err
    assert f"{option} {target}: " in err and len(err.strip().splitlines()) == 1, err


# What each writing command writes to, after the command (which reads the schedule FILE).
_WRITERS = [
    (("convert", "{input}", "--to", "csv", "-o"), "-o"),
    (("plot", "{input}", "-p", "pp=2", "-o"), "-o"),
    (("trace", "{input}", "-p", "pp=2", "-o"), "-o"),
    (("run", "{input}", "-p", "pp=2", "--timeline"), "--timeline"),
    (("search", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--gpus", "64", "{input}", "--csv"), "--csv"),
    (("calibrate", "{input}", "--out"), "--out"),
]


@pytest.mark.parametrize(("command", "option"), _WRITERS)
@pytest.mark.parametrize("target", ["input", "other"])
def test_no_command_writes_over_its_input_or_a_file_it_did_not_write(
    capsys: Capture, sched: Path, tmp_path: Path, command: tuple[str, ...], option: str, target: str
) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    output = sched if target == "input" else mine
    before = output.read_text()
    argv = [sched if part == "{input}" else part for part in command]
    code, out, err = run(capsys, *argv, output)
    assert code == 2 and out == "", err
    assert output.read_text() == before
    (line,) = err.strip().splitlines()
    assert f"{option} {output}: " in line and "--force" in line, line
    assert (
        f"would write over {sched}, which this command reads" if target == "input" else "exists and is not"
    ) in line, line


def test_a_command_writes_over_its_own_output_and_with_force_over_any(
    capsys: Capture, sched: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "t.json"
    for _ in range(2):
        assert run(capsys, "trace", sched, "-p", "pp=2", "-o", trace)[0] == 0
    assert trace.read_text().startswith('{"traceEvents"')
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    assert run(capsys, "trace", sched, "-p", "pp=2", "-o", mine, "--force")[0] == 0
    assert mine.read_text().startswith('{"traceEvents"')
    table = tmp_path / "table.sched"
    for _ in range(2):
        assert run(capsys, "convert", sched, "--to", "sched", "-o", table)[0] == 0
    picture = tmp_path / "p.svg"
    for _ in range(2):
        assert run(capsys, "plot", sched, "-p", "pp=2", "-o", picture)[0] == 0


@pytest.mark.parametrize(
    ("command", "name"),
    [(("demo", "--out"), "plans.csv"), (("calibrate", "{input}", "--save-costs"), "one_f_one_b.toml")],
)
def test_a_folder_output_is_refused_where_a_file_it_writes_is_someone_elses(
    capsys: Capture, sched: Path, tmp_path: Path, command: tuple[str, ...], name: str
) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / name).write_text("my data\n")
    argv = [sched if part == "{input}" else part for part in command]
    code, out, err = run(capsys, *argv, folder)
    assert code == 2 and out == "", err
    (line,) = err.strip().splitlines()
    assert f"{command[-1]} {folder}: {folder / name} exists and is not" in line and "--force" in line, line
    assert (folder / name).read_text() == "my data\n"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["run", "1f1b", "-p", "pp=2", "--layers-per-stage", "1000000"], "of parameters; training it with Adam needs"),
        (["run", "1f1b", "-p", "pp=2", "--model", "llama", "--width", "1000000000"], "GB of this machine's memory"),
        (["run", "1f1b", "-p", "pp=2", "--dp", "100000"], "200,000 devices (pp x dp x cp x tp) are more than this"),
    ],
)
def test_run_refuses_what_the_machine_cannot_hold_by_arithmetic_before_jax(argv: list[str], said: str) -> None:
    # In a process of its own: that JAX is never imported shows nothing was built.
    code = f"import sys\nfrom pipedsl.cli.main import main\ncode = main({argv!r})\nprint(code, 'jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert said in line and ("core" in line if "devices" in said else "--width" in line), line


def test_search_takes_at_most_a_process_a_core(capsys: Capture) -> None:
    argv = ["search", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--gpus", "64", "--jobs", "100000"]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.startswith("--jobs 100000: this machine has ") and "or fewer" in err


def test_check_max_inflight_names_every_device_in_one_message(capsys: Capture) -> None:
    # Eight devices over the limit make one message, not eight of the same.
    code, _, err = run(capsys, "check", "gpipe", "-p", "pp=8", "-p", "microbatches=32", "--max-inflight", "8")
    assert code == 1
    assert err == (
        "gpipe: [max-inflight] all 8 devices hold 32 microbatches in flight at their peaks, above the limit of 8\n"
    )
    code, _, err = run(capsys, "check", "1f1b", "-p", "pp=8", "-p", "microbatches=32", "--max-inflight", "5")
    assert err == (
        "1f1b: [max-inflight] devices 0-2 hold up to 8 microbatches in flight at their peaks, above the limit of 5\n"
    )


def test_an_spmd_plan_is_offered_as_an_spmd_command(capsys: Capture) -> None:
    from pipedsl.cli.planned import PlannedRun

    row = {"kind": "spmd", "schedule": "SPMD", "dp": 8, "tp": 1, "pp": 1, "vpp": 1, "microbatch_size": 4}
    command = PlannedRun.from_row({**row, "microbatches": 4, "zero": 1}).command()
    assert command.startswith("pipedsl run --spmd -p microbatches=4 --model transformer --dp 8 --tp 1 --zero 1")
    assert "pp=" not in command
    # `run --spmd` takes the microbatches alone, and no schedule besides.
    assert run(capsys, "run", "--spmd", "-p", "pp=2")[2].endswith("drop -p pp\n")
    assert "--spmd runs no pipeline schedule" in run(capsys, "run", "--spmd", "1f1b")[2]
