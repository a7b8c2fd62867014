"""Every option of ``pipedsl run`` takes effect or is refused with a reason, and the
Python API takes what the command line takes, with errors of our own that name the
argument: ``--plan`` against options that would change the plan, ``--checkpoint-every``
without a checkpoint, ``--resume`` against other training settings or with nothing left
to do, the header's device count; ``Pipeline``'s schedule argument, ``train_step``'s
optimizer, a wrong ``opt_state`` and ``check_finite``."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipedsl
from helpers import assert_trees_close
from pipedsl.cli import main
from pipedsl.executor import ExecutionError, Pipeline, Resident
from pipedsl.executor.models import mlp
from pipedsl.simulator import CostModel

RUN = ["run", "1f1b", "-p", "pp=2", "-p", "microbatches=2", "--width", "8", "--layers-per-stage", "1"]

PLANS = """\
rank,kind,schedule,dp,tp,pp,vpp,microbatch_size,microbatches,zero,recompute,step_time_s,tokens_per_s,mfu,bubble,dp_tail_s,memory_bytes_per_gpu,inflight_limit
1,pipeline,1f1b,2,1,2,1,1,2,0,none,1.0,1.0,0.5,0.1,0.0,1000,0
"""


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_refuses_options_that_would_change_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plans = tmp_path / "plans.csv"
    plans.write_text(PLANS)
    for option, value, said in (
        ("--dp", "4", "--dp 4 (the plan has 2)"),
        ("--microbatch-size", "3", "--microbatch-size 3 (the plan has 1)"),
        ("--width", "16", "--width 16 (the plan runs its own model, scaled down)"),
        ("--model", "mlp", "--model mlp (the plan runs its own model, scaled down)"),
    ):
        code, out, err = _run(capsys, "run", "--plan", "1", "--plans", str(plans), option, value, "--steps", "1")
        assert code == 2 and said in err and "would change the plan" in err, (option, err)
        assert "step" not in out
    # The plan's own value is no change.
    code, out, err = _run(capsys, "run", "--plan", "1", "--plans", str(plans), "--dp", "2", "--steps", "1")
    assert code == 0, err
    assert "on 4 cpu devices (2 pipeline devices, each a 2 x 1 mesh" in out


def test_the_header_counts_every_device_the_run_uses(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *RUN, "--model", "transformer", "--dp", "2", "--tp", "2", "--steps", "1")
    assert code == 0, err
    header = out.splitlines()[0]
    assert "2 stages on 8 cpu devices (2 pipeline devices, each a 2 x 2 mesh: dp x tp, zero 0)" in header


def test_tensor_parallel_is_refused_for_a_model_it_would_only_copy(capsys: pytest.CaptureFixture[str]) -> None:
    # The MLP's specs split nothing over the tensor axis: each of the 3 devices would hold it whole.
    for marked in ((), ("--marked",)):
        code, out, err = _run(capsys, *RUN, "--tp", "3", *marked)
        assert code == 2 and "step" not in out
        assert err.strip() == (
            "1f1b: --tp 3: model mlp gives no tensor-parallel layout of its parameters, so every one of the 3"
            " tensor-parallel devices would hold a whole copy; give --model transformer or llama, or --tp 1"
        )


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (("--remat", "--recompute", "none"), "--remat is --recompute full, which --recompute none contradicts"),
        (("--recompute", "selective", "--remat"), "--remat is --recompute full, which --recompute selective"),
        (("--address", "127.0.0.1:1"), "--address names a Ray cluster; use it with --backend ray"),
        (("--fused-attention",), "--fused-attention acts on attention, which the mlp model has none of"),
        (("--recompute", "selective"), "--recompute selective acts on attention, which the mlp model has none of"),
        (("--model", "transformer", "--sequence-parallel"), "--sequence-parallel splits what tensor parallelism"),
    ],
)
def test_options_that_mean_nothing_together_are_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], options: tuple[str, ...], said: str
) -> None:
    code, out, err = _run(capsys, *RUN, *options)
    assert code == 2 and out == ""
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_plan_refuses_how_to_compute_that_it_was_not_priced_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plans = tmp_path / "plans.csv"
    plans.write_text(PLANS)
    plan = ["run", "--plan", "1", "--plans", str(plans), "--steps", "1"]
    for options, said in (
        (("--remat",), "--recompute full (the plan recomputes none)"),
        (("--sequence-parallel",), "--sequence-parallel (the plan runs without it)"),
        (("--precision", "bf16"), "--precision (the plan runs in its model's own)"),
    ):
        code, out, err = _run(capsys, *plan, *options)
        assert code == 2 and out == "", options
        assert said in err and "would change the plan" in err, err
    # The plan's own recompute is no change.
    code, out, err = _run(capsys, *plan, "--recompute", "none")
    assert code == 0, err


def _losses(out: str) -> list[float]:
    """The loss column of a run's step lines, as printed."""
    return [float(line.split()[1]) for line in out.splitlines() if line.split() and line.split()[0].isdigit()]


