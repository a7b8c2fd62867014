"""The Ray world's state and faults on a four-node Ray cluster on this machine
(``tests/ray/conftest.py``): a killed process, a recorded step, a stage that raises, the
command line on a plan whose meshes span nodes (each in a world its pipeline starts), then
parameters made in the world and checkpoints per shard (pipelines on one world, in turn).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
import ray.cloudpickle
from ray.cluster_utils import Cluster

from helpers import (
    ADAM,
    HYBRID_ADAM,
    RAY_CONFIG,
    RAY_MARKS,
    assert_relative_close,
    assert_saved_params,
    hybrid,
    hybrid_problem,
    hybrid_schedule,
    library,
    pipeline,
    ray_runner,
)
from helpers import setup as reference
from pipedsl.executor import ExecutionError
from pipedsl.executor.backend import Resident
from pipedsl.executor.ray.cluster import DeviceLost, RayWorld
from pipedsl.run_options import RunOptions

pytestmark = RAY_MARKS

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROOT = Path(__file__).parents[2]


# -- faults ---------------------------------------------------------------------------

FLAGS = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pipedsl-test-world-{os.getpid()}")


def _hold(x: np.ndarray) -> np.ndarray:
    # Says it is running, then holds the step while the flag is there.
    open(os.path.join(FLAGS, "running"), "w").close()
    while os.path.exists(os.path.join(FLAGS, "hold")):
        time.sleep(0.01)
    return x


def _on_host(x: jax.Array) -> jax.Array:
    return jax.pure_callback(_hold, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _held_stage(p: jax.Array, x: jax.Array) -> jax.Array:
    # The identity through the host on the way forward; built per call, as a custom_vjp
    # object does not survive pickling by value.
    hook = jax.custom_vjp(_on_host)
    hook.defvjp(lambda x: (_on_host(x), None), lambda _, g: (g,))
    return jax.numpy.tanh(hook(x) @ p)


def _dense(p: jax.Array, x: jax.Array) -> jax.Array:
    return jax.numpy.tanh(x @ p)


def _mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jax.numpy.mean((y - t) ** 2)


def test_a_killed_process_ends_the_step_with_device_lost(cluster: Cluster) -> None:
    from pipedsl.executor import Pipeline

    os.makedirs(FLAGS, exist_ok=True)
    open(os.path.join(FLAGS, "hold"), "w").close()
    key = jax.random.PRNGKey(0)
    params = [jax.random.normal(k, (8, 8)) / 8**0.5 for k in jax.random.split(key, 2)]
    x = jax.random.normal(key, (8, 8))
    batch = (x, jax.numpy.sin(x))
    schedule = library("1f1b")
    pipe = Pipeline([_dense, _held_stage], loss=_mse, schedule=schedule, backend=RAY_CONFIG)
    pids = [node.pid for node in ray_runner(pipe).world.nodes]
    outcome: list[BaseException] = []

    def step() -> None:
        try:
            pipe.step(params, batch)
        except BaseException as err:  # handed to the test thread
            outcome.append(err)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(os.path.join(FLAGS, "running")):
            assert not outcome, outcome
            assert time.monotonic() < deadline, "the step never started"
            time.sleep(0.05)
        killed = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive(), "no DeviceLost within 60 s"
        assert time.monotonic() - killed < 60
        (err,) = outcome
        assert isinstance(err, DeviceLost)
        assert err.node is not None and err.node.pid == pids[0] and err.stage == 0
        assert f"pid {pids[0]}" in str(err) and "stage 0" in str(err)
        for pid in pids:
            _wait_gone(pid, within=30)
        with pytest.raises(ExecutionError, match="torn down"):
            pipe.step(params, batch)
    finally:
        for name in ("hold", "running"):
            if os.path.exists(os.path.join(FLAGS, name)):
                os.unlink(os.path.join(FLAGS, name))
        pipe.close()
    params2, batch2, ref_loss, ref_grads = reference("mlp", "explicit", 2)
    with pipeline("mlp", "explicit", schedule, backend=RAY_CONFIG) as fresh:
        result = fresh.step(params2, batch2)
    assert_relative_close(result.loss, ref_loss)


def _wait_gone(pid: int, *, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:  # a child of this process that exited waits to be reaped
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:
            pass
        assert time.monotonic() < deadline, f"process {pid} is still there"
        time.sleep(0.05)


def test_a_recorded_step_times_every_action_of_every_device(cluster: Cluster) -> None:
    schedule = library("1f1b")
    params, batch, ref_loss, _ = reference("mlp", "explicit", schedule.num_stages)
    with pipeline("mlp", "explicit", schedule, backend=RAY_CONFIG) as pipe:
        result = pipe.step(params, batch, record=True)
        sends = [i for dev in pipe.program.devices for i in dev.instructions if type(i).__name__ == "Send"]
    assert result.timeline is not None and result.timeline.origin == "measured"
    frame = result.timeline.to_dataframe()
    computes = frame[frame.kind != "send"]
    assert len(computes) == schedule.num_actions
    assert (frame.kind == "send").sum() == len(sends)
    assert (frame.end >= frame.start).all() and (frame.start >= 0).all()
    # Within a device, recorded actions do not overlap and keep the program's order.
    for device, rows in computes.groupby("device"):
        order = [f"{s}{k}{m}" for s, k, m in zip(rows.stage, rows.kind, rows.microbatch, strict=True)]
        assert order == [str(a) for a in schedule.orders[device]]
        assert (rows.start.to_numpy()[1:] >= rows.end.to_numpy()[:-1]).all()
    assert_relative_close(result.loss, ref_loss)


def _refuse(x: np.ndarray) -> np.ndarray:
    raise ValueError(f"a row of {x.shape[-1]} values where this stage takes 3")


def _checked(x: jax.Array) -> jax.Array:
    return jax.pure_callback(_refuse, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _refusing_stage(p: jax.Array, x: jax.Array) -> jax.Array:
    # Fails where it runs, inside the world (compiling succeeds); the identity's custom_vjp
    # is built per call, as _held_stage's.
    hook = jax.custom_vjp(_checked)
    hook.defvjp(lambda x: (_checked(x), None), lambda _, g: (g,))
    return jax.numpy.tanh(hook(x) @ p)


def test_a_stage_that_raises_names_the_stage_and_ends_the_world(cluster: Cluster) -> None:
    from pipedsl.executor import Pipeline

    key = jax.random.PRNGKey(0)
    params = [jax.random.normal(k, (8, 8)) / 8**0.5 for k in jax.random.split(key, 2)]
    x = jax.random.normal(key, (8, 8))
    schedule = library("1f1b")
    pipe = Pipeline([_dense, _refusing_stage], loss=_mse, schedule=schedule, backend=RAY_CONFIG)
    pids = [node.pid for node in ray_runner(pipe).world.nodes]
    try:
        with pytest.raises(ExecutionError) as caught:
            pipe.step(params, (x, jax.numpy.sin(x)))
        err = caught.value
        assert not isinstance(err, DeviceLost)  # the stage's own error, not a timeout
        assert err.stage == 1 and "stage 1" in str(err)
        assert "a row of 8 values where this stage takes 3" in str(err) and "torn down" in str(err)
        for pid in pids:
            _wait_gone(pid, within=30)
        with pytest.raises(ExecutionError, match="torn down"):
            pipe.step(params, (x, x))
    finally:
        pipe.close()
    params2, batch2, ref_loss, _ = reference("mlp", "explicit", 2)
    with pipeline("mlp", "explicit", schedule, backend=RAY_CONFIG) as fresh:
        assert_relative_close(fresh.step(params2, batch2).loss, ref_loss)


def test_cli_runs_a_searched_plan_whose_meshes_span_nodes(cluster: Cluster, tmp_path: Path) -> None:
    # One row as `pipedsl search --csv` writes it: 1F1B, dp 2 over two processes per stage.
    plans = tmp_path / "plans.csv"
    columns = "rank,kind,schedule,dp,tp,pp,vpp,microbatches,microbatch_size,zero,step_time_s"
    plans.write_text(f"{columns}\n1,hybrid,1f1b,2,1,2,1,2,1,0,0.01\n")
    command = [sys.executable, "-m", "pipedsl", "run", "--plan", "1", "--plans", str(plans), "--steps", "2"]
    command += ["--backend", "ray", "--address", cluster.address]
    # This process's Ray settings (loopback, the cluster's authentication) go along.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "plan 1 of" in done.stdout
    losses = re.findall(r"^\s*\d+\s+([0-9.]+)\s+[0-9.]+ ms", done.stdout, re.MULTILINE)
    assert len(losses) >= 2 and all(float(v) > 0 for v in losses), done.stdout
    assert "Traceback" not in done.stderr


# -- state, on one world (it holds the cluster's four CPUs: these tests come last) -------


def test_parameters_made_in_the_world(worlds: Callable[[int, int], RayWorld]) -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    m, _, batch, _, _ = hybrid_problem("explicit", 2, 2)
    key = jax.random.PRNGKey(5)
    made = m.init_stages(key)
    ref_loss, ref_grads = jax.jit(
        jax.value_and_grad(lambda p, x, t: m.loss(m.stages[1](p[1], m.stages[0](p[0], x)), t))
    )(made, *batch)
    with hybrid("explicit", schedule, dp=2, tp=1, zero=3, backend=worlds(4, 1)) as pipe:
        held = pipe.init(m.init_stages, key, batch=batch)
        assert isinstance(held, Resident)
        result = pipe.step(held, batch)
        assert_relative_close(pipe.gather(held), made)
    assert_relative_close(result.loss, ref_loss)
    assert_relative_close(result.grads, ref_grads)


def test_checkpoint_of_devices_each_in_a_process_after_the_one_program(
    worlds: Callable[[int, int], RayWorld], tmp_path: Path
) -> None:
    # A process per pipeline device, the steps one program over the stage axis: each
    # process writes its device's checkpoint alone, from the values the program last made.
    schedule = library("zb_h1", pp=4)
    params, batch, _, _ = reference("mlp", "explicit", schedule.num_stages)
    options = RunOptions(ticks=True)
    world = worlds(4, 1)
    with pipeline("mlp", "explicit", schedule, backend=world, options=options) as pipe:
        held, state, _ = pipe.train_step(params, None, batch, optimizer=ADAM)
        held, state, _ = pipe.train_step(held, state, batch, optimizer=ADAM)
        assert pipe.ticked
        version = pipe.save(str(tmp_path), step=2)
        saved = pipe.gather(held)
        held, state, loss = pipe.train_step(held, state, batch, optimizer=ADAM)
        expected_loss, expected = float(loss), pipe.gather(held)
    assert_saved_params(version, saved)
    with pipeline("mlp", "explicit", schedule, backend=world, options=options) as again:
        held, state, step = again.restore(str(tmp_path), like_params=params, batch=batch, optimizer=ADAM)
        held, state, loss = again.train_step(held, state, batch, optimizer=ADAM)
        assert step == 2
        assert float(loss) == expected_loss
        jax.tree_util.tree_map(np.testing.assert_array_equal, again.gather(held), expected)
    # And one process (the local backend, tasks apart) resumes it as well.
    with pipeline("mlp", "explicit", schedule) as local:
        held, state, _ = local.restore(str(tmp_path), like_params=params, batch=batch, optimizer=ADAM)
        held, state, loss = local.train_step(held, state, batch, optimizer=ADAM)
        assert_relative_close(float(loss), expected_loss)
        assert_relative_close(local.gather(held), expected)


def test_checkpoint_per_shard_resumes_on_the_same_plan_and_on_another(
    worlds: Callable[[int, int], RayWorld], tmp_path: Path
) -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", 2, 2)
    # The plan's two pipelines run on the world the tests before used, each after the last one
    # closed and its processes forgot its state.
    world = worlds(4, 1)
    with hybrid("explicit", schedule, dp=2, tp=1, zero=1, backend=world) as pipe:
        held, state, _ = pipe.train_step(params, None, batch, optimizer=HYBRID_ADAM)
        version = pipe.save(str(tmp_path), step=1)
        saved_params = pipe.gather(held)
        held, state, _ = pipe.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        pipe.save(str(tmp_path), step=2)
        held, state, expected_loss = pipe.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        expected = pipe.gather(held)
    # Every pipeline device's processes wrote their part, an orbax checkpoint that orbax
    # alone reads back here, outside the world.
    assert sorted(p.name for p in Path(version).iterdir()) == ["device-0", "device-1", "plan.json"]
    assert_saved_params(version, saved_params)
    # A copy of the latest version missing a device's part, for the last check below.
    broken = tmp_path.parent / f"{tmp_path.name}-broken"
    shutil.copytree(tmp_path / "step-2", broken / "step-2")
    shutil.rmtree(broken / "step-2" / "device-1")
    with hybrid("explicit", schedule, dp=2, tp=1, zero=1, backend=world) as again:
        held, state, step = again.restore(str(tmp_path), like_params=params, batch=batch, optimizer=HYBRID_ADAM)
        assert step == 2 and isinstance(state, Resident)
        held, state, loss = again.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        assert_relative_close(loss, expected_loss)
        assert_relative_close(again.gather(held), expected)
        # A version missing a device's part is reported by the processes that read it (in
        # this world, the last thing it does: a failed call ends it).
        with pytest.raises(ExecutionError, match=r"device 1 could not read .*step-2/device-1"):
            again.restore(str(broken), like_params=params, batch=batch, optimizer=HYBRID_ADAM)
    # What four processes wrote, one process reads onto another plan (no data parallelism,
    # no ZeRO), each array into its own sharding.
    with hybrid("explicit", schedule, dp=1, tp=1, zero=0) as other:
        held, state, step = other.restore(str(tmp_path), like_params=params, batch=batch, optimizer=HYBRID_ADAM)
        held, state, loss = other.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        assert step == 2
        assert_relative_close(loss, expected_loss)
        assert_relative_close(other.gather(held), expected)
