"""Model FLOPs of a training step by the conventions sources report MFU with.

MFU is model FLOPs per step over (GPUs × peak × step time), and what counts as the
model's FLOPs differs by source; an MFU or TFLOP/s figure is comparable only under the
same count. Per token of a model with N parameters, L layers, hidden h, sequence s,
vocabulary V:

- ``6n``: 6·N (Kaplan et al.; the forward's 2·N and the backward's 4·N, attention's
  score products left out);
- ``palm``: 6·N + 12·L·h·s (Chowdhery et al. 2022, appendix B: the score products
  QKᵀ and AV, forward and backward, over the full sequence);
- ``megatron``: Narayanan et al. 2021's equation (3): the layers' forward FLOPs three
  times over (forward and backward), four with full recomputation, and the logits'
  three times; per layer and token 2 per matmul weight + 4·s·h, the logits 2·h·V (for
  GPT's shape with recomputation: their 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per
  iteration).
"""

from __future__ import annotations

import enum

from pipedsl.simulator.hardware import Model
from pipedsl.simulator.plan import Plan, Recompute

__all__ = ["FlopCount", "DEFAULT_FLOP_COUNT", "flops_per_token", "step_flops"]


class FlopCount(enum.Enum):
    """Which FLOPs an MFU counts (see the module docstring)."""

    SIX_N = "6n"
    PALM = "palm"
    MEGATRON = "megatron"


DEFAULT_FLOP_COUNT = FlopCount.SIX_N
"""The count an estimate's ``mfu`` uses unless told otherwise."""


def flops_per_token(model: Model, count: FlopCount, *, recompute: Recompute = Recompute.NONE) -> float:
    """Model FLOPs of training on one token under ``count`` (``recompute`` matters only
    to ``megatron``'s)."""
    if count is FlopCount.SIX_N:
        return 6.0 * model.num_params
    if count is FlopCount.PALM:
        return 6.0 * model.num_params + 12.0 * model.layers * model.hidden * model.seq_len
    passes = 4.0 if recompute is Recompute.FULL else 3.0
    return passes * model.layers * model.layer_forward_flops_per_token + 3.0 * model.logit_forward_flops_per_token


def step_flops(model: Model, plan: Plan, count: FlopCount = DEFAULT_FLOP_COUNT) -> float:
    """Model FLOPs of one training step of ``plan`` (``global_batch × seq_len`` tokens)
    under ``count``."""
    return flops_per_token(model, count, recompute=plan.recompute) * plan.global_batch * model.seq_len
