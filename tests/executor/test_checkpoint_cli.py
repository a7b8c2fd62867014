"""``pipedsl run --checkpoint DIR --resume`` and the stop at a non-finite loss.

A resumed run prints the losses an uninterrupted one prints; a checkpoint of another
model or optimizer, a missing or existing checkpoint, and bad options are refused with
one line and exit code 2; a run whose loss turns non-finite stops there, naming the step
and the stage; a TERM (or a Ctrl-C) ends a run with one line and its last checkpoint
whole. Three tests run ``pipedsl`` as a fresh process; the others call the same
``main`` in this process, which is quicker (JAX and the compiled stages stay loaded).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from processes import Lines

from helpers import fresh_process_env, library
from pipedsl.cli import main
from pipedsl.cli.health import NonFiniteLoss, nonfinite_origin
from pipedsl.executor import Pipeline
from pipedsl.executor.models import mlp

ROOT = Path(__file__).resolve().parents[2]
RUN = ["run", "1f1b", "-p", "pp=2", "-p", "microbatches=2", "--width", "8", "--layers-per-stage", "1"]
# A model that tensor parallelism splits (the resumed run takes --tp 2).
SPLIT = [*RUN, "--model", "transformer"]


def _pipedsl(*args: str) -> subprocess.CompletedProcess[str]:
    env = fresh_process_env()
    return subprocess.run(
        [sys.executable, "-m", "pipedsl", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


@pytest.mark.usefixtures("ctrl_c")
@pytest.mark.parametrize(
    ("signum", "code", "said"), [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_stopped_run_says_so_and_leaves_its_last_checkpoint_whole(
    tmp_path: Path, signum: int, code: int, said: str
) -> None:
    from pipedsl.executor.sharded_checkpoint import complete_versions

    ckpt = tmp_path / "ckpt"
    env = fresh_process_env() | {"PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "pipedsl", *RUN, "--steps", "100000", "--checkpoint", str(ckpt)]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert run.stdout is not None and run.stderr is not None
        out, err = Lines(run.stdout), Lines(run.stderr)
        # Step 2's line: step 1 is saved, and step 2's save is about to begin.
        assert out.starting("    2 ", 1, timeout_s=240), err.text()
        run.send_signal(signum)
        assert run.wait(timeout=240) == code, err.text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert err.text() == f"pipedsl run: {said}\n"
    assert complete_versions(ckpt) and not [p.name for p in ckpt.rglob("*tmp*")]


def _table(out: str) -> dict[int, str]:
    """Step number to its printed loss, from ``run``'s table."""
    table = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0].isdigit() and fields[3:4] == ["ms"]:
            table[int(fields[0])] = fields[1]
    return table


def test_a_resumed_run_prints_the_losses_of_an_uninterrupted_one(tmp_path: Path) -> None:
    whole = _pipedsl(*SPLIT, "--steps", "4", "--checkpoint", str(tmp_path / "whole"), "--checkpoint-every", "3")
    assert whole.returncode == 0, whole.stderr
    first = _pipedsl(*SPLIT, "--steps", "2", "--checkpoint", str(tmp_path / "part"))
    assert first.returncode == 0, first.stderr
    # Resumed on another plan of the model: tensor parallel over two devices per stage.
    rest = _pipedsl(*SPLIT, "--steps", "4", "--checkpoint", str(tmp_path / "part"), "--resume", "--tp", "2")
    assert rest.returncode == 0, rest.stderr
    assert "resumed from" in rest.stdout and "after step 2" in rest.stdout
    expected = _table(whole.stdout)
    assert sorted(expected) == [1, 2, 3, 4]
    assert _table(first.stdout) == {1: expected[1], 2: expected[2]}
    # The same training to float32's rounding: tensor parallelism sums the split matrices' products in another order.
    rest_losses = {step: float(loss) for step, loss in _table(rest.stdout).items()}
    assert rest_losses == pytest.approx({3: float(expected[3]), 4: float(expected[4])}, rel=1e-5)
    assert "checkpoint of step 4" in rest.stdout and "checkpoint of step 4" in whole.stdout


