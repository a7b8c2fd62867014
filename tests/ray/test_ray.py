"""The Ray backend on a real two-node Ray cluster on this machine (loopback only).

One cluster per module (a head and a second node, both on 127.0.0.1) and one shared
group of four device actors serve the equivalence checks, which are the local
executor's, unchanged: the same models, references and tolerances, imported from
``test_executor``. Other tests start groups of their own: spread over both nodes, or
with an actor to kill.
"""

from __future__ import annotations

import os

# The test starts the cluster itself, so it keeps it on loopback the way pipedsl keeps
# the local instances it starts; Ray reads the variable when it is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from helpers import ADAM, LIBRARY, assert_trees_close, library, pipeline, reference_training, zb_auto  # noqa: E402
from helpers import setup as reference  # noqa: E402
from pipedsl.executor import ExecutionError, Pipeline  # noqa: E402
from pipedsl.executor.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pipedsl.executor.ray_backend import Resident  # noqa: E402
from pipedsl.executor.ray_cluster import (  # noqa: E402
    DeviceLost,
    RayConfig,
    RayDevices,
    actor_runtime_env,
    connect,
    disconnect,
)
from pipedsl.timeline import EventKind  # noqa: E402
from pipedsl.validate import peak_inflight  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    # The cluster's processes are started from this process, after JAX has started its
    # threads; Ray execs right after forking, which is safe.
    pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning"),
]

# The actors cannot import this module, so its stage functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Files that make the hooked stage below fail or pause inside the actors.
FLAGS = Path(tempfile.gettempdir()) / f"pipedsl-test-ray-{os.getpid()}"
WIDTH = 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    head = {"num_cpus": 6, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=4, node_ip_address="127.0.0.1")
    connect(cluster.address)
    try:
        yield cluster
    finally:
        disconnect()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def devices(cluster: Cluster) -> Iterator[RayDevices]:
    with RayDevices.start(4, RayConfig(step_timeout=120)) as group:
        yield group


@pytest.fixture
def flags() -> Iterator[Path]:
    FLAGS.mkdir(exist_ok=True)
    try:
        yield FLAGS
    finally:
        for flag in FLAGS.iterdir():
            flag.unlink()
        FLAGS.rmdir()


# -- a stage that misbehaves on demand -------------------------------------------------


def _host_hook(x: np.ndarray) -> np.ndarray:
    if (FLAGS / "fail").exists():
        raise ValueError("the hooked stage exploded")
    if (FLAGS / "pause").exists():
        time.sleep(0.5)
    return x


def _on_host(x: jax.Array) -> jax.Array:
    return jax.pure_callback(_host_hook, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _hook(x: jax.Array) -> jax.Array:
    """The identity, passing through ``_host_hook`` on the way forward."""
    # Built per call: a custom_vjp object does not survive pickling by value.
    hook = jax.custom_vjp(_on_host)
    hook.defvjp(lambda x: (_on_host(x), None), lambda _, g: (g,))
    return hook(x)


def dense(p: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p)


def hooked(p: jax.Array, x: jax.Array) -> jax.Array:
    return dense(p, _hook(x))


def mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


def hooked_problem() -> tuple[list[jax.Array], tuple[jax.Array, jax.Array]]:
    key = jax.random.PRNGKey(3)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in jax.random.split(key, 2)]
    x = jax.random.normal(jax.random.fold_in(key, 1), (8, WIDTH))
    return params, (x, jnp.sin(x))


# -- the executor's checks, on Ray -----------------------------------------------------


# Every library schedule once, the four (model, form) pairs in turn, so that each pair
# and each schedule meet the actors: the local tier checks the whole cross product, and
# the actors run its very per-stage programs (each combination costs a compile per actor).
_COMBINATIONS = [("mlp", "explicit"), ("transformer", "marked"), ("transformer", "explicit"), ("mlp", "marked")]
_LIBRARY_CASES = [(name, *_COMBINATIONS[i % len(_COMBINATIONS)]) for i, name in enumerate(LIBRARY)]


@pytest.mark.parametrize(("name", "kind", "form"), _LIBRARY_CASES)
def test_library_schedule_matches_single_device(devices: RayDevices, name: str, kind: str, form: str) -> None:
    schedule = library(name)
    params, batch, ref_loss, ref_grads = reference(kind, form, schedule.num_stages)
    pipe = pipeline(kind, form, schedule, backend=devices)
    try:
        result = pipe.step(params, batch)
    finally:
        pipe.close()
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)
    assert result.leftover == ((),) * schedule.num_devices
    assert result.peak_held == peak_inflight(schedule)


