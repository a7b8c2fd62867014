"""One SPMD program over the stage axis, where every pipeline device is a JAX device of its
own (pipedsl.executor.local.ticked): the step it runs is the one-device step."""

from __future__ import annotations

import logging
import warnings

import jax
import numpy as np
import optax
import pytest

import pipedsl
from helpers import ADAM, assert_trees_close, pipeline, setup
from pipedsl.executor import RunOptions

SCHEDULES = [
    ("1f1b", {}),
    ("gpipe", {}),
    ("zb_h1", {}),
    ("interleaved_1f1b", {"vpp": 2}),
    # Two stages a device, the last of one beside the first of the next: values pass
    # between them through the device's own inbound slots.
    ("zbv", {}),
]


@pytest.mark.parametrize(("name", "params"), SCHEDULES, ids=[n for n, _ in SCHEDULES])
def test_one_program_over_the_stage_axis_gives_the_one_device_gradients(name: str, params: dict[str, int]) -> None:
    schedule = pipedsl.load(name, pp=4, microbatches=8, **params)
    weights, batch, ref_loss, ref_grads = setup("mlp", "explicit", schedule.num_stages)
    pipe = pipeline("mlp", "explicit", schedule, options=RunOptions(ticks=True))
    result = pipe.step(weights, batch)
    assert pipe.backend.ticked
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)


def test_the_one_program_run_in_turn_on_one_device_gives_the_one_device_gradients() -> None:
    # fuse="ticks": every device's part of each tick in turn on one device, as one chip
    # measures what the program costs devices of their own (interleaved: two stages a device).
    schedule = pipedsl.load("interleaved_1f1b", pp=4, microbatches=8, vpp=2)
    weights, batch, ref_loss, ref_grads = setup("mlp", "explicit", schedule.num_stages)
    one = [jax.devices()[0]] * schedule.num_devices
    pipe = pipeline("mlp", "explicit", schedule, options=RunOptions(fuse="ticks"), devices=one)
    result = pipe.step(weights, batch)
    assert pipe.backend.ticked
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)


def test_one_program_over_the_stage_axis_trains_as_the_tasks_apart(caplog: pytest.LogCaptureFixture) -> None:
    # Adam under a global-norm clip (the update reads every device's gradients), then the
    # parameters and state read back, handed to the tasks apart, and trained on; the same
    # program with the devices' parts in turn on one device trains alike. The step's one
    # program is compiled for the first step only: the later ones take their parameters,
    # state and slots as the step before left them.
    schedule = pipedsl.load("zb_h1", pp=4, microbatches=4)
    weights, batch, _, _ = setup("mlp", "explicit", 4)
    optimizer = optax.chain(optax.clip_by_global_norm(0.05), ADAM)
    runs = []
    one = {"devices": [jax.devices()[0]] * 4}
    for options, where in ((RunOptions(ticks=True), {}), (RunOptions(fuse="ticks"), one), (RunOptions(), {})):
        pipe = pipeline("mlp", "explicit", schedule, options=options, **where)
        held, state = weights, None
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a donation XLA could not use warns
            for k in range(3):
                with jax.log_compiles(k > 0), caplog.at_level(logging.WARNING):
                    caplog.clear()
                    held, state, loss = pipe.train_step(held, state, batch, optimizer=optimizer)
                    losses.append(float(loss))
                if k > 0 and options != RunOptions():
                    assert not [r for r in caplog.records if "jit(step)" in r.getMessage()], "compiled again"
        assert pipe.backend.ticked == (options != RunOptions())
        # The parameters and state held on the devices are donated, never the caller's.
        assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(weights))
        runs.append((pipe.gather(held), pipe.gather(state), losses))
    *ticked, (want_params, want_states, want_losses) = runs
    for params, states, losses in ticked:
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        assert_trees_close(params, want_params, atol=1e-6)
        assert_trees_close(states, want_states, atol=1e-6)


def test_a_recorded_step_and_a_plan_with_dp_run_their_tasks_apart() -> None:
    schedule = pipedsl.load("1f1b", pp=2, microbatches=4)
    weights, batch, ref_loss, _ = setup("mlp", "explicit", 2)
    pipe = pipeline("mlp", "explicit", schedule, options=RunOptions(ticks=True))
    recorded = pipe.step(weights, batch, record=True)
    assert pipe.backend.ticked and recorded.timeline is not None
    np.testing.assert_allclose(float(recorded.loss), float(ref_loss), rtol=1e-5)
    hybrid = pipeline("mlp", "explicit", schedule, options=RunOptions(dp=2, ticks=True))
    hybrid.step(weights, batch)
    assert not hybrid.backend.ticked
