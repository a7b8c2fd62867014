"""``pipedsl run``: trains a built-in model, prints losses and step times, saves timelines."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from processes import Lines

import pipedsl
from helpers import fresh_process_env
from pipedsl.cli import main
from pipedsl.cli.interrupts import Interrupted, held_interrupts, take_interrupt
from pipedsl.timeline import Timeline

ROOT = Path(__file__).resolve().parents[2]


def _pipedsl(*args: str) -> subprocess.CompletedProcess[str]:
    # A fresh process without the device count: the command must give JAX its devices itself.
    env = fresh_process_env()
    return subprocess.run(
        [sys.executable, "-m", "pipedsl", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def test_building_the_parser_does_not_import_jax() -> None:
    code = "import sys, pipedsl.cli; pipedsl.cli.build_parser(); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.slow
def test_run_trains_and_saves_a_measured_timeline(tmp_path: Path) -> None:
    timeline_path = tmp_path / "zb.json"
    schedule = str(pipedsl.library_path("zb_h1"))
    out = _pipedsl(
        "run", schedule, "-p", "pp=3", "-p", "microbatches=3", "--model", "transformer", "--marked",
        "--steps", "3", "--width", "8", "--layers-per-stage", "1", "--timeline", str(timeline_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "3 stages on 3 cpu devices" in lines[0]
    losses = [float(line.split()[1]) for line in lines[2:5]]
    assert losses[2] < losses[0]
    assert "median step time (steps 2-3)" in out.stdout
    timeline = Timeline.load(timeline_path)
    assert timeline.origin == "measured" and timeline.num_devices == 3
    assert (timeline.compute_mask).sum() == 3 * 3 * 3  # F, I and W per stage and microbatch


def test_run_reports_schedule_errors() -> None:
    out = _pipedsl("run", str(pipedsl.library_path("zbv")), "-p", "pp=2", "-p", "microbatches=1")
    assert out.returncode == 2
    assert "ZB-V needs at least 2pp-1 microbatches" in out.stderr
    assert "Traceback" not in out.stderr


def test_run_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    schedule = str(pipedsl.library_path("1f1b"))
    code = main(["run", schedule, "-p", "pp=2", "-p", "microbatches=2", "--steps", "2", "--width", "8"])
    assert code == 0
    out = capsys.readouterr().out
    assert "model mlp (width 8, 2 layers per stage, explicit stages)" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))]) == 2


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_is_held_until_a_safe_point() -> None:
    with held_interrupts(name="pipedsl run"):
        # The handler runs before raise_signal returns: a KeyboardInterrupt would come here.
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(Interrupted):
            take_interrupt()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    take_interrupt()  # outside a hold, nothing to take


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_while_the_stages_compile_ends_the_run_with_one_line() -> None:
    # The table's header is the last line before the first step, which traces and compiles
    # the stages: the signal comes while they compile (or, on a slow machine, during the
    # steps after), and wherever it comes the run must end at a safe point with one line.
    env = fresh_process_env() | {"PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "pipedsl", "run", "1f1b", "-p", "pp=2", "-p", "microbatches=4"]
    command += ["--steps", "100000", "--width", "8"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert run.stdout is not None and run.stderr is not None
        out, err = Lines(run.stdout), Lines(run.stderr)
        assert out.starting(" step", 1, timeout_s=240), err.text()
        run.send_signal(signal.SIGINT)
        code = run.wait(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert code == 130, err.text()
    assert err.text() == "pipedsl run: interrupted\n"


def test_run_puts_every_pipeline_device_on_one_device_with_shared_devices() -> None:
    # A fresh process: it must ask for one device, not one per pipeline device.
    out = _pipedsl("run", "1f1b", "-p", "pp=2", "-p", "microbatches=4", "--shared-devices", "--steps", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "2 stages on 1 cpu device (2 pipeline devices share it; each step runs as one program looping" in lines[0]
    losses = [float(line.split()[1]) for line in lines[2:5]]
    assert losses[2] < losses[0]


def test_run_with_ticks_on_runs_each_step_as_one_program_and_trains_as_apart() -> None:
    runs = {}
    for ticks in ("on", "off"):
        out = _pipedsl("run", "1f1b", "-p", "pp=2", "-p", "microbatches=4", "--steps", "3", "--ticks", ticks)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        runs[ticks] = [float(line.split()[1]) for line in (lines[2], *lines[4:6])]
        assert ("one program over the pipeline devices, tick by tick" in lines[3]) == (ticks == "on"), lines[3]
    assert runs["on"] == pytest.approx(runs["off"], rel=1e-5)
    assert runs["on"][2] < runs["on"][0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fuse", "loop"], "--fuse says how pipeline devices that share their devices run a step"),
        (["--ticks", "on", "--shared-devices"], "--ticks says how pipeline devices of their own run a step"),
        (["--shared-devices", "--backend", "ray"], "--shared-devices puts every pipeline device on this process's"),
        (["--shared-devices", "-p", "pp=1"], "--shared-devices shares devices between pipeline devices"),
    ],
)
def test_sharing_options_that_cannot_mean_anything_are_refused(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "1f1b", "-p", "microbatches=2", *args, "--steps", "1"]) == 2
    assert message in capsys.readouterr().err


def test_search_ranks_shared_pipelines_with_the_command_that_runs_them() -> None:
    out = _pipedsl(
        "search", "--model", "llama-8b", "--cluster", "a100-80gb", "--gpus", "1", "--global-batch", "8",
        "--shared-pipelines", "--top", "3",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert " shared " in out.stdout and "--shared-devices" in out.stdout
