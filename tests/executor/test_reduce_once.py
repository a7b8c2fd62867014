"""ZeRO 2 and 3 reduced once per step (FSDP without per-microbatch sync, Llama 3's mode;
Megatron-LM's distributed optimizer): the stage programs keep each device's gradients
unreduced through every backward and the step's one reduction reduce-scatters them, as the
estimator prices ``reduce_once=True``."""

from __future__ import annotations

import re

import jax
import pytest

from helpers import HYBRID_ADAM, assert_relative_close, assert_trees_close, hybrid, hybrid_problem, hybrid_schedule

COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather)(-start)?\(")


def _found(text: str) -> list[str]:
    return [m.group(1) for m in COLLECTIVE.finditer(text)]


def test_zero_2_reduced_once_issues_one_reduction_per_step() -> None:
    schedule = hybrid_schedule("gpipe", 1, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", 1, 2)
    (every,) = hybrid("explicit", schedule, dp=2, tp=1, zero=2).compile(params, batch)
    (once,) = hybrid("explicit", schedule, dp=2, tp=1, zero=2, reduce_once=True).compile(params, batch)
    # Per microbatch: ZeRO 2 reduce-scatters in every backward; reduced once, no backward
    # communicates, and the step's reduction is a single reduce-scatter of every leaf.
    assert _found(every.compiled_hlo()["B"]) == ["reduce-scatter"]
    assert _found(once.compiled_hlo()["B"]) == []
    assert _found(once.compiled_hlo()["reduce"]) == ["reduce-scatter"]
    assert len(jax.tree_util.tree_leaves(params)) > 1
    assert schedule.num_microbatches > 1


def test_zero_3_reduced_once_gathers_weights_but_reduces_once() -> None:
    schedule = hybrid_schedule("gpipe", 1, 1)
    _, params, batch, _, _ = hybrid_problem("explicit", 1, 2)
    (once,) = hybrid("explicit", schedule, dp=2, tp=1, zero=3, reduce_once=True).compile(params, batch)
    # The weights are still gathered where used; the gradients are not reduced per backward.
    assert "reduce-scatter" not in _found(once.compiled_hlo()["B"])
    assert "all-gather" in _found(once.compiled_hlo()["B"])
    assert _found(once.compiled_hlo()["reduce"]) == ["reduce-scatter"]


@pytest.mark.parametrize(
    ("dp", "tp", "pp", "name", "zero"), [(4, 2, 1, "gpipe", 2), (2, 2, 2, "1f1b", 2), (2, 2, 2, "1f1b", 3)]
)
def test_reduced_once_matches_reduced_every_backward(dp: int, tp: int, pp: int, name: str, zero: int) -> None:
    schedule = hybrid_schedule(name, pp, 1)
    _, params, batch, ref_loss, ref_grads = hybrid_problem("explicit", schedule.num_stages, dp)
    once = hybrid("explicit", schedule, dp=dp, tp=tp, zero=zero, reduce_once=True)
    result = once.step(params, batch)
    assert abs(float(result.loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
    assert_relative_close(result.grads, ref_grads)
    every = hybrid("explicit", schedule, dp=dp, tp=tp, zero=zero)
    p_once, s_once, _ = once.train_step(params, None, batch, optimizer=HYBRID_ADAM)
    p_every, _, _ = every.train_step(params, None, batch, optimizer=HYBRID_ADAM)
    assert_trees_close(once.gather(p_once), every.gather(p_every), atol=1e-6)
    # The optimizer state stays sharded over "data", as ZeRO 2's and 3's.
    big = max(jax.tree_util.tree_leaves(once.backend.workers[0].states[0]), key=lambda leaf: leaf.size)
    assert "data" in str(big.sharding.spec)