def test_four_devices(devices: RayDevices) -> None:
    schedule = library("zb_h1", pp=4, microbatches=4)
    params, batch, ref_loss, ref_grads = reference("transformer", "marked", 4)
    pipe = pipeline("transformer", "marked", schedule, backend=devices)
    try:
        result = pipe.step(params, batch)
    finally:
        pipe.close()
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)
    assert result.peak_held == peak_inflight(schedule)


def test_value_and_grad_reuses_held_params_only_while_the_actors_hold_them(devices: RayDevices) -> None:
    schedule = library("1f1b", pp=4, microbatches=4)
    params, batch, ref_loss, ref_grads = reference("transformer", "marked", 4)
    params = jax.device_put(params)  # JAX arrays, immutable: the same objects are the same values
    pipe = pipeline("transformer", "marked", schedule, backend=devices)
    try:
        results = [pipe.value_and_grad(params, batch), pipe.value_and_grad(params, batch)]
        # A training step changes what the actors hold: the next call must send the
        # given parameters again.
        pipe.train_step(params, None, batch, optimizer=ADAM)
        results.append(pipe.value_and_grad(params, batch))
        results.append(pipe.value_and_grad(jax.tree_util.tree_map(lambda x: x + 0, params), batch))
    finally:
        pipe.close()
    for loss, grads in results:
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        assert_trees_close(grads, ref_grads)


