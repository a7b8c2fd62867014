"""The Ray backend's jax.distributed world on a four-node Ray cluster on this machine
(``tests/ray/conftest.py``): each plan is checked against one-device ``jax.value_and_grad``
(relative error below 1e-5, float32), every library schedule runs on processes, and training
steps on processes of their own run ahead of them. The tests of one world shape share one
world (``tests/ray/conftest.py``), each pipeline in turn.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import ray.cloudpickle

from helpers import (
    ADAM,
    HYBRID_ADAM,
    LIBRARY,
    RAY_MARKS,
    assert_relative_close,
    hybrid,
    hybrid_problem,
    hybrid_reference_adam,
    hybrid_schedule,
    library,
    pipeline,
    ray_runner,
    reference_training,
    zb_auto,
)
from helpers import setup as reference
from pipedsl.executor import ExecutionError, Pipeline, RunOptions
from pipedsl.executor.backend import Resident
from pipedsl.executor.ray.cluster import RayWorld
from pipedsl.executor.ray.cores import registry
from pipedsl.executor.ray.remote_loss import RemoteLoss
from pipedsl.executor.ray.transport import worker_exchanges, worker_groups
from pipedsl.rendezvous import exchange_groups, exchange_order
from pipedsl.ticks import tick_table
from pipedsl.validate import peak_inflight

pytestmark = RAY_MARKS

Worlds = Callable[[int, int], RayWorld]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _nodes_of(pipe: object) -> list[set[str]]:
    return [{slot.node_id for slot in mesh} for mesh in pipe.placement()]  # type: ignore[attr-defined]


def _check_transfers(pipe: object) -> None:
    """Every transfer of the step was a collective made by the processes of both meshes:
    no value reached a stage by another way (there is none left: a receive is answered
    only by a collective)."""
    backend = ray_runner(pipe)
    per = len(backend.ranks(0))
    installed = backend._installed
    assert installed is not None
    order = exchange_order(backend.program) + worker_exchanges(
        installed.model, backend.program.schedule.placement, update=False
    )
    expected = [0] * backend.world.num_processes
    for e in order:
        for d in (e.src, e.dst):
            for r in backend.ranks(d):
                expected[r] += 1
    assert backend.transfers == tuple(expected)
    assert sum(backend.transfers) == 2 * per * len(order)
    # Each group of exchanges was one collective of the processes of its two meshes.
    groups = exchange_groups(backend.program) + worker_groups(
        installed.model, backend.program.schedule.placement, update=False
    )
    made = [0] * backend.world.num_processes
    for g in groups:
        for d in (g[0].src, g[0].dst):
            for r in backend.ranks(d):
                made[r] += 1
    assert backend.collectives == tuple(made)


def test_spmd_dp4_over_four_processes(worlds: Worlds) -> None:
    schedule = hybrid_schedule("1f1b", 1, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("explicit", 1, 4)
    world = worlds(4, 1)
    with hybrid("explicit", schedule, dp=4, tp=1, zero=0, backend=world) as pipe:
        loss, grads = pipe.value_and_grad(params, batch)
        assert len(_nodes_of(pipe)[0]) == 4
    # On CPU each process is bound to the one core it reserves (cpus_per_process), one of
    # those this machine has; claimed in the registry for as long as it lives.
    with open(registry(), encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)  # another test worker's world may be claiming meanwhile
        claims = json.loads(handle.read())
    for node in world.nodes:
        assert len(node.cores) == 1 and set(node.cores) <= os.sched_getaffinity(0)
        assert claims[str(node.pid)] == list(node.cores)
    assert_relative_close(loss, ref_loss)
    assert_relative_close(grads, ref_grads)


def test_1f1b_dp2_pp2_meshes_across_nodes(worlds: Worlds) -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("marked", 2, 2)
    with hybrid("marked", schedule, dp=2, tp=1, zero=0, backend=worlds(4, 1)) as pipe:
        loss, grads = pipe.value_and_grad(params, batch)
        assert [len(nodes) for nodes in _nodes_of(pipe)] == [2, 2]
        _check_transfers(pipe)
    assert_relative_close(loss, ref_loss)
    assert_relative_close(grads, ref_grads)


def test_interleaved_1f1b_pp4_one_process_per_device(worlds: Worlds) -> None:
    schedule = hybrid_schedule("interleaved_1f1b", 4, 2)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("marked", schedule.num_stages, 1)
    with hybrid("marked", schedule, dp=1, tp=1, zero=0, backend=worlds(4, 1)) as pipe:
        loss, grads = pipe.value_and_grad(params, batch)
        assert len({next(iter(nodes)) for nodes in _nodes_of(pipe)}) == 4
        _check_transfers(pipe)
    assert_relative_close(loss, ref_loss)
    assert_relative_close(grads, ref_grads)


def test_zbv_zero3_across_nodes_trains_as_optax_on_one_device(worlds: Worlds) -> None:
    schedule = hybrid_schedule("zbv", 2, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("explicit", schedule.num_stages, 2)
    expected = hybrid_reference_adam("explicit", schedule.num_stages, 2, steps=2)
    with hybrid("explicit", schedule, dp=2, tp=1, zero=3, backend=worlds(4, 1)) as pipe:
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


def test_one_program_over_the_stage_axis_across_processes(worlds: Worlds) -> None:
    # Every process dispatches the same program over a stage mesh of the world's devices
    # (the same program as the local backend's, whose tests cover every schedule): the
    # one-device gradients; then Adam's steps, the parameters going back to the tasks apart
    # for a recorded step (and a gather) and into the program for the next step.
    world = worlds(4, 1)
    params, batch, ref_loss, ref_grads = reference("mlp", "explicit", 4)
    expected = reference_training("explicit", 4, steps=3, kind="mlp")
    schedule = library("zb_h1", pp=4)
    with pipeline("mlp", "explicit", schedule, backend=world, options=RunOptions(ticks=True)) as pipe:
        result = pipe.step(params, batch)
        assert pipe.ticked
        assert_relative_close(result.loss, ref_loss)
        assert_relative_close(result.grads, ref_grads)
        # Every process took part in every permutation; each value moved once.
        backend = ray_runner(pipe)
        assert len(set(backend.collectives)) == 1
        assert sum(backend.transfers) == 2 * sum(len(moves) for moves in tick_table(schedule).transfers)
        held, state = params, None
        for want_params, want_loss in expected[:2]:
            held, state, loss = pipe.train_step(held, state, batch, optimizer=ADAM)
            assert_relative_close(float(loss), want_loss)
        assert_relative_close(pipe.gather(held), want_params)
        recorded = pipe.step(held, batch, record=True)
        assert recorded.timeline is not None
        held, state, loss = pipe.train_step(held, state, batch, optimizer=ADAM)
        for got in (recorded.loss, float(loss)):
            assert_relative_close(got, expected[2][1])
        assert_relative_close(pipe.gather(held), expected[2][0])


def _heavy(p: jax.Array, x: jax.Array) -> jax.Array:
    # Enough matrix work per action that a step takes far longer than its dispatch.
    for _ in range(4):
        x = jnp.tanh(x @ p)
    return x


def _mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


def test_training_steps_on_processes_of_their_own_run_ahead(worlds: Worlds) -> None:
    # A process per pipeline device, the step one program over the stage axis (the path of
    # accelerators): ten training steps return while the processes still compute the last
    # ones (a process keeps at most MAX_IN_FLIGHT steps in flight, so the last two at least),
    # and no loss comes to the driver until it is read.
    schedule = library("1f1b", pp=4, microbatches=4)
    width = 512
    params = [jnp.eye(width) * 0.5] * 4
    x = np.ones((512, width), np.float32)
    batch = (x, x * 0.5)
    optimizer = optax.sgd(1e-3)
    options = RunOptions(ticks=True)
    with Pipeline([_heavy] * 4, loss=_mse, schedule=schedule, backend=worlds(4, 1), options=options) as pipe:
        held, state, loss = pipe.train_step(params, None, batch, optimizer=optimizer)  # compiles
        assert pipe.ticked
        float(loss)
        losses = []
        with jax.transfer_guard_device_to_host("disallow"):
            for _ in range(10):
                held, state, loss = pipe.train_step(held, state, batch, optimizer=optimizer)
                losses.append(loss)
            assert not losses[-1].is_ready()
        assert all(isinstance(x, RemoteLoss) and not x.fetched for x in losses)
        pipe.block_until_ready()
        assert all(x.is_ready() for x in losses)
        assert np.isfinite(float(losses[-1]))


def test_zb_h1_dp2_tp2_pp2_tp_inside_a_process(worlds: Worlds) -> None:
    schedule = hybrid_schedule("zb_h1", 2, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("explicit", 2, 2)
    with hybrid("explicit", schedule, dp=2, tp=2, zero=0, backend=worlds(4, 2)) as pipe:
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


@pytest.mark.parametrize("name", [*LIBRARY, "zb_auto"])
def test_every_library_schedule_runs_on_processes(worlds: Worlds, name: str) -> None:
    schedule = zb_auto(2) if name == "zb_auto" else library(name)
    params, batch, ref_loss, ref_grads = reference("mlp", "explicit", schedule.num_stages)
    with pipeline("mlp", "explicit", schedule, backend=worlds(2, 1)) as pipe:
        result = pipe.step(params, batch)
        _check_transfers(pipe)
    assert_relative_close(result.loss, ref_loss)
    assert_relative_close(result.grads, ref_grads)
    assert result.peak_held == peak_inflight(schedule)


def test_a_world_runs_pipelines_one_after_another(worlds: Worlds) -> None:
    world = worlds(2, 1)
    processes = [node.pid for node in world.nodes]
    schedule = library("1f1b")
    params, batch, ref_loss, ref_grads = reference("mlp", "explicit", schedule.num_stages)
    with pipeline("mlp", "explicit", schedule, backend=world) as first:
        first.step(params, batch)
        # One pipeline at a time.
        with pytest.raises(ExecutionError, match="this Ray world runs another pipeline"):
            pipeline("mlp", "explicit", schedule, backend=world)
    # Its processes forgot the pipeline that closed.
    assert world.call("doing", [((), {})] * 2, what="asking", stage_of=lambda r: None) == ["idle", "idle"]
    # A plan takes a world it fits exactly: dp = 2 on two pipeline devices is four processes.
    with pytest.raises(ExecutionError, match="takes 4 processes of devices_per_process=1; this Ray world has 2"):
        pipeline("mlp", "explicit", schedule, backend=world, options=RunOptions(dp=2))
    with pipeline("mlp", "explicit", library("zb_h1"), backend=world) as second:
        result = second.step(params, batch)
    assert_relative_close(result.loss, ref_loss)
    assert_relative_close(result.grads, ref_grads)
    # The same processes ran both, and stay up.
    assert not world.closed and [node.pid for node in world.nodes] == processes
    # A process lost while a pipeline runs on the world tears the world down: closing that
    # pipeline stays quiet, and the world refuses the next one.
    with pipeline("mlp", "explicit", schedule, backend=world) as third:
        third.step(params, batch)
        os.kill(world.nodes[1].pid, signal.SIGKILL)
    assert world.closed
    with pytest.raises(ExecutionError, match="this Ray world is closed"):
        pipeline("mlp", "explicit", schedule, backend=world)
