"""Bad inputs to the simulator's commands, in a real process: each gets one message of
ours and exit code 2, never a traceback, and is refused before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

NOT_UTF8 = b'forward = "\xff\xfe"\n'
MODEL = "[model]\nname = 'x'\nlayers = {layers}\nhidden = 1024\nffn_hidden = 4096\nheads = 16\nseq_len = 2048\nvocab = 50000\n"


def pipedsl(*argv: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipedsl", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "latin1.toml").write_bytes(NOT_UTF8)
    (tmp_path / "huge.toml").write_text("forward = 1e308\n")
    (tmp_path / "slow_link.toml").write_text("bandwidth = 1e-300\nactivation_bytes = 1000\n")
    (tmp_path / "deep.toml").write_text("a = " + "[" * 50_000 + "]" * 50_000 + "\n")
    (tmp_path / "absurd.toml").write_text(MODEL.format(layers=10**12))
    (tmp_path / "a_file").write_text("")
    return tmp_path


CASES = [
    pytest.param(
        ["simulate", "1f1b", "--costs", "latin1.toml"],
        "latin1.toml: not UTF-8 text (byte 11 is 0xff)",
        id="costs-not-utf8",
    ),
    pytest.param(["simulate", "1f1b", "--costs", "deep.toml"], "nested too deeply", id="costs-deep"),
    pytest.param(
        ["estimate", "--model", "latin1.toml", "--cluster", "h100-80gb", "--global-batch", "8"],
        "not UTF-8 text",
        id="model-not-utf8",
    ),
    pytest.param(
        ["estimate", "--model", "gpt3-175b", "--cluster", "latin1.toml", "--global-batch", "8"],
        "not UTF-8 text",
        id="cluster-not-utf8",
    ),
    pytest.param(
        ["search", "--model", "latin1.toml", "--cluster", "h100-80gb", "--gpus", "8"],
        "not UTF-8 text",
        id="search-model-not-utf8",
    ),
    pytest.param(
        ["simulate", "1f1b", "--f", "1e308"], "forward = 1e+308 s is more than the 1e+09 s", id="huge-forward"
    ),
    pytest.param(["simulate", "1f1b", "--f", "nan"], "forward must be a finite number >= 0, got nan", id="nan-forward"),
    pytest.param(
        ["simulate", "1f1b", "--comm", "inf"], "latency must be a finite number >= 0, got inf", id="inf-latency"
    ),
    pytest.param(["simulate", "1f1b", "--costs", "slow_link.toml"], "takes 1e+303 s", id="tiny-bandwidth"),
    pytest.param(["plot", "1f1b", "--costs", "huge.toml", "-o", "x.png"], "forward = 1e+308 s", id="plot-huge-forward"),
    pytest.param(
        ["estimate", "--model", "absurd.toml", "--cluster", "h100-80gb", "--global-batch", "8"],
        "layers = 1,000,000,000,000 is past the 1,000,000",
        id="absurd-layers",
    ),
    pytest.param(
        ["search", "--model", "gpt3-175b", "--cluster", "h100-80gb", "--gpus", "8", "--csv", "missing/plans.csv"],
        "--csv missing/plans.csv: the folder missing does not exist",
        id="csv-no-folder",
    ),
    pytest.param(
        ["search", "--model", "gpt3-175b", "--cluster", "h100-80gb", "--gpus", "8", "--csv", "."],
        "is a folder",
        id="csv-is-folder",
    ),
    pytest.param(
        ["check", "1f1b", "--max-actions", "10"],
        "raise the limit (--max-actions N on the command line",
        id="max-actions",
    ),
    pytest.param(["check", "1f1b", "--max-actions", "0"], "must be at least 1, got 0", id="max-actions-zero"),
]


@pytest.mark.parametrize(("argv", "message"), CASES)
def test_bad_input_is_one_message_of_ours(files: Path, argv: list[str], message: str) -> None:
    done = pipedsl(*argv, cwd=files)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert message in done.stderr
    assert not (files / "x.png").exists()


def test_max_actions_lifts_the_bound(files: Path) -> None:
    done = pipedsl("check", "1f1b", "-p", "pp=4", "-p", "microbatches=8", "--max-actions", "64", cwd=files)
    assert done.returncode == 0, done.stderr


def test_search_refuses_an_empty_batch() -> None:
    from pipedsl.errors import PipedslError
    from pipedsl.simulator.search import search

    with pytest.raises(PipedslError, match="global_batch must be a whole number >= 1, got 0"):
        search("gpt3-175b", "h100-80gb", 8, global_batch=0)
