"""Recompute modes, sequence parallelism, fused attention, bf16 and the Llama block: each on a
hybrid plan (dp x tp x pp), against the one-device reference of the same precision."""

from __future__ import annotations

from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_trees_close, hybrid_schedule
from pipedsl import RunOptionsError
from pipedsl.executor import ExecutionError, Pipeline, RunOptions
from pipedsl.executor.models import BuiltinModel, llama, reference_stages, transformer
from pipedsl.executor.stages.stage_options import sequence_sharded

MICROBATCHES = 4
DP, TP, PP = 2, 2, 2


@cache
def _model(kind: str, fused: bool) -> BuiltinModel:
    if kind == "llama":
        return llama(
            num_stages=PP, hidden=16, ffn_hidden=32, heads=4, kv_heads=2, seq_len=8, vocab=16, fused_attention=fused
        )
    return transformer(num_stages=PP, vocab=16, dim=8, heads=2, seq=8, fused_attention=fused)


def _bf16(params: Any) -> Any:
    return jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)


@cache
def _problem(kind: str, fused: bool, precision: str) -> tuple[Any, Any, jax.Array, Any]:
    """(params, batch, loss, grads) of the unsplit model on one device, computing in
    ``precision`` (bf16: the parameters cast to bf16 inside the differentiated function,
    so the gradients are of the fp32 parameters)."""
    m = _model(kind, fused)
    key = jax.random.PRNGKey(3)
    params = m.init_stages(key)
    batch = m.batch(jax.random.fold_in(key, 1), MICROBATCHES * DP)
    fn = reference_stages(m)
    cast = _bf16 if precision == "bf16" else (lambda p: p)
    loss, grads = jax.jit(jax.value_and_grad(lambda p, x, t: m.loss(fn(cast(p), x), t)))(params, *batch)
    return params, batch, loss, grads


CASES = [
    # (model, recompute, sequence_parallel, fused attention, precision)
    ("transformer", "none", False, False, "fp32"),
    ("transformer", "selective", True, False, "fp32"),
    ("transformer", "full", False, True, "fp32"),
    ("llama", "selective", True, True, "fp32"),
    ("llama", "none", False, False, "bf16"),
    ("llama", "selective", True, True, "bf16"),
]


@pytest.mark.parametrize(("kind", "recompute", "sp", "fused", "precision"), CASES)
def test_options_give_the_one_device_result(kind: str, recompute: str, sp: bool, fused: bool, precision: str) -> None:
    m = _model(kind, fused)
    params, batch, ref_loss, ref_grads = _problem(kind, fused, precision)
    pipe = Pipeline(
        m.stages,
        loss=m.loss,
        schedule=hybrid_schedule("1f1b", PP, 1),
        options=RunOptions(dp=DP, tp=TP, recompute=recompute, sequence_parallel=sp, precision=precision),  # type: ignore[arg-type]
        param_specs=m.param_specs(params),
    )
    result = pipe.step(params, batch)
    # Gradients accumulate in fp32 whatever the compute precision.
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(result.grads))
    if precision == "fp32":
        np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=1e-5)
        assert_trees_close(result.grads, ref_grads)
    else:
        np.testing.assert_allclose(float(result.loss), float(ref_loss), rtol=2e-2)
        assert _relative_error(result.grads, ref_grads) < 2e-2


