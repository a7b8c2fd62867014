"""A model the planner priced, at a size this machine can run.

``pipedsl run --plan N`` runs a searched plan's layout (degrees, schedule, microbatches,
ZeRO stage, recomputation, sequence parallelism, fused attention) on the executor's built-in
model of the priced model's family: :func:`~pipedsl.executor.models.llama` for a gated
(SwiGLU), bias-free preset (``llama-8b``), :func:`~pipedsl.executor.models.transformer`
for a GPT-style one. The demo's own model (``demo-cpu``, and rows that name no model) runs
at its size; any other preset keeps its family, its ratio of query to key/value heads and
of feed-forward to model width, and is scaled down to :data:`MAX_HIDDEN` wide, one layer
per stage, a sequence of :data:`MAX_SEQ` and a vocabulary of :data:`MAX_VOCAB`, so that it
compiles and steps in seconds on CPU cores. :class:`Scaled` says what was scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipedsl.cli.workload import DEMO_MODEL
from pipedsl.errors import PipedslError
from pipedsl.simulator.hardware import Model, load_model

__all__ = ["MAX_HIDDEN", "MAX_SEQ", "MAX_VOCAB", "Scaled", "priced_model", "scaled_model"]

MAX_HIDDEN = 64
"""Model width at most, once scaled."""
MAX_SEQ = 32
"""Tokens per sequence at most, once scaled."""
MAX_VOCAB = 256
"""Vocabulary at most, once scaled."""
_HEAD_WIDTH = 8


@dataclass(frozen=True, slots=True)
class Scaled:
    """The model to run and what it stands for.

    Attributes:
      model: the built-in model (a :class:`~pipedsl.executor.models.BuiltinModel`).
      shape: its shape in words.
      note: what was scaled down, in words; None when the priced model runs at its size.
    """

    model: Any
    shape: str
    note: str | None


def _words(m: Model, layers: int) -> str:
    kv = f" / {m.num_kv_heads} kv" if m.num_kv_heads != m.heads else ""
    return (
        f"{layers} layer{'s' if layers != 1 else ''}, hidden {m.hidden}, ffn {m.ffn_hidden}, {m.heads} heads{kv}, seq {m.seq_len}, "
        f"vocab {m.vocab}"
    )


def _multiple(value: float, of: int) -> int:
    return max(of, int(round(value / of)) * of)


def priced_model(name: str | None) -> Model:
    """The model a plan was priced for: the preset or TOML file ``name``, or the demo's (None)."""
    return DEMO_MODEL if name is None or name == DEMO_MODEL.name else load_model(name)


def scaled_model(name: str | None, *, num_stages: int, tp: int, fused_attention: bool) -> Scaled:
    """The built-in model that runs a plan priced for model ``name`` (a preset or TOML
    path; None: the demo's) over ``num_stages`` stages with ``tp``-way tensor
    parallelism (see the module docstring)."""
    from pipedsl.executor.models import llama, transformer

    priced = priced_model(name)
    gpt = not priced.gated_ffn
    if priced is DEMO_MODEL:
        if priced.layers % num_stages:
            raise PipedslError(
                f"the plan has {num_stages} stages; the demo transformer's {priced.layers} layers split evenly only "
                "over a number of stages that divides them"
            )
        model = transformer(
            num_stages=num_stages, vocab=priced.vocab, dim=priced.hidden, heads=priced.heads, seq=priced.seq_len,
            layers_per_stage=priced.layers // num_stages, fused_attention=fused_attention,
        )  # fmt: skip
        return Scaled(model, _words(priced, priced.layers), None)
    # Keep the shape's ratios; every split tensor parallelism makes (heads, key/value
    # heads, feed-forward units, vocabulary) divides by tp.
    groups = priced.heads // priced.num_kv_heads
    most = MAX_HIDDEN // _HEAD_WIDTH
    unit = groups * tp  # heads: whole groups of queries per key/value head, tp-way
    if unit <= most:
        heads = unit * max(1, min(priced.heads, most) // unit)
        kv_heads = heads // groups
    else:  # too many groups to keep: one key/value head shared by every query head
        heads, kv_heads = max(tp, most // tp * tp), 1
    hidden = heads * _HEAD_WIDTH
    ffn = _multiple(hidden * priced.ffn_hidden / priced.hidden, _HEAD_WIDTH * tp)
    seq, vocab = min(priced.seq_len, MAX_SEQ), _multiple(min(priced.vocab, MAX_VOCAB), tp)
    layers = num_stages
    if gpt:
        model = transformer(
            num_stages=num_stages, vocab=vocab, dim=hidden, heads=heads, seq=seq, fused_attention=fused_attention
        )
        ran = Model(
            name="transformer",
            layers=layers,
            hidden=hidden,
            ffn_hidden=4 * hidden,
            heads=heads,
            seq_len=seq,
            vocab=vocab,
            dropout=False,
        )
    else:
        model = llama(
            num_stages=num_stages, hidden=hidden, ffn_hidden=ffn, heads=heads, kv_heads=kv_heads, seq_len=seq,
            vocab=vocab, fused_attention=fused_attention,
        )  # fmt: skip
        ran = Model(
            name="llama", layers=layers, hidden=hidden, ffn_hidden=ffn, heads=heads, kv_heads=kv_heads, seq_len=seq,
            vocab=vocab, gated_ffn=True, dropout=False,
        )  # fmt: skip
    note = f"scaled down: {priced.name} ({_words(priced, priced.layers)}) runs as {ran.name} ({_words(ran, layers)})"
    return Scaled(model, _words(ran, layers), note)
