"""Bad options to ``run``, ``calibrate`` and ``demo``, in a real process: each is refused
up front with one message of ours and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RUN = ["run", "1f1b", "-p", "pp=2", "-p", "microbatches=2", "--steps", "1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param([*RUN, "--width", "-5"], "--width must be at least 1, got -5", id="negative-width"),
        pytest.param([*RUN, "--layers-per-stage", "0"], "--layers-per-stage must be at least 1, got 0", id="no-layers"),
        pytest.param(
            [*RUN, "--layers-per-stage", "-1"], "--layers-per-stage must be at least 1, got -1", id="negative-layers"
        ),
        pytest.param([*RUN, "--seed", str(2**64)], "--seed must be a 64-bit integer", id="huge-seed"),
        pytest.param([*RUN, "--lr", "nan"], "--lr must be a finite number above 0, got nan", id="nan-lr"),
        pytest.param(
            [*RUN, "--width", "100000"], "GB of parameters; training it with Adam needs at least", id="too-big"
        ),
        pytest.param(
            ["calibrate", "--save-costs", "a_file"],
            "--save-costs a_file: is a file; give a folder",
            id="costs-into-a-file",
        ),
        pytest.param(
            ["calibrate", "--save-costs", "a_file/sub"], "cannot be made: a_file is a file", id="costs-under-a-file"
        ),
        pytest.param(["demo", "--out", "a_file"], "--out a_file: is a file; give a folder", id="demo-into-a-file"),
    ],
)
def test_bad_options_are_refused_up_front(tmp_path: Path, argv: list[str], message: str) -> None:
    (tmp_path / "a_file").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "pipedsl", *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert message in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written
