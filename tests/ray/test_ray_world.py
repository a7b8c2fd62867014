"""The Ray backend's jax.distributed world on a four-node Ray cluster on this machine.

One cluster per module (a head and three nodes, one CPU each, all on 127.0.0.1): every
process of a world reserves one CPU, so four processes land on four nodes, and a stage
mesh of dp = 2 over two processes spans two nodes. Each plan is checked against one-device
``jax.value_and_grad`` (relative error below 1e-5, float32).
"""

from __future__ import annotations

import os

# The test starts the cluster itself, so it keeps it on loopback the way pipedsl keeps
# the local instances it starts; Ray reads the variable when it is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from helpers import (  # noqa: E402
    HYBRID_ADAM,
    LIBRARY,
    assert_relative_close,
    hybrid,
    hybrid_problem,
    hybrid_reference_adam,
    hybrid_schedule,
    library,
    pipeline,
    zb_auto,
)
from helpers import setup as reference  # noqa: E402
from pipedsl.executor import ExecutionError  # noqa: E402
from pipedsl.executor.ray_backend import RayRunner, Resident  # noqa: E402
from pipedsl.executor.ray_cluster import DeviceLost, RayConfig, connect, disconnect  # noqa: E402
from pipedsl.executor.ray_transport import worker_exchanges  # noqa: E402
from pipedsl.rendezvous import exchange_order  # noqa: E402
from pipedsl.validate import peak_inflight  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    # The cluster's processes are started from this process, after JAX has started its
    # threads; Ray execs right after forking, which is safe.
    pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning"),
]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROOT = Path(__file__).parents[2]
CONFIG = RayConfig(step_timeout=240, start_timeout=120)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    head = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(3):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    connect(cluster.address)
    try:
        yield cluster
    finally:
        disconnect()
        ray.shutdown()
        cluster.shutdown()


def _runner(pipe: object) -> RayRunner:
    backend = pipe.backend  # type: ignore[attr-defined]
    assert isinstance(backend, RayRunner)
    return backend


def _nodes_of(pipe: object) -> list[set[str]]:
    return [{slot.node_id for slot in mesh} for mesh in pipe.placement()]  # type: ignore[attr-defined]


def _check_transfers(pipe: object) -> None:
    """Every transfer of the step was a collective made by the processes of both meshes:
    no value reached a stage by another way (there is none left: a receive is answered
    only by a collective)."""
    runner = _runner(pipe)
    per = len(runner.ranks(0))
    installed = runner._installed
    assert installed is not None
    order = exchange_order(runner.program) + worker_exchanges(
        installed.model, runner.program.schedule.placement, update=False
    )
    expected = [0] * runner.world.num_processes
    for e in order:
        for d in (e.src, e.dst):
            for r in runner.ranks(d):
                expected[r] += 1
    assert runner.transfers == tuple(expected)
    assert sum(runner.transfers) == 2 * per * len(order)


