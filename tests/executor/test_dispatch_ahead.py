"""A step the host never waits on: no device-to-host copy, dispatch runs ahead of the devices,
and the whole step as one program (where the pipeline devices share their JAX devices)
computes what the step dispatched action by action computes; on Ray, a training step's loss
stays in the world until it is read."""

from __future__ import annotations

import os

# The Ray test starts a local instance: on loopback, as pipedsl keeps the instances it
# starts (Ray reads the variable when it is imported).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import pipedsl  # noqa: E402
from helpers import (  # noqa: E402
    ADAM,
    RAY_CONFIG,
    assert_trees_close,
    library,
    model,
    pipeline,
    reference_training,
    setup,
)
from pipedsl.executor import NonFiniteStep, Pipeline  # noqa: E402
from pipedsl.executor.compilation_cache import CACHE_ENV, cache_folder  # noqa: E402
from pipedsl.executor.ray.remote_loss import RemoteLoss  # noqa: E402
from pipedsl.run_options import Fuse, RunOptions  # noqa: E402

WIDTH = 256


def _heavy(p: jax.Array, x: jax.Array) -> jax.Array:
    # Enough matrix work per action that a step takes far longer than its dispatch.
    for _ in range(24):
        x = jnp.tanh(x @ p)
    return x


def _mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


@pytest.mark.parametrize("fuse", ["loop", "unrolled", "off"])
def test_train_steps_copy_nothing_to_the_host_and_return_before_the_devices_finish(fuse: Fuse) -> None:
    device = jax.devices()[0]
    pipe = Pipeline(
        [_heavy, _heavy],
        loss=_mse,
        schedule=pipedsl.load("1f1b", pp=2, microbatches=4),
        devices=[device, device],
        options=RunOptions(fuse=fuse),
    )
    params = [jnp.eye(WIDTH) * 0.5, jnp.eye(WIDTH) * 0.5]
    # Host arrays: the batch goes in (host to device), nothing comes out.
    x = np.ones((256, WIDTH), np.float32)
    batch = (x, x * 0.5)
    optimizer = optax.sgd(1e-3)
    params, state, loss = pipe.train_step(params, None, batch, optimizer=optimizer)  # compiles
    jax.block_until_ready(loss)
    with jax.transfer_guard_device_to_host("disallow"):
        for _ in range(10):
            params, state, loss = pipe.train_step(params, state, batch, optimizer=optimizer)
        # Each step is tens of milliseconds of matrix work and its dispatch a fraction of a
        # millisecond: had any call waited for the devices, the last step would be done.
        assert not loss.is_ready()
    pipe.block_until_ready()  # every update done: what the devices hold is computed
    assert all(leaf.is_ready() for w in pipe.backend.workers for leaf in jax.tree_util.tree_leaves(w.leaves))
    assert np.isfinite(float(loss))


@pytest.mark.parametrize(
    "options",
    [RunOptions(ticks=True), RunOptions(ticks=False, host_transfers=False)],
    ids=["one-program-over-the-stage-axis", "tasks-apart-copied"],
)
def test_separate_devices_run_ahead_on_the_accelerators_path(options: RunOptions) -> None:
    # A JAX device per pipeline device: as one SPMD program over the pipeline devices (the
    # default on accelerators), or task by task with every value copied between them as on accelerators (no
    # hand-over through host memory), ten steps are dispatched while the devices still compute
    # the first ones, nothing comes to the host, and they train as the tasks apart by host do.
    schedule = pipedsl.load("1f1b", pp=4, microbatches=8)
    params = [jnp.eye(WIDTH) * 0.5] * 4
    x = np.ones((256, WIDTH), np.float32)
    batch = (x, x * 0.5)
    optimizer = optax.sgd(1e-3)
    trained = []
    for run_ahead in (options, RunOptions()):
        pipe = Pipeline([_heavy] * 4, loss=_mse, schedule=schedule, options=run_ahead)
        assert len({d for m in pipe.backend.meshes for d in m.devices.flat}) == 4
        held, state, loss = pipe.train_step(params, None, batch, optimizer=optimizer)  # compiles
        assert pipe.backend.ticked == bool(run_ahead.ticks)
        jax.block_until_ready(loss)
        if run_ahead is options:
            with jax.transfer_guard_device_to_host("disallow"):
                for _ in range(10):
                    held, state, loss = pipe.train_step(held, state, batch, optimizer=optimizer)
                assert not loss.is_ready()
        else:
            for _ in range(10):
                held, state, loss = pipe.train_step(held, state, batch, optimizer=optimizer)
        trained.append((pipe.gather(held), float(loss)))
    (ahead, ahead_loss), (by_host, by_host_loss) = trained
    assert_trees_close(ahead, by_host)
    assert ahead_loss == pytest.approx(by_host_loss, rel=1e-6)


