"""A synthesised schedule runs like any other: ``zb_auto`` at pp = 2, synthesised against a
cost model with communication, gives ``jax.value_and_grad``'s loss and gradients on the
local backend and on Ray actors."""

from __future__ import annotations

import os

import numpy as np
import pytest

import pipedsl
from helpers import assert_trees_close, pipeline, setup
from pipedsl.ir import Kind, Schedule
from pipedsl.policy import Policy
from pipedsl.simulator import CostModel
from pipedsl.simulator.synthesize import synthesize
from pipedsl.validate import peak_inflight


def zb_auto(max_inflight: int) -> Schedule:
    policy = pipedsl.load("zb_auto", pp=2, microbatches=4, max_inflight=max_inflight)
    assert isinstance(policy, Policy)
    return synthesize(policy, CostModel(forward=1, input_grad=1, weight_grad=2, latency=0.1))


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


@pytest.mark.ray
@pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")
def test_synthesised_schedule_matches_single_device_on_ray() -> None:
    # Loopback only, as pipedsl keeps the local instances it starts; read when ray is imported.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from pipedsl.executor.ray_cluster import RayConfig, RayDevices

    schedule = zb_auto(2)
    params, batch, ref_loss, ref_grads = setup("mlp", "explicit", schedule.num_stages)
    with RayDevices.start(2, RayConfig(step_timeout=120)) as devices:
        result = pipeline("mlp", "explicit", schedule, backend=devices).step(params, batch)
    np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(result.grads, ref_grads)
