"""Values packed into a few buffers at a stage program's boundary: what groups together,
what travels alone, and that every value comes back as it went."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_trees_close, library
from pipedsl.executor import Pipeline, RunOptions
from pipedsl.executor.models import llama
from pipedsl.executor.stages.packing import Packing


def _values() -> list[jax.Array]:
    key = jax.random.PRNGKey(0)
    return [
        jax.random.normal(key, (2, 3, 64)),  # f32, last axis 64
        jnp.arange(5, dtype=jnp.int32),  # int32, last axis 5
        jax.random.normal(key, (7, 64)),  # f32, last axis 64: joins the first
        jnp.float32(2.5),  # a scalar: one row of one
        jnp.ones((4, 64), jnp.bfloat16),  # bf16, last axis 64: a group of its own dtype
        jax.random.normal(key, (3, 64)),  # f32, last axis 64: joins the first
        jnp.zeros((0, 64)),  # empty: joins the f32 rows of 64
        jnp.array([True, False, True]),  # bool, last axis 3: alone in its group
        jax.random.key(3),  # a typed key: alone
        jnp.float32(-1.0),  # a second scalar: joins the first
    ]


def test_values_group_by_dtype_and_last_axis() -> None:
    values = _values()
    packing = Packing.of(values)
    assert packing.groups == ((0, 2, 5, 6), (1,), (3, 9), (4,), (7,), (8,))
    assert len(packing.shapes) == len(values) and len(packing) == 6


def test_what_is_packed_comes_back_as_it_went_inside_a_program() -> None:
    values = _values()
    packing = Packing.of(values)
    buffers = jax.jit(packing.pack)(values)
    assert len(buffers) == len(packing)
    # Values alone pass through unreshaped; a group is its values' rows, one after another.
    assert buffers[0].shape == (2 * 3 + 7 + 3 + 0, 64) and buffers[2].shape == (2, 1)
    assert buffers[3].shape == values[4].shape
    back = jax.jit(packing.unpack)(buffers)
    for value, returned in zip(values, back, strict=True):
        assert returned.shape == value.shape and returned.dtype == value.dtype
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
            assert np.array_equal(jax.random.key_data(returned), jax.random.key_data(value))
        else:
            assert np.array_equal(np.asarray(returned), np.asarray(value))


def test_a_wrong_number_of_values_or_buffers_is_refused() -> None:
    packing = Packing.of(_values())
    with pytest.raises(ValueError, match="3 values given to a packing of 10"):
        packing.pack(_values()[:3])
    with pytest.raises(ValueError, match="0 buffers given to a packing into 6"):
        packing.unpack(())


def _stage_programs(pipe: Pipeline) -> list[Any]:
    return [prog for worker in pipe.backend.workers for prog in worker.runtime.stages.values()]


@pytest.mark.parametrize(("schedule", "dp"), [("zb_h1", 1), ("1f1b", 2)])
def test_packed_residuals_give_the_gradients_of_residuals_apart(schedule: str, dp: int) -> None:
    # Two Llama layers a stage keep dozens of small residuals (norm statistics, projections
    # of 8 positions); packed, they leave F as a few buffers. zb_h1 hands W its values
    # packed too; with dp = 2 every device packs its own share.
    m = llama(num_stages=2, hidden=16, ffn_hidden=32, heads=4, kv_heads=2, seq_len=8, vocab=16, layers_per_stage=2)
    params = m.init_stages(jax.random.PRNGKey(0))
    batch = m.batch(jax.random.PRNGKey(1), 8)
    results = {}
    for packed in (True, False):
        options = RunOptions(dp=dp, pack_residuals=packed)
        pipe = Pipeline(m.stages, loss=m.loss, schedule=library(schedule, pp=2), options=options)
        results[packed] = pipe.value_and_grad(params, batch)
        for prog in _stage_programs(pipe):
            _, stored = prog._compiled_forward()
            plain = len(prog._res_slots)
            assert (len(stored) < plain / 2) == packed, (prog.stage, len(stored), plain)
        pipe.close()
    assert np.allclose(results[True][0], results[False][0], rtol=1e-6)
    assert_trees_close(results[True][1], results[False][1], atol=1e-6)


def test_residuals_travel_apart_on_cpu_devices_unless_asked() -> None:
    m = llama(num_stages=2, hidden=16, ffn_hidden=32, heads=4, kv_heads=2, seq_len=8, vocab=16)
    pipe = Pipeline(m.stages, loss=m.loss, schedule=library("1f1b", pp=2))
    pipe.value_and_grad(m.init_stages(jax.random.PRNGKey(0)), m.batch(jax.random.PRNGKey(1), 8))
    for prog in _stage_programs(pipe):
        assert len(prog._compiled_forward()[1]) == len(prog._res_slots)
    pipe.close()