@pytest.mark.ray
@pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")
def test_ray_train_steps_keep_their_losses_in_the_world_until_read() -> None:
    schedule = library("1f1b")
    m = model("mlp", schedule.num_stages)
    params, batch, _, _ = setup("mlp", "explicit", schedule.num_stages)
    optimizer = optax.sgd(1e-2)
    local = Pipeline(m.stages, loss=m.loss, schedule=schedule)
    expected = []
    held, state = params, None
    for _ in range(10):
        held, state, loss = local.train_step(held, state, batch, optimizer=optimizer)
        expected.append(float(loss))
    with Pipeline(m.stages, loss=m.loss, schedule=schedule, backend=RAY_CONFIG) as pipe:
        held, state, losses = params, None, []
        for _ in range(10):
            held, state, loss = pipe.train_step(held, state, batch, optimizer=optimizer)
            losses.append(loss)
        # Each step returned once the world had dispatched it: no loss came to the host.
        assert all(isinstance(x, RemoteLoss) and not x.fetched for x in losses)
        pipe.block_until_ready()
        assert all(x.is_ready() for x in losses)
        # Read in any order, each is its own step's, as on the local backend.
        for x, want in reversed(list(zip(losses, expected, strict=True))):
            np.testing.assert_allclose(float(x), want, rtol=1e-5)
        assert all(x.fetched for x in losses)
        # A step whose gradients come back ships its loss with them.
        assert isinstance(pipe.step(held, batch).loss, np.ndarray)


