"""A synthesised schedule runs like any other: ``zb_auto`` at pp = 2, synthesised against a
cost model with communication, gives ``jax.value_and_grad``'s loss and gradients on the
local backend (and on a Ray world of processes: ``tests/ray/test_ray_world.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_trees_close, pipeline, setup, zb_auto
from pipedsl.ir import Kind
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
