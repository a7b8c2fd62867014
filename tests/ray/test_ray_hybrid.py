"""Hybrid plans on the Ray backend's world, on a local instance: two CPU devices per process,
one world for the plans in turn.

The processes get their host devices from the XLA flag in their runtime environment, and a
stage mesh of dp x tp = 4 spans two of them (tp inside each); the checks are the local
backend's (``tests/executor/test_hybrid.py``), on a representative subset: a hybrid plan
with tensor parallelism and one with ZeRO-3, each matching ``jax.value_and_grad`` on one
device and an optax step on one device.
"""

from __future__ import annotations

import os

# pipedsl starts the local instance itself and keeps it on loopback; Ray reads the
# variable when it is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from collections.abc import Iterator  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from helpers import (  # noqa: E402
    HYBRID_ADAM,
    RAY_CONFIG,
    assert_relative_close,
    assert_trees_close,
    hybrid,
    hybrid_problem,
    hybrid_reference_adam,
    hybrid_schedule,
)
from pipedsl.executor.backend import Resident  # noqa: E402
from pipedsl.executor.ray.cluster import RayConfig, RayWorld  # noqa: E402

pytestmark = [
    pytest.mark.ray,
    pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning"),
]


@pytest.fixture(scope="module")
def world() -> Iterator[RayWorld]:
    """Four processes of two devices on a local instance pipedsl starts, for the plans in turn;
    they compile with the suite's XLA options, as the world modules' processes do."""
    config = RayConfig(step_timeout=300, runtime_env=RAY_CONFIG.runtime_env)
    with RayWorld.start(4, devices_per_process=2, config=config, label="hybrid") as started:
        yield started


@pytest.mark.parametrize(("dp", "tp", "pp", "name", "zero"), [(2, 2, 2, "1f1b", 0), (4, 1, 2, "zb_h1", 3)])
def test_ray_hybrid_plan_matches_single_device(
    world: RayWorld, dp: int, tp: int, pp: int, name: str, zero: int
) -> None:
    schedule = hybrid_schedule(name, pp, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("explicit", schedule.num_stages, dp)
    pipe = hybrid("explicit", schedule, dp=dp, tp=tp, zero=zero, backend=world)
    try:
        result = pipe.step(params, batch)
        assert abs(float(result.loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
        assert_relative_close(result.grads, ref_grads)
        ((ref_params, ref_step_loss),) = hybrid_reference_adam("explicit", schedule.num_stages, dp, steps=1)
        new_params, state, loss = pipe.train_step(params, None, batch, optimizer=HYBRID_ADAM)
        assert isinstance(new_params, Resident) and isinstance(state, Resident)
        assert abs(float(loss) - float(ref_step_loss)) < 1e-5 * abs(float(ref_step_loss))
        gathered = pipe.gather(new_params)
        assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree_util.tree_leaves(gathered))
        # Adam's eps-bounded noise on zero gradients: an absolute 1e-6 (see test_hybrid).
        assert_trees_close(gathered, ref_params, atol=1e-6)
    finally:
        pipe.close()
