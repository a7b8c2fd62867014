"""Optimizer updates across stages: global-norm clipping gives the one-device result, an
optimizer that combines leaves otherwise is refused, and the update works in place."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_trees_close, library, model
from pipedsl.executor import ExecutionError, Pipeline, RunOptions
from pipedsl.executor.models import reference_stages

STEPS = 3


def _train_one_device(
    m: Any, params: Any, batch: Any, optimizer: optax.GradientTransformation
) -> list[tuple[Any, float]]:
    fn = reference_stages(m)
    grad = jax.jit(jax.value_and_grad(lambda p, x, t: m.loss(fn(p, x), t)))
    state = optimizer.init(params)
    out = []
    for _ in range(STEPS):
        loss, g = grad(params, *batch)
        updates, state = optimizer.update(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append((params, float(loss)))
    return out


@pytest.mark.parametrize("max_norm", [0.05, 100.0])  # clipping every step, and never
def test_clip_by_global_norm_through_four_stages_equals_one_device(max_norm: float) -> None:
    schedule = library("1f1b", pp=4)
    m = model("mlp", 4)
    key = jax.random.PRNGKey(5)
    params = m.init_stages(key)
    batch = m.batch(jax.random.fold_in(key, 1), 8)
    optimizer = optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(1e-2))
    expected = _train_one_device(m, params, batch, optimizer)
    pipe = Pipeline(m.stages, loss=m.loss, schedule=schedule)
    state = None
    for ref_params, ref_loss in expected:
        params, state, loss = pipe.train_step(params, state, batch, optimizer=optimizer)
        np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
        assert_trees_close(pipe.gather(params), ref_params)


def test_clipping_per_stage_would_differ() -> None:
    # The test above could not tell a per-stage clip from a global one if the two agreed
    # here: at 0.05 every stage's own gradient norm is above the threshold, so a per-stage
    # clip scales each stage by another factor.
    m = model("mlp", 4)
    key = jax.random.PRNGKey(5)
    params = m.init_stages(key)
    batch = m.batch(jax.random.fold_in(key, 1), 8)
    fn = reference_stages(m)
    grads = jax.grad(lambda p: m.loss(fn(p, batch[0]), batch[1]))(params)
    norms = [float(optax.tree.norm(g)) for g in grads]
    assert min(norms) > 0.05
    assert max(norms) / min(norms) > 1.1


def test_an_optimizer_that_mixes_leaves_otherwise_is_refused() -> None:
    # Scaling every update by the mean over all leaves couples them, not through a norm.
    def mean_scale() -> optax.GradientTransformation:
        def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
            mean = sum(jnp.sum(u) for u in jax.tree_util.tree_leaves(updates))
            return jax.tree_util.tree_map(lambda u: u * mean, updates), state

        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    m = model("mlp", 2)
    params = m.init_stages(jax.random.PRNGKey(0))
    batch = m.batch(jax.random.PRNGKey(1), 8)
    pipe = Pipeline(m.stages, loss=m.loss, schedule=library("1f1b"))
    with pytest.raises(ExecutionError, match="combines parameters in another way than through the global norm"):
        pipe.train_step(params, None, batch, optimizer=mean_scale())


@pytest.mark.parametrize("dp", [1, 2])
def test_the_update_donates_the_resident_state_and_never_the_callers(dp: int) -> None:
    m = model("mlp", 2)
    params = m.init_stages(jax.random.PRNGKey(0))
    batch = m.batch(jax.random.PRNGKey(1), 8)
    # With dp 2 the first stage's mesh replicates the parameters over the caller's device too.
    # The workers hold the state where the tasks run apart (tests/executor/test_ticked.py
    # checks the one program over the stage axis).
    pipe = Pipeline(m.stages, loss=m.loss, schedule=library("1f1b"), options=RunOptions(dp=dp, ticks=False))
    optimizer = optax.adam(1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a donation XLA could not use warns
        p1, s1, _ = pipe.train_step(params, None, batch, optimizer=optimizer)
        resident = jax.tree_util.tree_leaves([(dict(w.leaves), dict(w.states)) for w in pipe.backend.workers])
        pipe.train_step(p1, s1, batch, optimizer=optimizer)
    # The caller's initial parameters are untouched; what the devices held after the first
    # step was updated in place by the second.
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(params))
    assert all(leaf.is_deleted() for leaf in resident if leaf.ndim)
    assert not any(leaf.is_deleted() for w in pipe.backend.workers for leaf in w.leaves.values())