def test_context_parallel_and_reduce_once_train_as_without_them(capsys: pytest.CaptureFixture[str]) -> None:
    llama = [*RUN[:6], "--model", "llama", "--tp", "2", "--steps", "2"]
    code, plain, err = _run(capsys, *llama)
    assert code == 0, err
    code, split, err = _run(capsys, *llama, "--cp", "2")
    assert code == 0, err
    assert "2 stages on 8 cpu devices (2 pipeline devices, each a 1 x 2 x 2 mesh: dp x cp x tp, zero 0)" in split
    assert len(_losses(plain)) == 2
    # The same training to float32's rounding (printed to six decimals).
    assert _losses(split) == pytest.approx(_losses(plain), rel=1e-5)
    transformer = [*RUN[:6], "--model", "transformer", "--dp", "2", "--zero", "3", "--steps", "2"]
    code, every, err = _run(capsys, *transformer)
    assert code == 0, err
    code, once, err = _run(capsys, *transformer, "--reduce-once")
    assert code == 0, err
    assert "each a 2 x 1 mesh: dp x tp, zero 3, reduced once per step)" in once
    assert _losses(once) == pytest.approx(_losses(every), rel=1e-5)


def test_plans_run_with_their_context_parallel_degree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plans = tmp_path / "plans.csv"
    plans.write_text(PLANS.replace("inflight_limit\n", "inflight_limit,cp\n").replace(",1000,0\n", ",1000,0,2\n"))
    code, out, err = _run(capsys, "run", "--plan", "1", "--plans", str(plans), "--steps", "1")
    assert code == 0, err
    assert "1f1b dp=2 tp=1 cp=2 pp=2" in out and "each a 2 x 2 x 1 mesh: dp x cp x tp" in out
    assert "configuration: schedule=1f1b dp=2 tp=1 cp=2 pp=2" in out
    code, out, err = _run(capsys, "run", "--plan", "1", "--plans", str(plans), "--cp", "4", "--steps", "1")
    assert code == 2 and "--cp 4 (the plan has 2)" in err


