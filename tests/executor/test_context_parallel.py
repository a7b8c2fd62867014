"""Context parallelism in the executor: every sequence split over a ``"context"`` mesh axis of
each pipeline device, with the built-in transformer's causal attention; the step must equal one
device's, on the 8 forced CPU devices (cp = 2 with tp = 2 and pp = 2)."""

from __future__ import annotations

import re

import jax
import pytest
from jax.sharding import PartitionSpec

from helpers import (
    HYBRID_ADAM,
    assert_relative_close,
    assert_trees_close,
    hybrid,
    hybrid_problem,
    hybrid_reference_adam,
    hybrid_schedule,
)

COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(-start)?\(")


@pytest.mark.parametrize("form", ["explicit", "marked"])
def test_context_parallel_matches_one_device(form: str) -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem(form, schedule.num_stages, 1)
    pipe = hybrid(form, schedule, dp=1, tp=2, zero=0, cp=2)
    result = pipe.step(params, batch)
    assert abs(float(result.loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
    assert_relative_close(result.grads, ref_grads)
    # Each parameter leaf is held on the whole cp x tp stage mesh.
    held = [leaf for worker in pipe.backend.workers for leaf in worker.leaves.values()]
    assert {len(leaf.sharding.device_set) for leaf in held} == {4}


def test_context_parallel_training_matches_optax_on_one_device() -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", schedule.num_stages, 1)
    pipe = hybrid("explicit", schedule, dp=1, tp=2, zero=0, cp=2)
    state = None
    for ref_params, ref_loss in hybrid_reference_adam("explicit", schedule.num_stages, 1, steps=2):
        params, state, loss = pipe.train_step(params, state, batch, optimizer=HYBRID_ADAM)
        assert abs(float(loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
    assert_trees_close(pipe.gather(params), ref_params, atol=1e-6)


def test_sequences_are_split_over_the_context_axis() -> None:
    schedule = hybrid_schedule("1f1b", 2, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", schedule.num_stages, 1)
    plain = hybrid("explicit", schedule, dp=1, tp=2, zero=0).compile(params, batch)
    split = hybrid("explicit", schedule, dp=1, tp=2, zero=0, cp=2).compile(params, batch)
    tokens = jax.tree_util.tree_leaves(batch)[0].shape
    assert split[0].layout.batch(tokens).spec == PartitionSpec("data", "context")
    assert plain[0].layout.batch(tokens).spec == PartitionSpec("data")
    # Attention over a split sequence brings the other half's keys and values: the stage
    # programs communicate more than the same stages with whole sequences.
    for one, two in zip(plain, split, strict=True):
        for name in ("F", "B"):
            assert len(COLLECTIVE.findall(two.compiled_hlo()[name])) > len(COLLECTIVE.findall(one.compiled_hlo()[name]))
