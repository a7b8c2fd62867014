"""How many parameters a block of each built-in model holds, counted from its sizes.

Plain arithmetic, with no JAX in it: ``pipedsl run`` refuses a model too big for the
machine from these counts before JAX starts, whatever the sizes (a million layers are
counted as fast as two), and :mod:`pipedsl.executor.models` counts its models with them.
"""

from __future__ import annotations

__all__ = ["mlp_layer", "transformer_block", "llama_block", "block_parameters"]


def mlp_layer(width: int) -> int:
    """A square dense layer of ``width`` and its bias."""
    return width * width + width


def transformer_block(dim: int) -> int:
    """Two layer norms (scale and bias), the qkv, output, up (4 dim) and down projections
    with their biases."""
    return 12 * dim * dim + 13 * dim


def llama_block(*, hidden: int, ffn_hidden: int, heads: int, kv_heads: int) -> int:
    """Two RMSNorm scales, the query, key, value (``kv_heads`` of ``hidden / heads``) and
    output projections, and the three SwiGLU matrices."""
    head_dim = hidden // heads
    return 2 * hidden + 2 * hidden * (heads + kv_heads) * head_dim + 3 * hidden * ffn_hidden


def block_parameters(model: str, sizes: dict[str, int]) -> int:
    """Parameters of one block (one layer) of built-in ``model`` (``mlp``, ``transformer``,
    ``llama``) built with ``sizes``, the keyword arguments of its factory that shape a block
    (``width``; ``dim``; ``hidden``, ``ffn_hidden``, ``heads``, ``kv_heads``)."""
    if model == "mlp":
        return mlp_layer(sizes["width"])
    if model == "transformer":
        return transformer_block(sizes["dim"])
    return llama_block(
        hidden=sizes["hidden"], ffn_hidden=sizes["ffn_hidden"], heads=sizes["heads"], kv_heads=sizes["kv_heads"]
    )