def test_spmd_dp4_over_four_processes(cluster: Cluster) -> None:
    schedule = hybrid_schedule("1f1b", 1, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("explicit", 1, 4)
    with hybrid("explicit", schedule, dp=4, tp=1, zero=0, backend=CONFIG) as pipe:
        loss, grads = pipe.value_and_grad(params, batch)
        assert len(_nodes_of(pipe)[0]) == 4
    assert_relative_close(loss, ref_loss)
    assert_relative_close(grads, ref_grads)


def test_1f1b_dp2_pp2_meshes_across_nodes(cluster: Cluster) -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("marked", 2, 2)
    with hybrid("marked", schedule, dp=2, tp=1, zero=0, backend=CONFIG) as pipe:
        loss, grads = pipe.value_and_grad(params, batch)
        assert [len(nodes) for nodes in _nodes_of(pipe)] == [2, 2]
        _check_transfers(pipe)
    assert_relative_close(loss, ref_loss)
    assert_relative_close(grads, ref_grads)


def test_zb_h1_dp2_tp2_pp2_tp_inside_a_process(cluster: Cluster) -> None:
    schedule = hybrid_schedule("zb_h1", 2, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("explicit", 2, 2)
    config = RayConfig(devices_per_process=2, step_timeout=240, start_timeout=120)
    with hybrid("explicit", schedule, dp=2, tp=2, zero=0, backend=config) as pipe:
        loss, grads = pipe.value_and_grad(params, batch)
        placement = pipe.placement()
        _check_transfers(pipe)
    # Each mesh row (the tp pair) is one process; the two rows are two processes on two nodes.
    for mesh in placement:
        rows = [mesh[0:2], mesh[2:4]]
        assert all(len({slot.process_id for slot in row}) == 1 for row in rows)
        assert rows[0][0].process_id != rows[1][0].process_id
        assert rows[0][0].node_id != rows[1][0].node_id
    assert_relative_close(loss, ref_loss)
    assert_relative_close(grads, ref_grads)


def test_interleaved_1f1b_pp4_one_process_per_device(cluster: Cluster) -> None:
    schedule = hybrid_schedule("interleaved_1f1b", 4, 2)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("marked", schedule.num_stages, 1)
    with hybrid("marked", schedule, dp=1, tp=1, zero=0, backend=CONFIG) as pipe:
        loss, grads = pipe.value_and_grad(params, batch)
        assert len({next(iter(nodes)) for nodes in _nodes_of(pipe)}) == 4
        _check_transfers(pipe)
    assert_relative_close(loss, ref_loss)
    assert_relative_close(grads, ref_grads)


def test_zbv_zero3_across_nodes_trains_as_optax_on_one_device(cluster: Cluster) -> None:
    schedule = hybrid_schedule("zbv", 2, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("explicit", schedule.num_stages, 2)
    expected = hybrid_reference_adam("explicit", schedule.num_stages, 2, steps=2)
    with hybrid("explicit", schedule, dp=2, tp=1, zero=3, backend=CONFIG) as pipe:
        loss, grads = pipe.value_and_grad(params, batch)
        assert_relative_close(loss, ref_loss)
        assert_relative_close(grads, ref_grads)
        state = None
        held = params
        for want_params, want_loss in expected:
            held, state, loss = pipe.train_step(held, state, batch, optimizer=HYBRID_ADAM)
            assert isinstance(held, Resident) and isinstance(state, Resident)
            assert_relative_close(loss, want_loss)
        assert_relative_close(pipe.gather(held), want_params)
        gathered = pipe.gather(state)
        assert len(gathered) == schedule.num_stages


@pytest.mark.parametrize("name", [*LIBRARY, "zb_auto"])
def test_every_library_schedule_runs_on_processes(cluster: Cluster, name: str) -> None:
    schedule = zb_auto(2) if name == "zb_auto" else library(name)
    params, batch, ref_loss, ref_grads = reference("mlp", "explicit", schedule.num_stages)
    with pipeline("mlp", "explicit", schedule, backend=CONFIG) as pipe:
        result = pipe.step(params, batch)
        _check_transfers(pipe)
    assert_relative_close(result.loss, ref_loss)
    assert_relative_close(result.grads, ref_grads)
    assert result.peak_held == peak_inflight(schedule)


def test_parameters_made_in_the_world(cluster: Cluster) -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    m, _, batch, _, _ = hybrid_problem("explicit", 2, 2)
    key = jax.random.PRNGKey(5)
    made = m.init_stages(key)
    ref_loss, ref_grads = jax.jit(
        jax.value_and_grad(lambda p, x, t: m.loss(m.stages[1](p[1], m.stages[0](p[0], x)), t))
    )(made, *batch)
    with hybrid("explicit", schedule, dp=2, tp=1, zero=3, backend=CONFIG) as pipe:
        held = pipe.init(m.init_stages, key, batch=batch)
        assert isinstance(held, Resident)
        result = pipe.step(held, batch)
        assert_relative_close(pipe.gather(held), made)
    assert_relative_close(result.loss, ref_loss)
    assert_relative_close(result.grads, ref_grads)


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
    pipe = Pipeline([_dense, _held_stage], loss=_mse, schedule=schedule, backend=CONFIG)
    runner = _runner(pipe)
    pids = [node.pid for node in runner.world.nodes]
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
    with pipeline("mlp", "explicit", schedule, backend=CONFIG) as fresh:
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


def test_checkpoint_per_shard_resumes_on_the_same_plan_and_refuses_another(cluster: Cluster, tmp_path: Path) -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", 2, 2)
    with hybrid("explicit", schedule, dp=2, tp=1, zero=1, backend=CONFIG) as pipe:
        held, state, _ = pipe.train_step(params, None, batch, optimizer=HYBRID_ADAM)
        version = pipe.save(str(tmp_path), step=1)
        held, state, expected_loss = pipe.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        expected = pipe.gather(held)
    # Every pipeline device's processes wrote their part.
    assert sorted(p.name for p in Path(version).iterdir()) == ["device-0", "device-1", "plan.json"]
    with hybrid("explicit", schedule, dp=2, tp=1, zero=1, backend=CONFIG) as again:
        held, state, step = again.restore(str(tmp_path), like_params=params, batch=batch, optimizer=HYBRID_ADAM)
        assert step == 1 and isinstance(state, Resident)
        held, state, loss = again.train_step(held, state, batch, optimizer=HYBRID_ADAM)
        assert_relative_close(loss, expected_loss)
        assert_relative_close(again.gather(held), expected)
    with hybrid("explicit", schedule, dp=2, tp=1, zero=0, backend=CONFIG) as other:
        with pytest.raises(ExecutionError, match=r"saved by another plan \(zero: saved 1, this pipeline 0\)"):
            other.restore(str(tmp_path), like_params=params, batch=batch, optimizer=HYBRID_ADAM)