def test_plans_run_with_their_sharding_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plans = tmp_path / "plans.csv"
    header = "inflight_limit,reduce_once,reshard_after_forward\n"
    once = PLANS.replace("inflight_limit\n", header).replace(",2,0,none,", ",2,2,none,")
    plans.write_text(once.replace(",1000,0\n", ",1000,0,True,True\n"))
    code, out, err = _run(capsys, "run", "--plan", "1", "--plans", str(plans), "--steps", "1")
    assert code == 0, err
    assert "1f1b dp=2 tp=1 pp=2 mb=1 x2 zero=2 once recompute=none" in out
    assert "zero=2 reduce_once=true" in out
    # A plan without it is not given it; ZeRO 3 keeping its gathered weights is priced, not run.
    plans.write_text(once.replace(",1000,0\n", ",1000,0,False,True\n"))
    code, out, err = _run(capsys, "run", "--plan", "1", "--plans", str(plans), "--reduce-once", "--steps", "1")
    assert code == 2 and "--reduce-once would change the plan" in err
    plans.write_text(once.replace(",2,2,none,", ",2,3,none,").replace(",1000,0\n", ",1000,0,False,False\n"))
    code, out, err = _run(capsys, "run", "--plan", "1", "--plans", str(plans), "--steps", "1")
    assert code == 2 and "zero=3 keep" in err and "which the executor does not do" in err and "step" not in out


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--zero", "1", "--dp", "2", "--reduce-once"], "--reduce-once applies to zero 2 and 3 (zero 1 reduces"),
        (["--cp", "2"], "--cp splits every sequence over a context axis: give --model transformer or llama"),
        (["--cp", "3", "--model", "transformer"], "--cp 3 must divide the model's sequence of 8 tokens"),
        (["--cp", "2", "--model", "transformer", "--backend", "ray"], "--cp 2 runs on the local backend only"),
        (["--cp", "0", "--model", "transformer"], "--cp must be a whole number >= 1, got 0"),
        (["--zero", "4"], "--zero must be a ZeRO stage, one of 0, 1, 2, 3; got 4"),
    ],
)
def test_mesh_options_that_cannot_run_are_refused(
    options: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, *RUN, *options, "--steps", "1")
    assert code == 2 and said in err, err
    assert "step" not in out


def test_checkpoint_every_needs_a_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *RUN, "--checkpoint-every", "2")
    assert code == 2 and "--checkpoint-every says how often to save to --checkpoint DIR" in err
    assert "step" not in out


def test_resume_refuses_other_training_settings_and_says_when_nothing_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(tmp_path / "ckpt")
    base = ["run", "1f1b", "-p", "pp=2", "--width", "8", "--layers-per-stage", "1", "--checkpoint", ckpt]
    saved = {"microbatches": "2", "seed": "0", "lr": "0.002", "size": "8"}

    def options(**change: str) -> list[str]:
        given = {**saved, **change}
        return ["-p", f"microbatches={given['microbatches']}", "--seed", given["seed"], "--lr", given["lr"],
                "--microbatch-size", given["size"]]  # fmt: skip

    code, out, err = _run(capsys, *base, *options(), "--steps", "2")
    assert code == 0, err
    for change, said in (
        ({"microbatches": "4"}, "-p microbatches=2 (this run gives 4)"),
        ({"seed": "3"}, "--seed 0 (this run gives 3)"),
        ({"lr": "0.01"}, "--lr 0.002 (this run gives 0.01)"),
        ({"size": "4"}, "--microbatch-size 8 (this run gives 4)"),
    ):
        code, out, err = _run(capsys, *base, *options(**change), "--steps", "4", "--resume")
        assert code == 2 and said in err and "was trained with" in err, (change, err)
        assert "step" not in out
    code, out, err = _run(capsys, *base, *options(), "--steps", "1", "--resume")
    assert code == 0 and "nothing left to do: " in out and "holds step 2 and --steps is 1" in out, err
    code, out, err = _run(capsys, *base, *options(), "--steps", "3", "--resume")
    assert code == 0 and "after step 2" in out, err


def _stages(count: int = 2) -> tuple[list, list]:
    model = mlp(num_stages=count, width=4, layers_per_stage=1)
    return model.stages, model.init_stages(jax.random.PRNGKey(0))