def _with(*args: str) -> list[str]:
    """RUN and ``args``, an option of RUN's given again in ``args`` taking RUN's place (an
    option given twice is refused)."""
    pairs = zip(RUN[2::2], RUN[3::2], strict=True)
    return RUN[:2] + [word for option, value in pairs if option not in args for word in (option, value)] + list(args)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(_with(*args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_resume_refuses_another_model_and_checks_its_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(tmp_path / "ckpt")
    code, out, err = _run(capsys, "--steps", "1", "--checkpoint", ckpt)
    assert code == 0, err
    code, out, err = _run(capsys, "--steps", "3", "--checkpoint", ckpt, "--resume")
    assert code == 0 and sorted(_table(out)) == [2, 3], err
    code, out, err = _run(capsys, "--steps", "3", "--checkpoint", ckpt, "--resume")
    assert code == 0 and _table(out) == {}, err  # nothing left to do
    refused = [
        # Another model is named even where no step would be left to run.
        (["--steps", "3", "--checkpoint", ckpt, "--resume", "--model", "transformer"], "another model"),
        (["--steps", "2", "--checkpoint", ckpt, "--resume", "--lr", "0.1"], "was trained with --lr 0.001"),
        (
            ["--steps", "4", "--checkpoint", ckpt, "--resume", "--width", "16"],
            r"params[0][0]['b'] is float32[8] there and float32[16] here",
        ),
        (["--steps", "4", "--checkpoint", ckpt, "--resume", "--marked"], "holds another model's parameters"),
        (
            ["--steps", "4", "--checkpoint", ckpt, "--resume", "--layers-per-stage", "2"],
            "parameters: 4 arrays saved, 8 in this pipeline",
        ),
        (["--steps", "4", "--checkpoint", ckpt], "holds a checkpoint already; pass --resume"),
        (["--steps", "4", "--checkpoint", str(tmp_path / "new"), "--resume"], "holds no checkpoint yet"),
        (["--steps", "4", "--resume"], "give its directory with --checkpoint DIR"),
        (["--steps", "4", "--checkpoint", ckpt, "--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    ]
    for args, message in refused:
        code, out, err = _run(capsys, *args)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
    (tmp_path / "file").write_text("x")
    code, out, err = _run(capsys, "--checkpoint", str(tmp_path / "file"))
    assert code == 2 and "is a file; give a folder" in err


def test_resume_refuses_another_optimizer_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = mlp(num_stages=2, width=8, layers_per_stage=1)
    params = model.init_stages(jax.random.PRNGKey(0))
    # The plan and parameters fit, the optimizer state (SGD with momentum) does not.
    with Pipeline(model.stages, loss=model.loss, schedule=library("1f1b", microbatches=2)) as pipe:
        pipe.train_step(params, None, model.batch(jax.random.PRNGKey(1), 8), optimizer=optax.sgd(0.1, momentum=0.9))
        pipe.save(str(tmp_path / "ckpt"), step=1)
    code, out, err = _run(capsys, "--steps", "2", "--checkpoint", str(tmp_path / "ckpt"), "--resume")
    assert code == 2 and "the optimizer state of stage 0 was saved by another optimizer (2 arrays:" in err, err


def test_a_damaged_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Every array's data overwritten: orbax fails on one while tensorstore still reads the others.
    code, out, err = _run(capsys, "--steps", "1", "--width", "64", "--checkpoint", str(tmp_path / "ckpt"))
    assert code == 0, err
    damaged = [f for f in (tmp_path / "ckpt").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert len(damaged) >= 4
    for data in damaged:
        data.write_bytes(b"\x00not an array chunk\xff" * 3)
    # A fresh process: tensorstore prints from its own threads, past the reach of capsys.
    resumed = _pipedsl(*_with("--steps", "2", "--width", "64"), "--checkpoint", str(tmp_path / "ckpt"), "--resume")
    assert resumed.returncode == 2
    assert len(resumed.stderr.splitlines()) == 1, resumed.stderr
    assert "device 0 could not read" in resumed.stderr


def test_a_checkpoint_given_by_a_relative_path_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "--steps", "1", "--checkpoint", "ckpt")
    assert code == 0, err
    code, out, err = _run(capsys, "--steps", "2", "--checkpoint", "ckpt", "--resume")
    assert code == 0 and sorted(_table(out)) == [2], err


def test_a_run_keeps_its_latest_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    code, out, err = _run(capsys, "--steps", "3", "--checkpoint", str(ckpt))
    assert code == 0, err
    assert sorted(p.name for p in ckpt.iterdir()) == ["settings.json", "step-3"]
    assert sorted(p.name for p in (ckpt / "step-3").iterdir()) == ["device-0", "device-1", "plan.json"]


@pytest.mark.parametrize("lr", ["nan", "inf", "0", "-1"])
def test_a_learning_rate_that_cannot_train_is_refused_up_front(lr: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--lr", lr)
    assert code == 2 and "--lr must be a finite number above 0" in err and "step" not in out


def test_a_non_finite_loss_stops_the_run_naming_step_and_stage() -> None:
    done = _pipedsl(*RUN, "--steps", "5", "--lr", "1e30")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(r"the loss of step 2 is not finite; it first appears in stage \d's forward output", done.stderr)
    assert "try a smaller --lr" in done.stderr
    assert sorted(_table(done.stdout)) == [1, 2]


def test_allow_nonfinite_trains_on_and_marked_functions_name_the_gradient(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--steps", "3", "--lr", "1e30", "--allow-nonfinite")
    assert code == 0 and sorted(_table(out)) == [1, 2, 3] and _table(out)[3] == "nan", err
    code, out, err = _run(capsys, "--steps", "3", "--lr", "1e30", "--marked")
    assert code == 2 and "the loss of step 2 is not finite" in err and "non-finite gradient" in err, err


def test_the_origin_of_a_non_finite_loss() -> None:
    model = mlp(num_stages=2, width=8, layers_per_stage=1)
    pipe = Pipeline(model.stages, loss=model.loss, schedule=library("1f1b"))
    params = model.init_stages(jax.random.PRNGKey(0))
    inputs, targets = model.batch(jax.random.PRNGKey(1), 8)
    bad_batch = (inputs.at[3, 1].set(jnp.nan), targets)
    error = nonfinite_origin(pipe, model, params, bad_batch, step=4, marked=False)
    assert isinstance(error, NonFiniteLoss) and error.step == 4 and error.stage is None
    assert "the batch's inputs hold non-finite values" in str(error)
    bad_params = [params[0], jax.tree_util.tree_map(lambda a: a.at[0].set(jnp.inf), params[1])]
    error = nonfinite_origin(pipe, model, bad_params, (inputs, targets), step=4, marked=False)
    assert error.stage == 1 and "stage 1's parameters[0]['b'] were already non-finite" in str(error)
    assert "the update of step 3 made them so" in str(error)
