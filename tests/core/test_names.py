"""One name per schedule everywhere, plurals that agree, a short repr, help in plain words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pipedsl
from pipedsl.cli import main


def test_a_library_schedule_is_named_as_loaded_and_a_users_file_by_its_schedule_line(tmp_path: Path) -> None:
    assert pipedsl.load("1f1b").name == "1f1b"  # the source says `schedule one_f_one_b`
    assert pipedsl.load(pipedsl.library_path("1f1b")).name == "1f1b"
    mine = tmp_path / "my1f1b.sched"
    mine.write_text("schedule my_1f1b { stages 1 devices 1 place s -> 0 device 0: 0F0 0B0 }")
    assert pipedsl.load(mine).name == "my_1f1b"
    assert pipedsl.library.load_arrays(mine).name == "my_1f1b"
    assert main(["check", str(mine)]) == 0
    assert pipedsl.parse(mine.read_text()).name == "my_1f1b"  # text without a file: the same


def test_repr_is_a_summary() -> None:
    schedule = pipedsl.load("1f1b", pp=8, microbatches=64)
    text = repr(schedule)
    assert text.startswith(
        "<Schedule 1f1b(pp=8, microbatches=64): 8 stages on 8 devices, 64 microbatches, 1024 actions"
    )
    assert len(text) < 200
    one = pipedsl.parse("schedule t { stages 1 devices 1 place s -> 0 device 0: 0F0 0B0 }")
    assert repr(one) == "<Schedule t(): 1 stage on 1 device, 1 microbatch, 2 actions>"


def test_counts_of_one_are_singular(capsys: object) -> None:
    assert main(["show", "1f1b", "-p", "pp=1", "-p", "microbatches=1"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert out.splitlines()[0] == "1f1b(pp=1, microbatches=1): 1 stage on 1 device (placement 0), 1 microbatch"
    assert main(["check", "1f1b", "-p", "pp=1", "-p", "microbatches=1"]) == 0
    assert ": 1 stage, 1 device, 1 microbatch, 2 actions," in capsys.readouterr().out  # type: ignore[attr-defined]


def test_calibrate_help_is_plain_words() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pipedsl", "calibrate", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "``" not in done.stdout and ":func:" not in done.stdout
    assert "--save-costs DIR" in done.stdout
