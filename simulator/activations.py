"""What one layer of this project's executor keeps for its backward, per microbatch, as
its stage programs are compiled: the residuals JAX's autodiff saves for the built-in
blocks (:func:`pipedsl.executor.models.transformer`'s GPT block and
:func:`pipedsl.executor.models.llama`'s), which XLA's compiled forward writes out.

Per token of the microbatch on one device (e the compute dtype's bytes: 4 in fp32, 2 in
bf16, whose runs keep fp32 master weights apart; h hidden, f the feed-forward width, kv
the key/value width, a heads, s the sequence), in bytes:

- the two norms, which compute in fp32 whatever the compute dtype: each keeps three fp32
  values per hidden unit (LayerNorm: its centred input, the square's factor and the
  normalised output; RMSNorm: its input, the square's factor and the normalised output)
  and two per token (the reciprocal root and its factor): 2·(12·h + 8);
- each projection's input, once per matrix that reads it (autodiff saves the same value
  for every product): the normalised input e·h per query, key and value matrix (one
  fused QKV matrix in GPT, three in Llama) and per feed-forward input matrix (gate and up
  when gated), the attention's output e·h for the output projection, and the
  feed-forward's activation e·f for the down projection;
- the feed-forward's activation: 5·e·f (GELU's tanh form its input and four
  intermediates; SwiGLU the gate's and the up projection's outputs and SiLU's three);
- attention's inputs: Q, K and V, e·(h + 2·kv) where the core takes them as they are
  (FlashAttention, or under selective recomputation its inputs are all it keeps), e·3·h
  where the written-out core repeats each key/value head for its query heads;
- without FlashAttention or selective recomputation, per query token, head and key: the
  causal mask's byte, the masked scores e, the fp32 exponentials 4 and the probabilities
  e (1 + 2·e + 4), and two fp32 values per query token and head (the softmax's sums);
  ``jax.nn.dot_product_attention``'s XLA implementation (the built-in blocks' fused
  attention off a GPU) keeps its masked scores in fp32 whatever e (1 + 4 + 4 + e);
  FlashAttention keeps one fp32 value per token and head instead (its log-sum-exp);
- with dropout (which the built-in blocks do not have), one byte per value of each mask,
  as Korthikanti et al. 2022 count them: 2·h, and a·s of the attention's.

Full recomputation keeps only what enters the checkpointed region: e·h per token. The
executor checkpoints the whole stage, so it keeps that once per stage (by reference, the
stage's input) rather than once per layer as Megatron-LM does; the count is per layer, as
the planner's memory multiplies it by the layers of a stage. Under a named remat policy
(``save_dots``, ``save_qkv_proj``, ``save_mlp_inputs``) the executor checkpoints each
block with the policy: a block keeps its input and what the policy saves that its
backward reads (:func:`_policy_bytes`), the first block's input being the stage's, kept by
reference.

The nonlinearity's values per hidden unit follow ``Model.activation``
(:data:`_ACTIVATION_VALUES`); the built-in blocks are GELU (GPT) and SwiGLU (Llama).

Split over the t tensor-parallel ranks: everything past the column-parallel products (the
attention's inputs and core, its output, the feed-forward); the norms and the projections'
normalised inputs are whole on every rank, or split t ways under sequence parallelism.
Rotary positions keep two tables of s × d/2 per rotated projection, independent of the
batch and left out.
"""

from __future__ import annotations

from pipedsl.simulator.hardware import Model
from pipedsl.simulator.plan import Recompute

__all__ = ["NORM_BYTES", "SOFTMAX_BYTES", "compiled_layer_bytes", "compiled_weight_layer_bytes"]

NORM_BYTES = 4
"""Bytes per value the norms keep: they compute in fp32 whatever the compute dtype."""
SOFTMAX_BYTES = 4
"""Bytes per value of the fp32 softmax's exponentials and per-row statistics."""


