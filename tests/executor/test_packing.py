"""Values packed into a few buffers at a stage program's boundary: what groups together,
what travels alone, and that every value comes back as it went."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import library
from pipedsl.executor import Pipeline, RunOptions
from pipedsl.executor.models import llama
from pipedsl.executor.stages.packing import PACKED_BYTES, Packing


def _values() -> list[jax.Array]:
    key = jax.random.PRNGKey(0)
    big_rows = PACKED_BYTES // (4 * 64) + 1
    return [
        jax.random.normal(key, (2, 3, 64)),  # f32, last axis 64
        jnp.arange(5, dtype=jnp.int32),  # int32, last axis 5
        jax.random.normal(key, (7, 64)),  # f32, last axis 64: joins the first
        jnp.float32(2.5),  # a scalar: one row of one
        jnp.ones((4, 64), jnp.bfloat16),  # bf16, last axis 64: a group of its own dtype
        jax.random.normal(key, (big_rows, 64)),  # over PACKED_BYTES: alone
        jnp.zeros((0, 64)),  # empty: joins the f32 rows of 64
        jnp.array([True, False, True]),  # bool, last axis 3: alone in its group
        jax.random.key(3),  # a typed key: alone
        jnp.float32(-1.0),  # a second scalar: joins the first
    ]


def test_values_group_by_dtype_and_last_axis_and_large_ones_travel_alone() -> None:
    values = _values()
    packing = Packing.of(values)
    assert packing.groups == ((0, 2, 6), (1,), (3, 9), (4,), (5,), (7,), (8,))
    assert packing.size == len(values) and len(packing) == 7


def test_what_is_packed_comes_back_as_it_went_inside_a_program() -> None:
    values = _values()
    packing = Packing.of(values)
    buffers = jax.jit(packing.pack)(values)
    assert len(buffers) == len(packing)
    # Values alone pass through unreshaped; a group is its values' rows, one after another.
    assert buffers[0].shape == (2 * 3 + 7 + 0, 64) and buffers[2].shape == (2, 1)
    assert buffers[4].shape == values[5].shape
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
    with pytest.raises(ValueError, match="0 buffers given to a packing into 7"):
        packing.unpack(())


def _stage_programs(pipe: Pipeline) -> list[Any]:
    return [prog for worker in pipe.backend.workers for prog in worker.runtime.stages.values()]


def test_a_stage_on_one_device_keeps_its_residuals_in_fewer_buffers_than_values() -> None:
    # Two Llama layers a stage keep dozens of small residuals (norm statistics, projections
    # of 8 positions): on one device they leave F as a few buffers, and the steps train as
    # on one device (tests/executor/test_executor.py compares the gradients on every schedule).
    m = llama(num_stages=2, hidden=16, ffn_hidden=32, heads=4, kv_heads=2, seq_len=8, vocab=16, layers_per_stage=2)
    pipe = Pipeline(m.stages, loss=m.loss, schedule=library("zb_h1", pp=2), options=RunOptions(ticks=False))
    params = m.init_stages(jax.random.PRNGKey(0))
    batch = m.batch(jax.random.PRNGKey(1), 8)
    params, state, loss = pipe.train_step(params, None, batch, optimizer=optax.sgd(0.1))
    _, _, again = pipe.train_step(params, state, batch, optimizer=optax.sgd(0.1))
    assert float(again) < float(loss)
    for prog in _stage_programs(pipe):
        _, stored = prog._compiled_forward()
        plain = len(prog._res_slots)
        assert len(stored) < plain / 2, (prog.stage, len(stored), plain)
