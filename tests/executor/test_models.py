"""The built-in models: one stage of the whole transformer is its stages composed, and each
counts its parameters from its sizes as its initializer makes them."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from pipedsl.executor.models import BuiltinModel, llama, mlp, reference_stages, transformer


def test_one_stage_transformer_is_its_stages_composed() -> None:
    # The one-stage form is what every SPMD plan runs: each block must run once in it,
    # as in the stages of a pipeline, not once per part it is built from.
    sizes = {"vocab": 16, "dim": 8, "heads": 2, "seq": 4}
    staged = transformer(num_stages=3, layers_per_stage=1, **sizes)
    whole = transformer(num_stages=1, layers_per_stage=3, **sizes)
    stages = staged.init_stages(jax.random.PRNGKey(0))
    merged = {
        "blocks": [block for stage in stages for block in stage["blocks"]],
        "embed": stages[0]["embed"],
        "pos": stages[0]["pos"],
        "ln_f": stages[-1]["ln_f"],
        "head": stages[-1]["head"],
    }
    assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(
        whole.init_stages(jax.random.PRNGKey(1))[0]
    )
    tokens, _ = staged.batch(jax.random.PRNGKey(2), 5)
    composed = reference_stages(staged)(stages, tokens)
    np.testing.assert_allclose(whole.stages[0](merged, tokens), composed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "model",
    [
        mlp(num_stages=3, width=5, layers_per_stage=2),
        transformer(num_stages=2, dim=8, layers_per_stage=3),
        llama(num_stages=2, hidden=16, ffn_hidden=24, heads=4, kv_heads=2, layers_per_stage=2),
    ],
    ids=lambda model: model.name,
)
def test_a_model_counts_its_parameters_from_its_sizes(model: BuiltinModel) -> None:
    shapes = jax.eval_shape(model.init_stages, jax.random.PRNGKey(0))
    assert model.parameters == sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(shapes))
