"""Built-in small models with synthetic data, for ``pipedsl run``, tests and benchmarks.

Each :class:`BuiltinModel` comes in both forms a :class:`~pipedsl.executor.Pipeline`
takes:

- explicit: ``stages[s](params[s], x)`` with ``params`` a list of per-stage pytrees
  (``init_stages``);
- marked: ``model_fn(params, x)`` with ``stage_boundary`` markers (``init_function``).
  The marked forms use what only automatic splitting can route: the MLP adds a skip
  connection from its first stage to its last, and the transformer ties its output
  head to its input embedding (one parameter used by the first and the last stage) and
  computes its positional table and causal mask from no data at all.

``reference_stages`` and ``model_fn`` itself are the unsplit models, the ground truth a
pipelined step must reproduce.

Tensor parallelism: ``model.param_specs(params)`` gives the ``PartitionSpec`` pytree that
:class:`~pipedsl.executor.Pipeline` takes as ``param_specs`` (with ``tp > 1``); for the
transformer it is :func:`transformer_specs`, Megatron's layout: the attention's fused QKV
projection and the MLP's first matrix split column-wise over ``"tensor"`` (a slice of the
projections and of the hidden units per device), the attention output and the MLP's
second matrix split row-wise (their partial sums are all-reduced by XLA), the token
embedding and the output head split over the vocabulary. The fused QKV columns are laid
out ``[q | k | v]``, so a column slice holds whole heads of one projection; XLA regroups
them for the attention. The MLP's specs replicate
everything.

Writing specs for your own model: return a pytree with the structure of your parameters
(or a prefix of it) whose leaves are ``PartitionSpec`` naming the mesh axis ``"tensor"``
on the axis to split (``PartitionSpec(None, "tensor")`` splits a ``[in, out]`` matrix by
columns) or None to replicate. Any consistent choice gives the same results (XLA inserts
whatever collectives the layout needs); a good one keeps the collectives to one
all-reduce per matrix pair. Do not name ``"data"``: data parallelism and ZeRO add it.

The Llama model (:func:`llama`: RMSNorm, SwiGLU, rotary positions, grouped-query
attention) takes its sizes under the simulator's model presets' names; :func:`llama_specs`
is its layout. Both transformers call :func:`attention` (written out, or fused with
``fused_attention``), whose core ``recompute="selective"`` recomputes, checkpoint each block
under a named remat policy and tag the values the policies save
(:func:`~pipedsl.executor.stages.stage_options.block_checkpoint`,
:func:`~pipedsl.executor.stages.stage_options.saved`), and pass their residual stream through :func:`~pipedsl.executor.stages.stage_options.sequence_sharded` for
sequence parallelism (:mod:`pipedsl.executor.stages.stage_options`).

Shapes: the MLP maps ``f32[batch, width]`` to ``f32[batch, width]`` under a mean squared
error; the transformer maps token ids ``i32[batch, seq]`` to logits
``f32[batch, seq, vocab]`` under the mean cross-entropy of next-token targets
``i32[batch, seq]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pipedsl.executor.model_sizes import llama_block, mlp_layer, transformer_block
from pipedsl.executor.stages.mesh import TENSOR
from pipedsl.executor.stages.split import stage_boundary
from pipedsl.executor.stages.stage_options import block_checkpoint, saved, selective, sequence_sharded

__all__ = [
    "BuiltinModel",
    "attention",
    "llama",
    "llama_specs",
    "mlp",
    "transformer",
    "transformer_specs",
    "MODELS",
    "reference_stages",
]

Params = Any
Batch = tuple[Any, Any]


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A model in explicit and marked form, with synthetic data.

    Attributes:
      name: ``"mlp"``, ``"transformer"`` or ``"llama"``.
      num_stages: how many stages both forms have.
      stages: the explicit stage functions.
      loss: ``loss(y, targets) -> scalar``, a mean over the examples.
      init_stages: ``key -> list of per-stage params`` for ``stages``.
      model_fn: the marked function.
      init_function: ``key -> params`` for ``model_fn``.
      batch: ``(key, batch_size) -> (inputs, targets)``, synthetic.
      param_specs: ``params -> PartitionSpec pytree`` for either form's parameters (the
        ``param_specs`` of a tensor-parallel :class:`~pipedsl.executor.Pipeline`).
      parameters: how many values the explicit form's parameters (``init_stages``) hold,
        counted from the sizes, so that a model too big for the machine is refused without
        building it.
      fused_attention: whether its attention is :func:`jax.nn.dot_product_attention`.
    """

    name: str
    num_stages: int
    stages: tuple[Callable[[Params, Any], Any], ...]
    loss: Callable[[Any, Any], jax.Array]
    init_stages: Callable[[jax.Array], list[Params]]
    model_fn: Callable[[Params, Any], Any]
    init_function: Callable[[jax.Array], Params]
    batch: Callable[[jax.Array, int], Batch]
    param_specs: Callable[[Params], Any]
    parameters: int
    fused_attention: bool = False


