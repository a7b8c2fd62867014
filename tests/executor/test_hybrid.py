"""Hybrid plans on eight CPU devices: every pipeline device a ``dp x tp`` mesh.

Each grid point runs the tiny transformer with its Megatron specs under one schedule
and one ZeRO level and must give the loss and gradients of ``jax.value_and_grad`` of
the unsplit model on one device (relative error below 1e-5, float32); optimizer steps
must give optax's on one device. Every ``(dp, tp, pp)`` point, every schedule and every
ZeRO level appears at least once; ``pp = 1`` points are the SPMD baselines (one stage
over the whole mesh, gradient accumulation over microbatches).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from helpers import (
    HYBRID_ADAM,
    assert_relative_close,
    assert_trees_close,
    hybrid,
    hybrid_problem,
    hybrid_reference_adam,
    hybrid_schedule,
)
from pipedsl.executor import ExecutionError, Pipeline, RunOptions

# (dp, tp, pp, schedule, vpp, zero, form)
GRID = [
    (8, 1, 1, "gpipe", 1, 0, "explicit"),
    (4, 2, 1, "gpipe", 1, 2, "marked"),
    (1, 8, 1, "gpipe", 1, 0, "explicit"),
    (2, 2, 2, "zbv", 2, 3, "marked"),
    (2, 1, 4, "zb_h1", 1, 1, "explicit"),
    (1, 2, 4, "1f1b", 1, 0, "marked"),
    (4, 1, 2, "interleaved_1f1b", 2, 3, "explicit"),
]


@pytest.mark.parametrize(("dp", "tp", "pp", "name", "vpp", "zero", "form"), GRID)
def test_hybrid_plan_matches_single_device(
    dp: int, tp: int, pp: int, name: str, vpp: int, zero: int, form: str
) -> None:
    schedule = hybrid_schedule(name, pp, vpp)
    _, params, batch, ref_loss, ref_grads = hybrid_problem(form, schedule.num_stages, dp)
    pipe = hybrid(form, schedule, dp=dp, tp=tp, zero=zero)
    result = pipe.step(params, batch)
    assert abs(float(result.loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
    assert_relative_close(result.grads, ref_grads)
    # Every parameter leaf is held on a whole stage mesh of dp x tp devices.
    held = [leaf for worker in pipe.backend.workers for leaf in worker.leaves.values()]
    assert {len(leaf.sharding.device_set) for leaf in held} == {dp * tp}


@pytest.mark.parametrize(
    ("dp", "tp", "pp", "name", "zero"), [(4, 2, 1, "gpipe", 1), (2, 1, 2, "zb_h1", 2), (2, 2, 2, "1f1b", 3)]
)
def test_optimizer_steps_match_optax_on_one_device(dp: int, tp: int, pp: int, name: str, zero: int) -> None:
    schedule = hybrid_schedule(name, pp, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", schedule.num_stages, dp)
    pipe = hybrid("explicit", schedule, dp=dp, tp=tp, zero=zero)
    state = None
    for ref_params, ref_loss in hybrid_reference_adam("explicit", schedule.num_stages, dp, steps=2):
        params, state, loss = pipe.train_step(params, state, batch, optimizer=HYBRID_ADAM)
        assert abs(float(loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
    # Adam turns the rounding noise of gradients that are zero in exact arithmetic (the
    # attention key bias) into parameter noise bounded by eps: parameters of size ~0.1
    # are compared to an absolute 1e-6, as for the pure pipelines.
    assert_trees_close(pipe.gather(params), ref_params, atol=1e-6)
    # The gathered state is plain host arrays of the unsharded shapes.
    gathered = pipe.gather(state)
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree_util.tree_leaves(gathered))
    if zero:
        # ZeRO shards the optimizer state of the largest leaf over "data".
        big = max(jax.tree_util.tree_leaves(pipe.backend.workers[0].states[0]), key=lambda leaf: leaf.size)
        assert "data" in str(big.sharding.spec)


COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather)(-start)?\(")


def _collectives(text: str) -> set[str]:
    return {m.group(1) for m in COLLECTIVE.finditer(text)}


def test_gradient_reduction_and_tensor_collectives_are_inside_xla() -> None:
    # A dp=2, tp=2 stage's compiled programs must themselves combine the tensor-parallel
    # partial sums (forward and backward) and reduce the gradients over "data" (the
    # step's reduction): their HLO has the collectives. The same stage on one device has none.
    schedule = hybrid_schedule("gpipe", 1, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", 1, 2)
    (program,) = hybrid("explicit", schedule, dp=2, tp=2, zero=0).compile(params, batch)
    hlo = program.compiled_hlo()
    assert "all-reduce" in _collectives(hlo["F"]) and "all-reduce" in _collectives(hlo["B"])
    assert _collectives(hlo["reduce"]) == {"all-reduce"}
    # Leaves split over "tensor" join the flat buffers too: with ZeRO 1, one reduce-scatter
    # of every leaf split over "data" (XLA does not combine these by itself) and one
    # all-reduce of those that stay whole (a vector split over "tensor" has no axis left).
    (sharded,) = hybrid("explicit", schedule, dp=2, tp=2, zero=1).compile(params, batch)
    reduce = sharded.compiled_hlo()["reduce"]
    assert sorted(m.group(1) for m in COLLECTIVE.finditer(reduce)) == ["all-reduce", "reduce-scatter"]
    (single,) = hybrid("explicit", schedule, dp=1, tp=1, zero=0).compile(params, batch)
    assert not any(COLLECTIVE.search(text) for text in single.compiled_hlo().values())


@pytest.mark.parametrize(
    ("zero", "backward", "reduce"),
    [(0, set(), {"all-reduce"}), (1, set(), {"reduce-scatter"}), (2, {"reduce-scatter"}, set())],
)
def test_gradients_are_reduced_once_per_step_up_to_zero_1(zero: int, backward: set[str], reduce: set[str]) -> None:
    # Data parallel only (tp = 1): ZeRO 0 and 1 keep each device's gradients unreduced
    # through every backward and reduce them once per step (all-reduce, reduce-scatter),
    # as the estimator prices them; ZeRO 2 reduce-scatters every backward's gradients.
    # Every leaf goes in one collective (one flat buffer), as the estimator prices one.
    schedule = hybrid_schedule("gpipe", 1, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", 1, 2)
    (program,) = hybrid("explicit", schedule, dp=2, tp=1, zero=zero).compile(params, batch)
    hlo = program.compiled_hlo()
    assert _collectives(hlo["B"]) == backward
    assert _collectives(hlo["reduce"]) == reduce
    assert len(jax.tree_util.tree_leaves(params)) > 1
    assert len(COLLECTIVE.findall(hlo["reduce"] if reduce else hlo["B"])) == 1


def test_zero_1_gathers_the_updated_parameters_in_one_collective() -> None:
    # ZeRO 1 and 2 update each device's shard of a parameter kept whole; the new
    # parameters come back whole from one all-gather of every split leaf, each leaf
    # exactly the array it was (leaves split along their first, second or no axis).
    from jax.sharding import Mesh, PartitionSpec

    from pipedsl.executor.stages.mesh import StageLayout
    from pipedsl.executor.stages.shards import DataShards

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "tensor"))
    values = [
        np.arange(n, dtype=np.float32).reshape(shape) for n, shape in ((12, (4, 3)), (24, (3, 8)), (6, (6,)), (5, (5,)))
    ]
    avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]
    layout = StageLayout(mesh, [PartitionSpec()] * len(values), avals, zero=1, leaves=range(len(values)))
    assert layout.gathers_params
    assert [tuple(s.spec) for s in layout.states] == [("data", None), (None, "data"), ("data",), ()]
    gather = jax.jit(DataShards(layout).whole(range(len(values))), out_shardings=layout.params)
    shards = [jax.device_put(v, s) for v, s in zip(values, layout.states, strict=True)]
    whole = gather(*shards)
    for got, want, at in zip(whole, values, layout.params, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding.is_equivalent_to(at, want.ndim)
    assert len(COLLECTIVE.findall(gather.lower(*shards).compile().as_text())) == 1
    assert not StageLayout(
        mesh, [PartitionSpec()] * len(values), avals, zero=0, leaves=range(len(values))
    ).gathers_params


def test_microbatch_that_does_not_split_over_dp_is_refused() -> None:
    schedule = hybrid_schedule("gpipe", 1, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", 1, 2)
    pipe = hybrid("explicit", schedule, dp=8, tp=1, zero=0)
    with pytest.raises(ExecutionError, match=r"microbatch of 2 examples .* dp=8 .* multiple of 32"):
        pipe.step(params, batch)


def test_too_few_jax_devices_say_how_to_get_more() -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    with pytest.raises(ExecutionError, match=r"needs 16 JAX devices .*xla_force_host_platform_device_count=16"):
        hybrid("explicit", schedule, dp=4, tp=2, zero=0)


def test_specs_that_do_not_split_over_tp_are_refused() -> None:
    schedule = hybrid_schedule("gpipe", 1, 1)
    m, params, batch, _, _ = hybrid_problem("explicit", 1, 2)
    bad = Pipeline(
        m.stages, loss=m.loss, schedule=schedule, options=RunOptions(tp=3), param_specs=m.param_specs(params)
    )
    with pytest.raises(ExecutionError, match=r"over tp=3, which does not divide it"):
        bad.step(params, batch)