@pytest.mark.parametrize(
    ("name", "fuse"),
    [("1f1b", "loop"), ("zb_h1", "loop"), ("interleaved_1f1b", "loop"), ("zb_h1", "unrolled")],
)
def test_one_program_computes_what_the_actions_apart_compute(name: str, fuse: Fuse) -> None:
    schedule = library(name)
    params, batch, ref_loss, ref_grads = setup("transformer", "explicit", schedule.num_stages)
    shared = [jax.devices()[0]] * schedule.num_devices
    fused = pipeline("transformer", "explicit", schedule, devices=shared, options=RunOptions(fuse=fuse))
    apart = pipeline("transformer", "explicit", schedule, devices=shared, options=RunOptions(fuse="off"))
    assert fused.backend.fuse == fuse
    one, each = fused.step(params, batch), apart.step(params, batch)
    np.testing.assert_allclose(float(one.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(one.grads, ref_grads)
    assert_trees_close(one.grads, each.grads)
    # What the devices report besides values is read while the program is traced: the
    # loop holds one microbatch's residuals of each local stage at a time, the unrolled
    # program what the schedule holds.
    held = tuple(len(d.stages) for d in fused.program.devices) if fuse == "loop" else each.peak_held
    assert one.peak_held == held and one.leftover == each.leftover == ((),) * schedule.num_devices


def test_one_program_trains_a_tied_model_as_one_device_does() -> None:
    # The marked transformer's embedding is read by the first and the last stage: its
    # gradient is summed on its owner and the updated leaf handed to the other user.
    schedule = library("zbv")
    params, batch, _, _ = setup("transformer", "marked", schedule.num_stages)
    pipe = pipeline("transformer", "marked", schedule, devices=[jax.devices()[0]] * schedule.num_devices)
    assert pipe.backend.fuse == "loop"
    held, state = params, None
    for ref_params, ref_loss in reference_training("marked", schedule.num_stages, steps=3):
        held, state, loss = pipe.train_step(held, state, batch, optimizer=ADAM)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(pipe.gather(held), ref_params, atol=5e-6)
    # A gathered optimizer state goes back in, as on the path dispatched action by action.
    held, state, loss = pipe.train_step(held, pipe.gather(state), batch, optimizer=ADAM)
    assert np.isfinite(float(loss))


def test_one_program_clips_by_the_whole_models_norm() -> None:
    schedule = library("1f1b")
    m = model("mlp", schedule.num_stages)
    params, batch, _, _ = setup("mlp", "explicit", schedule.num_stages)
    clipped = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
    shared = [jax.devices()[0]] * schedule.num_devices

    def trained(fuse: Fuse) -> Any:
        pipe = Pipeline(m.stages, loss=m.loss, schedule=schedule, devices=shared, options=RunOptions(fuse=fuse))
        held, _, _ = pipe.train_step(params, None, batch, optimizer=clipped)
        return pipe.gather(held)

    apart = trained("off")
    assert_trees_close(trained("loop"), apart)
    assert_trees_close(trained("unrolled"), apart)


def test_separate_devices_run_over_the_stage_axis_and_one_pipeline_device_as_one_program() -> None:
    schedule = library("1f1b")
    params, batch, _, _ = setup("mlp", "explicit", schedule.num_stages)
    # The tasks run apart unless the one program is asked for (RunOptions.ticks).
    for options in (RunOptions(), RunOptions(ticks=True)):
        separate = pipeline("mlp", "explicit", schedule, options=options)
        separate.step(params, batch)
        assert separate.backend.fuse == "off" and separate.ticked == options.ticks
    # pp = 1 (an SPMD plan): nothing waits for another device, so its step is one program.
    spmd = library("1f1b", pp=1)
    assert pipeline("mlp", "explicit", spmd, devices=[jax.devices()[0]]).backend.fuse == "loop"


def test_one_pipeline_device_as_one_program_trains_as_dispatched_apart() -> None:
    m = model("mlp", 1)
    params, batch, _, _ = setup("mlp", "explicit", 1)
    spmd = library("1f1b", pp=1, microbatches=4)

    def trained(fuse: Fuse) -> Any:
        pipe = Pipeline(m.stages, loss=m.loss, schedule=spmd, devices=jax.devices()[:1], options=RunOptions(fuse=fuse))
        held, _, loss = pipe.train_step(params, None, batch, optimizer=optax.adam(1e-2))
        return pipe.gather(held), float(loss)

    (fused, fused_loss), (apart, apart_loss) = trained("loop"), trained("off")
    assert_trees_close(fused, apart)
    assert fused_loss == pytest.approx(apart_loss, rel=1e-6)


def test_a_pipeline_says_whether_its_step_runs_as_one_program() -> None:
    m = model("mlp", 2)
    schedule = library("1f1b", pp=2, microbatches=4)
    one = jax.devices()[:1]

    def pipeline(devices: Any, fuse: Fuse = "loop") -> Pipeline:
        return Pipeline(m.stages, loss=m.loss, schedule=schedule, devices=devices, options=RunOptions(fuse=fuse))

    assert pipeline(one * 2).one_program  # both pipeline devices on one device
    assert not pipeline(one * 2, "off").one_program
    assert not pipeline(None).one_program  # a device each: each waits for the other (Pipeline.ticked)


def test_the_compilation_cache_folder_follows_its_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert cache_folder() == tmp_path / "cache"
    for off in ("off", "0", "none", ""):
        monkeypatch.setenv(CACHE_ENV, off)
        assert cache_folder() is None
    monkeypatch.delenv(CACHE_ENV)
    # Unset, the folder JAX was given wins (the test session gives one), else the user's cache.
    given = jax.config.jax_compilation_cache_dir
    if given:
        assert cache_folder() == type(tmp_path)(given)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert cache_folder() == tmp_path / "xdg" / "pipedsl" / "jax"
    finally:
        jax.config.update("jax_compilation_cache_dir", given)


@pytest.mark.parametrize("shared", [True, False], ids=["one-program", "devices-of-their-own"])
def test_a_non_finite_step_keeps_the_parameters_on_the_devices(shared: bool) -> None:
    schedule = library("1f1b")
    m = model("mlp", schedule.num_stages)
    params, (x, t), _, _ = setup("mlp", "explicit", schedule.num_stages)
    devices = [jax.devices()[0]] * schedule.num_devices if shared else None
    pipe = Pipeline(m.stages, loss=m.loss, schedule=schedule, devices=devices)
    held, state, _ = pipe.train_step(params, None, (x, t), optimizer=ADAM)
    before, state_before = pipe.gather(held), pipe.gather(state)
    nan_batch = (x * jnp.nan, t)
    held, state, loss = pipe.train_step(held, state, nan_batch, optimizer=ADAM, skip_nonfinite=True)
    assert np.isnan(float(loss))
    assert_trees_close(pipe.gather(held), before, atol=0.0)
    assert_trees_close(pipe.gather(state), state_before, atol=0.0)
    with pytest.raises(
        NonFiniteStep, match=r"the loss is nan \(check_finite=True\); the step's update was skipped"
    ) as info:
        pipe.train_step(held, state, nan_batch, optimizer=ADAM, check_finite=True)
    assert_trees_close(pipe.gather(info.value.params), before, atol=0.0)
    # A finite step after it updates as usual.
    held, _, loss = pipe.train_step(
        info.value.params, info.value.opt_state, (x, t), optimizer=ADAM, skip_nonfinite=True
    )
    assert np.isfinite(float(loss))
    assert not np.allclose(jax.tree_util.tree_leaves(pipe.gather(held))[0], jax.tree_util.tree_leaves(before)[0])


def test_what_an_update_makes_for_the_next_step_never_enters_a_traced_program() -> None:
    # A recorded step is dispatched apart and its update makes what the next step starts
    # with; the next unrecorded step on shared devices is traced into one program, which
    # must read the parameters it is given, not take the values made before (here the bf16
    # copy of the parameters) as constants.
    schedule = library("1f1b")
    m = model("mlp", schedule.num_stages)
    params, batch, _, _ = setup("mlp", "explicit", schedule.num_stages)
    shared = [jax.devices()[0]] * schedule.num_devices
    optimizer = optax.sgd(0.1)

    def trained(fuse: Fuse) -> Any:
        options = RunOptions(fuse=fuse, precision="bf16")
        pipe = Pipeline(m.stages, loss=m.loss, schedule=schedule, devices=shared, options=options)
        result = pipe.step(params, batch, optimizer=optimizer, record=True)
        held, state = result.params, result.opt_state
        for _ in range(2):
            held, state, _ = pipe.train_step(held, state, batch, optimizer=optimizer)
        return pipe.gather(held)

    assert_trees_close(trained("unrolled"), trained("off"))