def test_each_actor_gets_its_own_device_count_share_of_cores_and_allocator(devices: RayDevices) -> None:
    # The driver has 8 forced CPU devices; an actor of a dp=tp=1 group needs one, and
    # on a joined cluster as many compute threads as the one CPU it reserves; its
    # allocator keeps the memory its steps free.
    for node in devices.nodes:
        environ = dict(
            entry.split("=", 1) for entry in Path(f"/proc/{node.pid}/environ").read_text().split("\0") if "=" in entry
        )
        assert environ["XLA_FLAGS"].split()[-1] == "--xla_force_host_platform_device_count=1"
        assert environ["NPROC"] == "1"
        assert environ["MALLOC_TRIM_THRESHOLD_"] == str(4 << 30)
        assert environ["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)


def test_actor_runtime_env_replaces_the_device_count_and_keeps_the_users_choices() -> None:
    base = {
        "env_vars": {
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x",
            "NPROC": "3",
            "MALLOC_TRIM_THRESHOLD_": "0",
        }
    }
    env = actor_runtime_env(base, 4, gpus=False, threads=2)
    assert env is not None
    assert env["env_vars"] == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4",
        "NPROC": "3",
        "MALLOC_TRIM_THRESHOLD_": "0",
        "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    }
    assert base["env_vars"]["NPROC"] == "3" and "=8" in base["env_vars"]["XLA_FLAGS"]  # not changed in place
    assert actor_runtime_env(None, 2, gpus=False, threads=1) == {
        "env_vars": {
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "NPROC": "1",
            "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
            "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
        }
    }
    assert actor_runtime_env(None, 2, gpus=True, threads=1) is None


@pytest.mark.parametrize("form", ["explicit", "marked"])
def test_training_matches_single_device_loop_and_local_backend(devices: RayDevices, form: str) -> None:
    schedule = library("zbv")
    params, batch, _, _ = reference("transformer", form, schedule.num_stages)
    local = pipeline("transformer", form, schedule)
    local_params, local_state = params, None
    pipe = pipeline("transformer", form, schedule, backend=devices)
    try:
        pipe_params, pipe_state = params, None
        for ref_params, ref_loss in reference_training(form, schedule.num_stages, steps=2):
            local_params, local_state, _ = local.train_step(local_params, local_state, batch, optimizer=ADAM)
            pipe_params, pipe_state, loss = pipe.train_step(pipe_params, pipe_state, batch, optimizer=ADAM)
            assert isinstance(pipe_params, Resident) and isinstance(pipe_state, Resident)
            np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        # Adam (eps 1e-4, rate 1e-2) moves a parameter whose gradient is zero up to float
        # cancellation (about 1e-8 here) by rate/eps times that noise, whose sign depends
        # on the order XLA sums in: each actor's own thread count makes its own order.
        assert_trees_close(pipe.gather(pipe_params), ref_params, atol=1e-5)
        # The actors run the local backend's per-stage programs: the same state.
        assert_trees_close(pipe.gather(pipe_state), jax.device_get(local_state), atol=1e-6)
    finally:
        pipe.close()


def test_state_stays_in_the_actors_until_gathered(devices: RayDevices) -> None:
    schedule = library("1f1b")
    params, batch, _, _ = reference("mlp", "marked", schedule.num_stages)
    optimizer = optax.sgd(0.1)
    pipe = pipeline("mlp", "marked", schedule, backend=devices)
    try:
        p1, s1, _ = pipe.train_step(params, None, batch, optimizer=optimizer)
        p2, s2, _ = pipe.train_step(p1, s1, batch, optimizer=optimizer)
        # One resident copy, updated in place: an older handle is refused, not misread.
        with pytest.raises(ExecutionError, match="out of date"):
            pipe.train_step(p1, s2, batch, optimizer=optimizer)
        loss, grads = pipe.value_and_grad(p2, batch)
        gathered = pipe.gather(p2)
        assert jax.tree_util.tree_structure(gathered) == jax.tree_util.tree_structure(params)
        # Plain arrays are shipped and become the resident copy.
        loss_again, grads_again = pipe.value_and_grad(gathered, batch)
        assert float(loss_again) == float(loss)
        assert_trees_close(grads_again, grads)
        with pytest.raises(ExecutionError, match="out of date"):
            pipe.gather(p2)
    finally:
        pipe.close()


def test_measured_timeline_merges_every_actor(devices: RayDevices) -> None:
    schedule = library("1f1b")
    params, batch, _, _ = reference("mlp", "explicit", schedule.num_stages)
    pipe = pipeline("mlp", "explicit", schedule, backend=devices)
    try:
        timeline = pipe.step(params, batch, record=True).timeline
    finally:
        pipe.close()
    assert timeline is not None and timeline.origin == "measured"
    frame = timeline.to_dataframe()
    computes = frame[frame.kind != EventKind.SEND.value]
    assert len(computes) == schedule.num_actions
    sends = [i for dev in pipe.program.devices for i in dev.instructions if type(i).__name__ == "Send"]
    assert (frame.kind == EventKind.SEND.value).sum() == len(sends)
    # Every actor's clock is converted to the driver's: events start after the step does.
    assert (frame.end >= frame.start).all() and (frame.start >= -1e-3).all()
    for device, rows in computes.groupby("device"):
        assert [f"{s}{k}{m}" for s, k, m in zip(rows.stage, rows.kind, rows.microbatch, strict=True)] == [
            str(a) for a in schedule.orders[device]
        ]
        assert (rows.start.to_numpy()[1:] >= rows.end.to_numpy()[:-1]).all()
    # A gradient is received only after it was sent: device 0's B(m) starts after
    # device 1's B(m) ended.
    for m in range(schedule.num_microbatches):
        b0 = computes[(computes.device == 0) & (computes.kind == "B") & (computes.microbatch == m)]
        b1 = computes[(computes.device == 1) & (computes.kind == "B") & (computes.microbatch == m)]
        assert float(b0.start.iloc[0]) >= float(b1.end.iloc[0]) - 1e-3


def test_actors_on_two_nodes_run_library_and_synthesised_schedules(cluster: Cluster) -> None:
    schedule = library("1f1b")
    params, batch, ref_loss, ref_grads = reference("transformer", "marked", schedule.num_stages)
    # A zb_auto schedule synthesised against a cost model runs like any other.
    synthesised = zb_auto(2)
    s_params, s_batch, s_loss, s_grads = reference("mlp", "explicit", synthesised.num_stages)
    with RayDevices.start(2, RayConfig(strategy="STRICT_SPREAD", step_timeout=120)) as group:
        assert group.nodes[0].node_id != group.nodes[1].node_id
        assert {n.ip for n in group.nodes} == {"127.0.0.1"}
        result = pipeline("transformer", "marked", schedule, backend=group).step(params, batch)
        s_result = pipeline("mlp", "explicit", synthesised, backend=group).step(s_params, s_batch)
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)
    np.testing.assert_allclose(float(s_result.loss), float(s_loss), rtol=1e-5)
    assert_trees_close(s_result.grads, s_grads)


# -- failures -------------------------------------------------------------------------