def compiled_layer_bytes(
    model: Model,
    *,
    tokens: int,
    recompute: Recompute,
    tp: int,
    sequence_parallel: bool,
    flash_attention: bool,
    fp32_scores: bool = False,
) -> float:
    """Bytes one built-in block keeps per microbatch of ``tokens`` tokens on one device
    for its backward, as the executor compiles it (module docstring), with ``tp`` tensor
    ranks and ``recompute``, in the model's ``dtype_bytes`` as its compute dtype; with
    ``fp32_scores``, written-out attention keeps its masked scores in fp32."""
    h, f, kv, e, a = model.hidden, model.ffn_hidden, model.kv_width, model.dtype_bytes, model.heads
    q = model.q_width
    shared = tp if sequence_parallel else 1
    ffn_reads = 2 if model.gated_ffn else 1
    if recompute.per_layer:
        return tokens * _policy_bytes(model, recompute, tp=tp, shared=shared)
    llama_block = model.gated_ffn and not model.biases
    qkv_reads = 3 if llama_block else 1
    norms = model.norms * (3 * NORM_BYTES * h + 2 * NORM_BYTES)
    masks = 2 * h if model.dropout else 0
    replicated = norms + e * h * (qkv_reads + ffn_reads) + masks
    core_inputs = q + 2 * kv if flash_attention or recompute is Recompute.SELECTIVE else 3 * q
    split = e * (core_inputs + q + f + _ACTIVATION_VALUES[model.activation] * f)
    if flash_attention:
        scores = SOFTMAX_BYTES * a
    elif recompute is Recompute.SELECTIVE:
        scores = 0
    else:
        scores_bytes = SOFTMAX_BYTES if fp32_scores else e
        per_key = 1 + scores_bytes + e + SOFTMAX_BYTES + (1 if model.dropout else 0)
        scores = a * model.seq_len * per_key + 2 * SOFTMAX_BYTES * a
    return tokens * (replicated / shared + (split + scores) / tp)


def compiled_weight_layer_bytes(model: Model, *, tokens: int, tp: int, sequence_parallel: bool) -> float:
    """Bytes one built-in block keeps per microbatch of ``tokens`` tokens on one device
    from its ``I`` to its ``W`` as the executor splits its backward: what ``W`` still
    needs, whatever the recompute mode (``I`` reruns what was not kept), in the model's
    ``dtype_bytes`` e as its compute dtype, per token:

    - each weight product's input, once per matrix that reads it (as ``F`` kept it): the
      normalised input e·h per query, key and value matrix (one fused QKV matrix in GPT)
      and per feed-forward input matrix, the attention's output e·q and the feed-forward's
      activation e·f;
    - the cotangent of each product's output, which ``I`` computes: e·(q + 2·kv) of the
      QKV products, e·h of the output projection and of the down projection, e·f per
      feed-forward input matrix; twice where the products have biases (the bias's
      gradient reads the cotangent in the activation's shape, the weight's in rows of
      tokens: two buffers);
    - per norm, its normalised value and its output's cotangent, in fp32 (``W`` computes
      the norm's scale).

    Nothing of the attention's core (it has no weights): under written-out attention
    ``W`` keeps far less than ``F``. Split over t tensor ranks as
    :func:`compiled_layer_bytes` splits: the column-parallel products' outputs and the
    row-parallel products' inputs; the rest whole on every rank, or split t ways under
    sequence parallelism."""
    h, f, kv, e, q = model.hidden, model.ffn_hidden, model.kv_width, model.dtype_bytes, model.q_width
    shared = tp if sequence_parallel else 1
    llama_block = model.gated_ffn and not model.biases
    qkv_reads = 3 if llama_block else 1
    ffn_reads = 2 if model.gated_ffn else 1
    copies = 2 if model.biases else 1
    norms = model.norms * 2 * NORM_BYTES * h
    replicated = norms + e * h * (qkv_reads + ffn_reads) + copies * e * 2 * h
    split = e * (q + f) + copies * e * (q + 2 * kv + ffn_reads * f)
    return tokens * (replicated / shared + split / tp)


_ACTIVATION_VALUES = {"gelu": 5, "silu": 5, "relu": 1, "squared_relu": 2}
"""Values per hidden unit the feed-forward's nonlinearity keeps for its backward (with the
gate's and up projection's outputs where gated): GELU's tanh form its input and four
intermediates, SwiGLU the gate's and up's outputs and SiLU's three, ReLU its input, squared
ReLU its input and the ReLU's output."""


def _policy_bytes(model: Model, recompute: Recompute, *, tp: int, shared: int) -> float:
    """Bytes per token a block checkpointed on its own keeps under a remat policy that
    reruns it (``full`` or a named one): its input, and the values the policy saves
    (:func:`pipedsl.executor.stages.stage_options.saved` names them in the built-in
    blocks) that the backward reads: the QKV projection's outputs (GPT's fused 3·h, Llama's
    Q, K and V), the feed-forward's input products (gate and up where gated), the
    attention's output projection (which rebuilds the feed-forward's input), the
    feed-forward's input."""
    h, e, f = model.hidden, model.dtype_bytes, model.ffn_hidden
    llama_block = model.gated_ffn and not model.biases
    qkv = model.q_width + 2 * model.kv_width if llama_block else 3 * model.q_width
    ffn_in = (2 if model.gated_ffn else 1) * f
    kept = e * h / shared
    if recompute is Recompute.SAVE_DOTS:
        kept += e * (qkv + ffn_in) / tp + e * h / shared
    elif recompute is Recompute.SAVE_QKV_PROJ:
        kept += e * qkv / tp + e * h / shared
    elif recompute is Recompute.SAVE_MLP_INPUTS:
        kept += e * h / shared
    return kept
