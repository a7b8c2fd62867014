"""The planner's activation bytes per layer under the ``pipedsl`` framework against what the
compiled stage programs keep, for the built-in GPT and Llama blocks, in fp32 and bf16, per
recompute mode, with written-out and fused attention."""

from __future__ import annotations

import jax
import pytest

from helpers import hybrid_schedule
from pipedsl.executor import Pipeline, RunOptions
from pipedsl.executor.models import BuiltinModel, llama, transformer
from pipedsl.simulator.hardware import Model, load_cluster
from pipedsl.simulator.plan import Plan
from pipedsl.simulator.transformer import Shapes

STAGES, LAYERS, MICROBATCH, MICROBATCHES = 3, 2, 2, 4
HIDDEN, FFN, HEADS, KV_HEADS, SEQ, VOCAB = 64, 128, 4, 2, 32, 32

CASES = [
    (kind, precision, recompute, fused)
    for kind in ("llama", "gpt")
    for precision in ("fp32", "bf16")
    for recompute, fused in (("none", False), ("none", True), ("selective", False), ("full", False))
]


def _model(kind: str, fused: bool) -> BuiltinModel:
    if kind == "llama":
        return llama(
            num_stages=STAGES, hidden=HIDDEN, ffn_hidden=FFN, heads=HEADS, kv_heads=KV_HEADS, seq_len=SEQ,
            vocab=VOCAB, layers_per_stage=LAYERS, fused_attention=fused,
        )  # fmt: skip
    return transformer(
        num_stages=STAGES, vocab=VOCAB, dim=HIDDEN, heads=HEADS, seq=SEQ, layers_per_stage=LAYERS, fused_attention=fused
    )


def _planned(kind: str, precision: str, recompute: str) -> float:
    """The planner's bytes per layer and microbatch. Fused attention off the GPU is XLA's
    written-out attention, which keeps its scores: no FlashAttention to the planner."""
    llama_style = kind == "llama"
    model = Model(
        name=kind, layers=STAGES * LAYERS, hidden=HIDDEN, ffn_hidden=4 * HIDDEN if not llama_style else FFN,
        heads=HEADS, kv_heads=KV_HEADS if llama_style else None, seq_len=SEQ, vocab=VOCAB,
        dtype_bytes=4 if precision == "fp32" else 2, gated_ffn=llama_style, biases=not llama_style,
        learned_positions=not llama_style, tied_embeddings=False, dropout=False,
    )  # fmt: skip
    plan = Plan(
        pp=STAGES, microbatch_size=MICROBATCH, global_batch=MICROBATCH * MICROBATCHES, schedule="1f1b",
        recompute=recompute, flash_attention=False, framework="pipedsl",
    )  # fmt: skip
    return Shapes(model, load_cluster("h200"), plan).layer_activation_bytes(plan.recompute)


@pytest.mark.parametrize(("kind", "precision", "recompute", "fused"), CASES)
def test_planned_layer_bytes_are_what_the_compiled_middle_stage_keeps(
    kind: str, precision: str, recompute: str, fused: bool
) -> None:
    m = _model(kind, fused)
    params = m.init_stages(jax.random.PRNGKey(0))
    batch = m.batch(jax.random.PRNGKey(1), MICROBATCH * MICROBATCHES)
    schedule = hybrid_schedule("1f1b", STAGES, 1)
    pipe = Pipeline(
        m.stages,
        loss=m.loss,
        schedule=schedule,
        options=RunOptions(recompute=recompute, precision=precision),  # type: ignore[arg-type]
    )
    # The middle stage has neither the embedding nor the head: all it keeps is its layers'.
    kept = pipe.compile(params, batch)[1].memory().kept
    planned = _planned(kind, precision, recompute)
    if recompute == "full":
        # One checkpoint around the whole stage: its forward keeps nothing it computes, only
        # the stage's input (by reference), which is what the planner counts per layer.
        assert kept == 0
        assert planned == MICROBATCH * SEQ * HIDDEN * (4 if precision == "fp32" else 2)
        return
    assert kept / LAYERS == pytest.approx(planned, rel=0.1)