def test_a_full_cluster_fails_at_once_naming_who_holds_what(devices: RayDevices) -> None:
    # The module's group holds 4 of the cluster's 10 CPUs: 7 more do not fit now, 11
    # never do. Neither waits for start_timeout.
    start = time.monotonic()
    with pytest.raises(ExecutionError, match=r"the cluster is full: 7 devices of 1 CPU each need 7 CPU, \d+ of its 10") as info:
        RayDevices.start(7, RayConfig(start_timeout=60), label="'seven'")
    assert time.monotonic() - start < 15
    assert re.search(rf"placement group 'pipedsl devices \(4 devices, process {os.getpid()}, group \d+\)': 4 CPU", str(info.value))
    with pytest.raises(ExecutionError, match=r"cannot hold 11 devices of 1 CPU each: they need 11 CPU and it has 10 in all"):
        RayDevices.start(11, RayConfig(start_timeout=60))
    assert time.monotonic() - start < 30
    from ray.util.placement_group import placement_group_table

    assert not [g for g in placement_group_table().values() if g["state"] != "REMOVED" and "'seven'" in g["name"]]



def test_one_process_reserves_two_groups_of_one_label(devices: RayDevices) -> None:
    # Ray's placement group names are unique in a cluster: two pipelines of one schedule
    # in one process each reserve a group of their own.
    from ray.util.placement_group import remove_placement_group

    from pipedsl.executor.ray_placement import reserve

    groups = [reserve(1, cpus=1.0, gpus=0.0, strategy="PACK", timeout=30.0, label="'1f1b'") for _ in range(2)]
    try:
        names = [ray.util.placement_group_table(g.group)["name"] for g in groups]
        assert names[0] != names[1]
        assert all(name.startswith(f"pipedsl '1f1b' (1 devices, process {os.getpid()}, group ") for name in names)
    finally:
        for g in groups:
            remove_placement_group(g.group)


def test_failing_stage_names_its_stage_device_and_node(devices: RayDevices, flags: Path) -> None:
    schedule = library("1f1b")
    params, batch = hooked_problem()
    pipe = Pipeline([dense, hooked], loss=mse, schedule=schedule, backend=devices, recv_timeout=20)
    try:
        loss, _ = pipe.value_and_grad(params, batch)
        (flags / "fail").touch()
        start = time.monotonic()
        with pytest.raises(ExecutionError) as info:
            pipe.value_and_grad(params, batch)
        assert time.monotonic() - start < 10
        (flags / "fail").unlink()
        error = info.value
        assert (error.stage, error.device) == (1, 1)
        message = str(error)
        assert "stage 1 (device 1)" in message
        assert devices.nodes[1].node_id[:12] in message and devices.nodes[1].ip in message
        # Nothing was lost: the same pipeline runs the step again.
        assert float(pipe.value_and_grad(params, batch)[0]) == float(loss)
    finally:
        pipe.close()


def test_slow_step_is_aborted_at_step_timeout(devices: RayDevices, flags: Path) -> None:
    schedule = library("1f1b")
    params, batch = hooked_problem()
    pipe = Pipeline([dense, hooked], loss=mse, schedule=schedule, backend=devices, recv_timeout=20)
    try:
        loss, _ = pipe.value_and_grad(params, batch)
        # Stage 1 now takes 0.5 s per forward: 2 s for the step, against a 1 s bound.
        (flags / "pause").touch()
        devices.step_timeout = 1.0
        start = time.monotonic()
        with pytest.raises(ExecutionError, match=r"did not finish within 1 s \(step_timeout\)") as late:
            pipe.value_and_grad(params, batch)
        assert time.monotonic() - start < 1.0 + 5
        # Each device still running says where its program was.
        assert re.search(r"device 1, stage 1, on .*, running ", str(late.value)), late.value
        (flags / "pause").unlink()
        # Aborted, every device stopped at its next receive: the group takes the retry.
        assert not devices.closed
        assert float(pipe.value_and_grad(params, batch)[0]) == float(loss)
    finally:
        devices.step_timeout = devices.config.step_timeout
        pipe.close()


