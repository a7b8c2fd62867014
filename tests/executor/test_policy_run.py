"""A synthesised schedule runs like any other: ``zb_auto`` at pp = 2, synthesised against a
cost model with communication, gives ``jax.value_and_grad``'s loss and gradients on the
local backend (and on a Ray world of processes: ``tests/ray/test_ray_world.py``); a
Pipeline given the policy itself synthesises it, against its ``costs`` or the default."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pipedsl
from helpers import ADAM, assert_trees_close, model, pipeline, reference_training, setup, zb_auto
from pipedsl.executor import Pipeline
from pipedsl.ir import Kind
from pipedsl.policy import Policy
from pipedsl.simulator import CostModel
from pipedsl.synthesize import synthesize
from pipedsl.validate import peak_inflight


@pytest.mark.parametrize(("kind", "max_inflight"), [("mlp", 1), ("mlp", 3), ("transformer", 2)])
def test_synthesised_schedule_matches_single_device(kind: str, max_inflight: int) -> None:
    schedule = zb_auto(max_inflight)
    assert any(a.kind is Kind.W for _, a in schedule.actions())
    params, batch, ref_loss, ref_grads = setup(kind, "marked", schedule.num_stages)
    result = pipeline(kind, "marked", schedule).step(params, batch)
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)
    assert result.leftover == ((),) * schedule.num_devices
    assert result.peak_held == peak_inflight(schedule)
    assert max(result.peak_held) <= max_inflight


COSTS = CostModel(forward=1, input_grad=1, weight_grad=2, latency=0.1)


@pytest.mark.parametrize("costs", [None, COSTS], ids=["default", "given"])
def test_pipeline_synthesises_a_policy_schedule(costs: CostModel | None) -> None:
    # What `pipedsl run zb_auto` does, from the API: the policy synthesised in the Pipeline,
    # against the costs given or, saying so, against the uniform default.
    policy = pipedsl.load("zb_auto", pp=2, microbatches=4, max_inflight=2)
    assert isinstance(policy, Policy)
    params, batch, ref_loss, ref_grads = setup("transformer", "explicit", 2)
    m = model("transformer", 2)
    if costs is None:
        with pytest.warns(UserWarning, match=r"zb_auto is a policy, synthesised against the default uniform costs"):
            pipe = Pipeline(m.stages, loss=m.loss, schedule=policy)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pipe = Pipeline(m.stages, loss=m.loss, schedule=policy, costs=costs)
    assert pipe.schedule == synthesize(policy, costs if costs is not None else CostModel())
    loss, grads = pipe.value_and_grad(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)
    [(ref_params, ref_step_loss)] = reference_training("explicit", 2, steps=1)
    params_after, _, step_loss = pipe.train_step(params, None, batch, optimizer=ADAM)
    np.testing.assert_allclose(float(step_loss), float(ref_step_loss), rtol=1e-5)
    # One Adam step moves a parameter by lr / eps times its gradient's rounding (see test_executor).
    assert_trees_close(pipe.gather(params_after), ref_params, atol=2e-6)


def test_the_library_name_of_a_policy_runs_from_the_function_form() -> None:
    params, batch, ref_loss, ref_grads = setup("transformer", "marked", 4)
    m = model("transformer", 4)
    with pytest.warns(UserWarning, match="default uniform costs"):
        pipe = Pipeline.from_function(m.model_fn, loss=m.loss, schedule="zb_auto")  # pp = 4, 8 microbatches
    assert pipe.schedule.num_microbatches == 8
    loss, grads = pipe.value_and_grad(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)