def _relative_error(actual: Any, expected: Any) -> float:
    """The L2 distance of two gradient trees over the norm of ``expected``, all leaves
    together. Two bf16 computations of one gradient differ by bf16's rounding wherever
    they sum in other orders (tensor-parallel partial sums are rounded to bf16 before
    their all-reduce): at these widths about 1.6% here, while the bf16 reference itself
    is 1.9% away from fp32's gradient and a wrong gradient is O(1) away."""
    a_leaves, a_def = jax.tree_util.tree_flatten(jax.device_get(actual))
    e_leaves, e_def = jax.tree_util.tree_flatten(jax.device_get(expected))
    assert a_def == e_def
    a = np.concatenate([np.ravel(v) for v in a_leaves]).astype(np.float64)
    e = np.concatenate([np.ravel(v) for v in e_leaves]).astype(np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def test_bf16_keeps_fewer_activation_bytes_and_no_weight_copies() -> None:
    m = _model("llama", False)
    params, batch, _, _ = _problem("llama", False, "bf16")

    def memory(precision: str) -> list[Any]:
        schedule = hybrid_schedule("1f1b", PP, 1)
        pipe = Pipeline(m.stages, loss=m.loss, schedule=schedule, options=RunOptions(precision=precision))  # type: ignore[arg-type]
        programs = pipe.compile(params, batch)
        found = [program.memory() for program in programs]
        # What F keeps, compiled alone, is what the analysis of F and B together says.
        assert [program.kept() for program in programs] == [f.kept for f in found]
        return found

    for full, half in zip(memory("fp32"), memory("bf16"), strict=True):
        # bf16 activations halve what is kept, but for what the model computes in fp32 (its
        # norms, rotary positions, softmax): 0.64 of fp32's here. A bf16 copy of the
        # weights kept per microbatch would add half the fp32 parameter bytes (0.79).
        assert half.kept < 0.7 * full.kept
        assert half.kept + half.params / 2 > 0.7 * full.kept


def test_sequence_parallel_splits_the_residual_stream_over_tensor() -> None:
    m = _model("transformer", False)
    params, batch, _, _ = _problem("transformer", False, "fp32")

    def first_stage(sp: bool) -> Any:
        pipe = Pipeline(
            m.stages, loss=m.loss, schedule=hybrid_schedule("1f1b", PP, 1),
            options=RunOptions(tp=TP, sequence_parallel=sp), param_specs=m.param_specs(params),
        )  # fmt: skip
        return pipe.compile(params, batch)[0]

    plain, split = first_stage(False), first_stage(True)
    # Each device keeps its 1/tp of the sequence of what the norms read (the residual
    # stream), and the residual stream is gathered where a column-parallel product
    # needs all of it (XLA on CPU writes the reduce-scatter as an all-reduce and a slice).
    assert split.memory().kept < plain.memory().kept
    assert split.compiled_hlo()["F"].count("all-gather(") > plain.compiled_hlo()["F"].count("all-gather(")


def test_sequence_sharded_is_the_identity_outside_a_pipeline() -> None:
    x = jnp.arange(24.0).reshape(2, 4, 3)
    assert sequence_sharded(x) is x


def test_recompute_per_stage_gives_each_stage_its_mode() -> None:
    m = _model("transformer", False)
    params, batch, _, _ = _problem("transformer", False, "fp32")
    schedule = hybrid_schedule("1f1b", PP, 1)

    def kept(recompute: Any) -> list[int]:
        pipe = Pipeline(m.stages, loss=m.loss, schedule=schedule, options=RunOptions(recompute=recompute))
        return [program.memory().kept for program in pipe.compile(params, batch)]

    full, none = kept("full"), kept("none")
    assert kept(("full", "none")) == [full[0], none[1]]
    assert kept(["none", "full"]) == [none[0], full[1]]


def test_options_are_a_run_options_with_a_mode_per_stage_of_the_schedule() -> None:
    m = _model("transformer", False)
    schedule = hybrid_schedule("1f1b", PP, 1)
    with pytest.raises(ExecutionError, match=r"options must be a pipedsl.RunOptions, such as RunOptions\(dp=2"):
        Pipeline(m.stages, loss=m.loss, schedule=schedule, options={"dp": 2})  # type: ignore[arg-type]
    with pytest.raises(RunOptionsError, match="recompute gives 3 modes but the schedule has 2 stages") as caught:
        Pipeline(m.stages, loss=m.loss, schedule=schedule, options=RunOptions(recompute=("full",) * 3))
    assert caught.value.argument == "recompute"


def test_recompute_modes_keep_activation_bytes_in_the_order_the_planner_prices() -> None:
    from pipedsl.simulator.hardware import Model, load_cluster
    from pipedsl.simulator.plan import Plan
    from pipedsl.simulator.transformer import Shapes

    m = _model("transformer", False)
    params, batch, _, _ = _problem("transformer", False, "fp32")
    modes = ("none", "selective", "full")
    kept = {}
    for mode in modes:
        schedule = hybrid_schedule("1f1b", PP, 1)
        pipe = Pipeline(m.stages, loss=m.loss, schedule=schedule, options=RunOptions(recompute=mode))  # type: ignore[arg-type]
        kept[mode] = sum(program.memory().kept for program in pipe.compile(params, batch))
    priced_model = Model(name="t", layers=PP, hidden=8, ffn_hidden=32, heads=2, seq_len=8, vocab=16, dtype_bytes=4)
    cluster = load_cluster("h200")
    priced = {
        mode: Shapes(
            priced_model, cluster,
            Plan(pp=PP, microbatch_size=2, global_batch=8, schedule="1f1b", recompute=mode, flash_attention=False),
        ).layer_activation_bytes(Plan(global_batch=8, recompute=mode).recompute)
        for mode in modes
    }  # fmt: skip
    assert kept["none"] > kept["selective"] > kept["full"]
    assert priced["none"] > priced["selective"] > priced["full"]