def test_killed_actor_fails_in_bounded_time_and_a_restored_pipeline_continues(
    cluster: Cluster, flags: Path, tmp_path: Path
) -> None:
    schedule = library("1f1b")
    params, batch = hooked_problem()
    optimizer = optax.adam(1e-2)
    # The run without a failure: four steps on the local backend.
    local = Pipeline([dense, hooked], loss=mse, schedule=schedule)
    expected: list[tuple[Any, float]] = []
    p, s = params, None
    for _ in range(4):
        p, s, loss = local.train_step(p, s, batch, optimizer=optimizer)
        expected.append((jax.device_get(p), float(loss)))

    config = RayConfig(step_timeout=30)
    group = RayDevices.start(2, config)
    pipe = Pipeline([dense, hooked], loss=mse, schedule=schedule, backend=group, recv_timeout=15)
    p, s = params, None
    for _ in range(2):
        p, s, _ = pipe.train_step(p, s, batch, optimizer=optimizer)
    save_checkpoint(tmp_path / "ckpt", pipe.gather(p), pipe.gather(s), step=2)

    # Stage 1 now pauses 0.5 s per forward, so the kill lands in the middle of the step.
    (flags / "pause").touch()
    killer = threading.Timer(0.5, ray.kill, args=(group.actors[1],))
    start = time.monotonic()
    killer.start()
    with pytest.raises(DeviceLost) as info:
        pipe.train_step(p, s, batch, optimizer=optimizer)
    elapsed = time.monotonic() - start
    killer.join()
    (flags / "pause").unlink()
    assert elapsed < config.step_timeout
    assert info.value.device == 1 and info.value.stage == 1
    assert info.value.node == group.nodes[1] and group.nodes[1].node_id[:12] in str(info.value)
    assert group.closed

    saved = load_checkpoint(tmp_path / "ckpt")
    assert saved.step == 2
    rebuilt = Pipeline([dense, hooked], loss=mse, schedule=schedule, backend=config, recv_timeout=15)
    try:
        p, s = saved.params, saved.opt_state
        for step in (3, 4):
            p, s, loss = rebuilt.train_step(p, s, batch, optimizer=optimizer)
            np.testing.assert_allclose(float(loss), expected[step - 1][1], rtol=1e-5)
        assert_trees_close(rebuilt.gather(p), expected[3][0])
    finally:
        rebuilt.close()


def test_lost_node_names_the_node(cluster: Cluster, flags: Path) -> None:
    schedule = library("1f1b")
    params, batch = hooked_problem()
    worker = cluster.list_all_nodes()[-1]
    with RayDevices.start(2, RayConfig(strategy="STRICT_SPREAD", step_timeout=30)) as group:
        pipe = Pipeline([dense, hooked], loss=mse, schedule=schedule, backend=group, recv_timeout=15)
        pipe.value_and_grad(params, batch)
        (flags / "pause").touch()
        remover = threading.Timer(0.5, cluster.remove_node, args=(worker,))
        start = time.monotonic()
        remover.start()
        with pytest.raises(DeviceLost, match="its node is gone") as info:
            pipe.value_and_grad(params, batch)
        remover.join()
        assert time.monotonic() - start < group.config.step_timeout
        assert info.value.node is not None and info.value.node.node_id == worker.node_id
        assert group.nodes[info.value.device] == info.value.node and group.closed
    # Later tests find the cluster as they expect it.
    cluster.add_node(num_cpus=4, node_ip_address="127.0.0.1")


def test_checkpoint_round_trip_and_replace(tmp_path: Path) -> None:
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [np.ones(3, np.float32)]}
    state = (optax.adam(1e-3).init(params), optax.sgd(0.1).init(params))
    save_checkpoint(tmp_path / "ckpt", params, state, step=7)
    saved = load_checkpoint(tmp_path / "ckpt")
    assert saved.step == 7
    assert jax.tree_util.tree_structure(saved.params) == jax.tree_util.tree_structure(params)
    assert jax.tree_util.tree_structure(saved.opt_state) == jax.tree_util.tree_structure(state)
    assert_trees_close(saved.opt_state, jax.device_get(state))
    save_checkpoint(tmp_path / "ckpt", params, None, step=8)
    again = load_checkpoint(tmp_path / "ckpt")
    assert again.step == 8 and again.opt_state is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(ExecutionError, match="not a readable pipedsl checkpoint"):
        load_checkpoint(tmp_path / "missing")


def test_cli_runs_on_a_local_instance_it_starts(tmp_path: Path) -> None:
    # A fresh process with no cluster to join: pipedsl starts a local instance on
    # loopback, trains, records a timeline from both actors and shuts the instance down.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = tmp_path / "timeline.json"
    command = [sys.executable, "-m", "pipedsl", "run", "schedules/zb_h1.sched", "-p", "pp=2", "-p", "microbatches=4"]
    command += ["--backend", "ray", "--steps", "2", "--width", "8", "--layers-per-stage", "1", "--timeline", str(out)]
    root = Path(__file__).parents[2]
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    assert "Ray actor devices" in done.stdout and "median step time" in done.stdout and out.exists()