def reference_stages(model: BuiltinModel) -> Callable[[list[Params], Any], Any]:
    """The explicit stages composed into one function ``(params, x) -> y``."""

    def run(params: list[Params], x: Any) -> Any:
        for f, p in zip(model.stages, params, strict=True):
            x = f(p, x)
        return x

    return run


def _dense(key: jax.Array, fan_in: int, fan_out: int) -> dict[str, jax.Array]:
    return {
        "w": jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in),
        "b": jnp.zeros((fan_out,), jnp.float32),
    }


def _mse(y: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean((y - targets) ** 2)


# -- MLP ---------------------------------------------------------------------------


def _mlp_stage(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x


def mlp(*, num_stages: int, width: int = 32, layers_per_stage: int = 2) -> BuiltinModel:
    """A GELU MLP of ``num_stages * layers_per_stage`` square layers of ``width``."""

    def init_stages(key: jax.Array) -> list[Params]:
        keys = jax.random.split(key, num_stages * layers_per_stage).reshape(num_stages, layers_per_stage, -1)
        return [[_dense(k, width, width) for k in stage_keys] for stage_keys in keys]

    def init_function(key: jax.Array) -> Params:
        k_skip, k_layers = jax.random.split(key)
        return {"skip": _dense(k_skip, width, width), "stages": init_stages(k_layers)}

    def model_fn(params: Params, x: jax.Array) -> jax.Array:
        # The skip projection is computed on the first stage and used on the last, so
        # it travels through every stage in between.
        skip = x @ params["skip"]["w"] + params["skip"]["b"]
        h = x
        for s, stage_params in enumerate(params["stages"]):
            if s:
                h = stage_boundary(h)
            h = _mlp_stage(stage_params, h)
        return h + skip

    def batch(key: jax.Array, size: int) -> Batch:
        kx, kt = jax.random.split(key)
        return (
            jax.random.normal(kx, (size, width), jnp.float32),
            jax.random.normal(kt, (size, width), jnp.float32),
        )

    return BuiltinModel(
        name="mlp",
        num_stages=num_stages,
        stages=(_mlp_stage,) * num_stages,
        loss=_mse,
        init_stages=init_stages,
        model_fn=model_fn,
        init_function=init_function,
        batch=batch,
        param_specs=_replicated,
        parameters=num_stages * layers_per_stage * mlp_layer(width),
    )


def _replicated(params: Params) -> None:
    return None


# -- transformer ---------------------------------------------------------------------


def _layer_norm(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    # In fp32 whatever the compute dtype, as mixed-precision training keeps its norms.
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean((x32 - mean) ** 2, axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]).astype(x.dtype)


def _init_ln(dim: int) -> dict[str, jax.Array]:
    return {"scale": jnp.ones((dim,), jnp.float32), "bias": jnp.zeros((dim,), jnp.float32)}


def _init_block(key: jax.Array, dim: int) -> Params:
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {
        "ln1": _init_ln(dim),
        "qkv": _dense(k1, dim, 3 * dim),
        "out": _dense(k2, dim, dim),
        "ln2": _init_ln(dim),
        "up": _dense(k3, dim, 4 * dim),
        "down": _dense(k4, 4 * dim, dim),
    }


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` over the last axis of ``x`` ([..., fan_in] @ [fan_in, fan_out]), as one
    product of a matrix of every position's row.

    Why the reshape: XLA on CPU runs a product of one contracting axis (and the two
    transposed products of its backward) on its fast path, while the weight gradient of
    a ``[b, s, d] @ [d, f]`` product contracts two axes and runs several times slower,
    the more so the more activations a program holds: on one CPU device, the gradient of
    four blocks of 32 sequences took 1.4-1.7 times the seconds per block of one block's
    that way, and 1.1 times this way (and 0.6 of the time in all).
    """
    y = x.reshape(-1, x.shape[-1]) @ w
    return y.reshape(*x.shape[:-1], w.shape[-1])


def _linear(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return _matmul(x, p["w"]) + p["b"]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, fused: bool) -> jax.Array:
    """Causal attention of ``q: [b, s, heads, d]`` over ``k, v: [b, s, kv_heads, d]``
    (``heads`` a multiple of ``kv_heads``: grouped-query attention), ``[b, s, heads, d]``.

    ``fused``: :func:`jax.nn.dot_product_attention` (cuDNN's fused kernel on a GPU in
    bf16, XLA's elsewhere), which keeps no ``s x s`` scores for the backward where cuDNN
    runs it. Otherwise the scores and their softmax (in fp32) are computed as they are
    written. Either way this is the core that ``recompute="selective"`` recomputes
    (:func:`~pipedsl.executor.stages.stage_options.selective`).
    """
    return selective(_fused_attention if fused else _plain_attention)(q, k, v)


def _fused_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _plain_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    b, s, heads, d = q.shape
    groups = heads // k.shape[2]
    k, v = (jnp.repeat(t, groups, axis=2) if groups > 1 else t for t in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _block(p: Params, h: jax.Array, *, heads: int, fused: bool) -> jax.Array:
    """Pre-norm block: causal self-attention then an MLP, each with a residual; h: [b, s, d]."""
    b, s, d = h.shape
    h = sequence_sharded(h)
    x = _layer_norm(p["ln1"], h)
    qkv = saved(_linear(p["qkv"], x), "qkv_proj")
    q, k, v = (t[:, :, 0] for t in jnp.split(qkv.reshape(b, s, 3, heads, d // heads), 3, axis=2))
    att = attention(q, k, v, fused=fused)
    h = sequence_sharded(h + saved(_linear(p["out"], att.reshape(b, s, d)), "out_proj"))
    x = saved(_layer_norm(p["ln2"], h), "mlp_input")
    return sequence_sharded(h + _linear(p["down"], jax.nn.gelu(saved(_linear(p["up"], x), "ffn_in"))))


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    # In fp32 whatever the compute dtype, as Megatron-LM computes its loss.
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# One model's pieces (stage functions, both inits, the marked form, its
# batches) are closures over the same sizes, read together as the model's definition.
def transformer(
    *,
    num_stages: int,
    vocab: int = 32,
    dim: int = 16,
    heads: int = 2,
    seq: int = 8,
    layers_per_stage: int = 1,
    fused_attention: bool = False,
) -> BuiltinModel:
    """A decoder-only transformer of ``num_stages * layers_per_stage`` blocks.

    Explicit form: stage 0 embeds (token and learned position embeddings), the last
    stage ends with a layer norm and an untied output head. Marked form: sinusoidal
    positions and an output head tied to the embedding. ``fused_attention``: see
    :func:`attention`.
    """
    block = partial(_block, heads=heads, fused=fused_attention)

    def embedded(params: Params, tokens: jax.Array) -> jax.Array:
        return params["embed"][tokens] + params["pos"][: tokens.shape[1]]

    def middle(params: Params, h: jax.Array) -> jax.Array:
        for p in params["blocks"]:
            h = block_checkpoint(block)(p, h)
        return h

    def head(params: Params, h: jax.Array) -> jax.Array:
        return _linear(params["head"], _layer_norm(params["ln_f"], h))

    def first(params: Params, tokens: jax.Array) -> jax.Array:
        return middle(params, embedded(params, tokens))

    def last(params: Params, h: jax.Array) -> jax.Array:
        return head(params, middle(params, h))

    def single(params: Params, tokens: jax.Array) -> jax.Array:
        return head(params, middle(params, embedded(params, tokens)))

    def init_stages(key: jax.Array) -> list[Params]:
        keys = jax.random.split(key, num_stages + 3)
        stages: list[Params] = [
            {"blocks": [_init_block(k, dim) for k in jax.random.split(keys[s], layers_per_stage)]}
            for s in range(num_stages)
        ]
        stages[0]["embed"] = jax.random.normal(keys[-3], (vocab, dim), jnp.float32) * 0.1
        stages[0]["pos"] = jax.random.normal(keys[-2], (seq, dim), jnp.float32) * 0.1
        stages[-1]["ln_f"] = _init_ln(dim)
        stages[-1]["head"] = _dense(keys[-1], dim, vocab)
        return stages

    def init_function(key: jax.Array) -> Params:
        k_embed, k_blocks = jax.random.split(key)
        keys = jax.random.split(k_blocks, num_stages * layers_per_stage)
        return {
            "embed": jax.random.normal(k_embed, (vocab, dim), jnp.float32) * 0.1,
            "blocks": [_init_block(k, dim) for k in keys],
            "ln_f": _init_ln(dim),
        }

    def model_fn(params: Params, tokens: jax.Array) -> jax.Array:
        s = tokens.shape[1]
        # Data-free: each stage that needs the table computes it itself.
        position = jnp.arange(s, dtype=jnp.float32)[:, None]
        freq = jnp.exp(-math.log(10000.0) * jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
        table = jnp.concatenate([jnp.sin(position * freq), jnp.cos(position * freq)], axis=-1)
        h = params["embed"][tokens] + table
        for i, p in enumerate(params["blocks"]):
            if i and i % layers_per_stage == 0:
                h = stage_boundary(h)
            h = block_checkpoint(block)(p, h)
        return _matmul(_layer_norm(params["ln_f"], h), params["embed"].T)

    return BuiltinModel(
        name="transformer",
        num_stages=num_stages,
        stages=_stage_functions(num_stages, single, first, middle, last),
        loss=_cross_entropy,
        init_stages=init_stages,
        model_fn=model_fn,
        init_function=init_function,
        batch=partial(_token_batch, seq_len=seq, vocab=vocab),
        # The ends: the token and position tables, the final norm and the head.
        parameters=num_stages * layers_per_stage * transformer_block(dim) + (2 * vocab + seq + 2) * dim + vocab,
        param_specs=transformer_specs,
        fused_attention=fused_attention,
    )


# Megatron's layout by the name of the dict that holds a weight: column-split matrices
# (and their biases), row-split matrices, vocabulary-split tables.
_COLUMN = ("qkv", "up", "head")
_ROW = ("out", "down")


def transformer_specs(params: Params) -> Params:
    """The tensor-parallel ``PartitionSpec`` of every leaf of the transformer's
    parameters, in either form (``init_stages`` or ``init_function``), for
    ``Pipeline(..., options=RunOptions(tp=T), param_specs=transformer_specs(params))``.

    ``T`` must divide the vocabulary and ``3 * dim``, ``4 * dim`` and ``dim``.
    """

    def spec(path: tuple[Any, ...], leaf: Any) -> PartitionSpec | None:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        name, owner = names[-1] if names else None, names[-2] if len(names) > 1 else None
        if name == "embed":
            return PartitionSpec(TENSOR, None)
        if owner in _COLUMN:
            return PartitionSpec(None, TENSOR) if name == "w" else PartitionSpec(TENSOR)
        if owner in _ROW and name == "w":
            return PartitionSpec(TENSOR, None)
        return None

    return jax.tree_util.tree_map_with_path(spec, params)


# -- Llama ---------------------------------------------------------------------------


def _rms_norm(scale: jax.Array, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + 1e-5) * scale).astype(x.dtype)


def _rotary(x: jax.Array, *, base: float = 500000.0) -> jax.Array:
    """Rotary positions (Su et al.) of ``x: [b, s, heads, d]``, position ``i`` rotating
    the pairs ``(x[..., j], x[..., j + d/2])`` by ``i * base**(-2j/d)``; computed from no
    data, in fp32."""
    s, d = x.shape[1], x.shape[-1]
    freq = base ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angle = jnp.arange(s, dtype=jnp.float32)[:, None] * freq  # [s, d/2]
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _init_llama_block(key: jax.Array, hidden: int, ffn: int, heads: int, kv_heads: int) -> Params:
    head_dim = hidden // heads
    k = jax.random.split(key, 7)

    def w(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
        return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)

    return {
        "attn_norm": jnp.ones((hidden,), jnp.float32),
        "wq": w(k[0], hidden, heads * head_dim),
        "wk": w(k[1], hidden, kv_heads * head_dim),
        "wv": w(k[2], hidden, kv_heads * head_dim),
        "wo": w(k[3], heads * head_dim, hidden),
        "mlp_norm": jnp.ones((hidden,), jnp.float32),
        "w_gate": w(k[4], hidden, ffn),
        "w_up": w(k[5], hidden, ffn),
        "w_down": w(k[6], ffn, hidden),
    }


def _llama_block(p: Params, h: jax.Array, *, heads: int, kv_heads: int, fused: bool) -> jax.Array:
    """Llama's block on ``h: [b, s, hidden]``: RMSNorm, grouped-query attention with rotary
    positions, RMSNorm, SwiGLU; no biases."""
    b, s, hidden = h.shape
    head_dim = hidden // heads
    h = sequence_sharded(h)
    x = _rms_norm(p["attn_norm"], h)
    q = _rotary(saved(_matmul(x, p["wq"]), "qkv_proj").reshape(b, s, heads, head_dim))
    k = _rotary(saved(_matmul(x, p["wk"]), "qkv_proj").reshape(b, s, kv_heads, head_dim))
    v = saved(_matmul(x, p["wv"]), "qkv_proj").reshape(b, s, kv_heads, head_dim)
    att = attention(q, k, v, fused=fused).reshape(b, s, heads * head_dim)
    h = sequence_sharded(h + saved(_matmul(att, p["wo"]), "out_proj"))
    x = saved(_rms_norm(p["mlp_norm"], h), "mlp_input")
    gate, up = saved(_matmul(x, p["w_gate"]), "ffn_in"), saved(_matmul(x, p["w_up"]), "ffn_in")
    return sequence_sharded(h + _matmul(jax.nn.silu(gate) * up, p["w_down"]))


# As transformer()'s, one model's pieces are closures over the same sizes.
def llama(
    *,
    num_stages: int,
    hidden: int = 32,
    ffn_hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seq_len: int = 8,
    vocab: int = 64,
    layers_per_stage: int = 1,
    fused_attention: bool = False,
) -> BuiltinModel:
    """A Llama-family decoder of ``num_stages * layers_per_stage`` blocks (RMSNorm,
    SwiGLU, rotary positions, grouped-query attention with ``kv_heads`` key/value heads,
    no biases, untied embeddings), its sizes named as the simulator's model presets name
    them (``hidden``, ``ffn_hidden``, ``heads``, ``kv_heads``, ``seq_len``, ``vocab``).

    Explicit form: stage 0 embeds, the last stage ends with an RMSNorm and the output
    head. The marked form is the same model as one function. ``fused_attention``: see
    :func:`attention`. ``heads`` must be a multiple of ``kv_heads``, ``hidden`` of
    ``heads`` and the head width even.
    """
    if heads % kv_heads or hidden % heads or (hidden // heads) % 2:
        raise ValueError(
            f"llama: heads ({heads}) must be a multiple of kv_heads ({kv_heads}) and hidden ({hidden}) of heads, "
            "with an even head width"
        )
    block = partial(_llama_block, heads=heads, kv_heads=kv_heads, fused=fused_attention)
    layers = num_stages * layers_per_stage

    def middle(params: Params, h: jax.Array) -> jax.Array:
        for p in params["blocks"]:
            h = block_checkpoint(block)(p, h)
        return h

    def head(params: Params, h: jax.Array) -> jax.Array:
        return _matmul(_rms_norm(params["final_norm"], h), params["head"])

    def first(params: Params, tokens: jax.Array) -> jax.Array:
        return middle(params, params["embed"][tokens])

    def last(params: Params, h: jax.Array) -> jax.Array:
        return head(params, middle(params, h))

    def single(params: Params, tokens: jax.Array) -> jax.Array:
        return head(params, middle(params, params["embed"][tokens]))

    def ends(key: jax.Array) -> dict[str, jax.Array]:
        k_embed, k_head = jax.random.split(key)
        return {
            "embed": jax.random.normal(k_embed, (vocab, hidden), jnp.float32) * 0.1,
            "final_norm": jnp.ones((hidden,), jnp.float32),
            "head": jax.random.normal(k_head, (hidden, vocab), jnp.float32) / math.sqrt(hidden),
        }

    def init_stages(key: jax.Array) -> list[Params]:
        k_ends, k_blocks = jax.random.split(key)
        keys = jax.random.split(k_blocks, layers).reshape(num_stages, layers_per_stage, -1)
        stages: list[Params] = [
            {"blocks": [_init_llama_block(k, hidden, ffn_hidden, heads, kv_heads) for k in stage_keys]}
            for stage_keys in keys
        ]
        tables = ends(k_ends)
        stages[0]["embed"] = tables["embed"]
        stages[-1]["final_norm"] = tables["final_norm"]
        stages[-1]["head"] = tables["head"]
        return stages

    def init_function(key: jax.Array) -> Params:
        k_ends, k_blocks = jax.random.split(key)
        keys = jax.random.split(k_blocks, layers)
        return {**ends(k_ends), "blocks": [_init_llama_block(k, hidden, ffn_hidden, heads, kv_heads) for k in keys]}

    def model_fn(params: Params, tokens: jax.Array) -> jax.Array:
        h = params["embed"][tokens]
        for i, p in enumerate(params["blocks"]):
            if i and i % layers_per_stage == 0:
                h = stage_boundary(h)
            h = block_checkpoint(block)(p, h)
        return head(params, h)

    return BuiltinModel(
        name="llama",
        num_stages=num_stages,
        stages=_stage_functions(num_stages, single, first, middle, last),
        loss=_cross_entropy,
        init_stages=init_stages,
        model_fn=model_fn,
        init_function=init_function,
        batch=partial(_token_batch, seq_len=seq_len, vocab=vocab),
        # The ends: the embedding, the final norm and the head.
        parameters=layers * llama_block(hidden=hidden, ffn_hidden=ffn_hidden, heads=heads, kv_heads=kv_heads)
        + (2 * vocab + 1) * hidden,
        param_specs=llama_specs,
        fused_attention=fused_attention,
    )


# Megatron's layout by leaf name: column-split (the outputs of the projections into heads
# and hidden units, and the head's vocabulary), row-split (back into the model width).
_LLAMA_COLUMN = ("wq", "wk", "wv", "w_gate", "w_up", "head")
_LLAMA_ROW = ("wo", "w_down", "embed")


def llama_specs(params: Params) -> Params:
    """The tensor-parallel ``PartitionSpec`` of every leaf of :func:`llama`'s parameters
    (either form). ``T`` must divide ``heads``, ``kv_heads``, ``ffn_hidden`` and ``vocab``."""

    def spec(path: tuple[Any, ...], leaf: Any) -> PartitionSpec | None:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        name = names[-1] if names else None
        if name in _LLAMA_COLUMN:
            return PartitionSpec(None, TENSOR)
        if name in _LLAMA_ROW:
            return PartitionSpec(TENSOR, None)
        return None

    return jax.tree_util.tree_map_with_path(spec, params)


MODELS: dict[str, Callable[..., BuiltinModel]] = {"mlp": mlp, "transformer": transformer, "llama": llama}
"""The built-in models by name, as ``pipedsl run --model`` knows them."""


def _token_batch(key: jax.Array, size: int, *, seq_len: int, vocab: int) -> Batch:
    """``size`` random sequences of ``seq_len`` tokens and, as targets, each shifted by one."""
    tokens = jax.random.randint(key, (size, seq_len + 1), 0, vocab, jnp.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _stage_functions(
    num_stages: int,
    single: Callable[[Params, Any], Any],
    first: Callable[[Params, Any], Any],
    middle: Callable[[Params, Any], Any],
    last: Callable[[Params, Any], Any],
) -> tuple[Callable[[Params, Any], Any], ...]:
    """A token model's stage functions: ``single`` alone, or the first, the middle ones and the last."""
    if num_stages == 1:
        return (single,)
    return (first,) + (middle,) * (num_stages - 2) + (last,)