def _loss(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


def test_pipeline_takes_a_library_name_and_refuses_what_it_cannot_run() -> None:
    stages, _ = _stages(4)
    pipe = Pipeline(stages, loss=_loss, schedule="gpipe")  # its defaults: pp = 4
    assert (pipe.schedule.name, pipe.schedule.num_stages) == ("gpipe", 4)
    with pytest.raises(
        ExecutionError, match=r"schedule must be a Schedule \(pipedsl.load\(...\)\), a Policy, .* got int"
    ):
        Pipeline(stages, loss=_loss, schedule=3)  # type: ignore[arg-type]
    with pytest.raises(ExecutionError, match="costs: schedule 'gpipe' has its order already"):
        Pipeline(stages, loss=_loss, schedule="gpipe", costs=CostModel())
    with pytest.raises(ExecutionError, match="costs must be a cost model .* got dict"):
        Pipeline(stages, loss=_loss, schedule="zb_auto", costs={"forward": 1})  # type: ignore[arg-type]
    with pytest.raises(pipedsl.PipedslError, match="no schedule 'gpip' in the library; did you mean 'gpipe'"):
        Pipeline(stages, loss=_loss, schedule="gpip")


def test_train_step_checks_its_optimizer_state_and_loss() -> None:
    stages, params = _stages()
    pipe = Pipeline(stages, loss=_loss, schedule=pipedsl.load("1f1b", pp=2, microbatches=2))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 4))
    batch = (x, x)
    with pytest.raises(ExecutionError, match="optimizer must be an optax.GradientTransformation .* got NoneType"):
        pipe.train_step(params, None, batch, optimizer=None)  # type: ignore[arg-type]
    adam = optax.adam(1e-3)
    wrong = tuple(optax.sgd(0.1, momentum=0.9).init(p) for p in params)
    params, state, loss = pipe.train_step(params, None, batch, optimizer=adam)
    with pytest.raises(ExecutionError, match=r"opt_state\[0\] \(the optimizer state of stage 0\) is not what"):
        pipe.train_step(params, wrong, batch, optimizer=adam)
    # Refused before any device updated anything: the parameters' handle is still good.
    nan_batch = (x * jnp.nan, x)
    params, state, loss = pipe.train_step(params, None, nan_batch, optimizer=adam)
    assert np.isnan(loss)  # without the check a NaN passes, as before
    with pytest.raises(ExecutionError, match=r"the loss is nan \(check_finite=True\)"):
        pipe.train_step(params, state, nan_batch, optimizer=adam, check_finite=True)


def test_state_stays_on_the_devices_as_handles_and_the_loss_as_a_device_array() -> None:
    stages, params = _stages()
    pipe = Pipeline(stages, loss=_loss, schedule=pipedsl.load("1f1b", pp=2, microbatches=2))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 4))
    batch = (x, x)
    loss, grads = pipe.value_and_grad(params, batch)
    # The loss is not waited for (read when it is read); the gradients come back as numpy.
    assert isinstance(loss, jax.Array) and loss.shape == ()
    assert all(isinstance(g, np.ndarray) for g in jax.tree_util.tree_leaves(grads))
    sgd = optax.sgd(0.1)
    held, state, _ = pipe.train_step(params, None, batch, optimizer=sgd)
    assert isinstance(held, Resident) and isinstance(state, Resident)
    # A handle computes the same step as the values it stands for.
    values = pipe.gather(held)
    assert all(isinstance(v, np.ndarray) for v in jax.tree_util.tree_leaves(values))
    np.testing.assert_allclose(pipe.value_and_grad(held, batch)[0], pipe.value_and_grad(values, batch)[0], rtol=1e-6)
    expected = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    assert_trees_close(values, expected, atol=1e-6)
    # Other arrays replace the one copy the devices hold: the handle is then out of date.
    newer, state, _ = pipe.train_step(values, state, batch, optimizer=sgd)
    with pytest.raises(ExecutionError, match="this params handle is out of date"):
        pipe.train_step(held, state, batch, optimizer=sgd)
    # A batch of other shapes recompiles the stages and keeps the state the devices hold.
    before = pipe.gather(newer)
    pipe.value_and_grad(newer, (jnp.concatenate([x, x]), jnp.concatenate([x, x])))
    assert_trees_close(pipe.gather(newer), before)
    other = Pipeline(stages, loss=_loss, schedule=pipedsl.load("1f1b", pp=2, microbatches=2))
    with pytest.raises(ExecutionError, match="held by another pipeline"):
        other.value_and_grad(newer, batch)
    made = other.init(mlp(num_stages=2, width=4, layers_per_stage=1).init_stages, jax.random.PRNGKey(0), batch=batch)
    assert_trees_close(other.gather(made), params)
