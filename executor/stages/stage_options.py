"""How a stage is executed: recomputation, precision and sequence parallelism, and what a
model sees of them while its stages are traced.

A :class:`StageOptions` is one stage's share of the pipeline's
:class:`~pipedsl.run_options.RunOptions` (which checks them), fixed when a
:class:`~pipedsl.executor.Pipeline` is built and applied when the stage is traced
(:func:`pipedsl.executor.stages.stage_program.compile_stage`):

- ``recompute``: which of the forward's intermediates the backward recomputes instead of
  keeping, with the planner's meaning (Korthikanti et al. 2022). ``"none"`` keeps them all;
  ``"full"`` keeps only the stage's inputs (one :func:`jax.checkpoint` around the stage);
  ``"selective"`` recomputes the attention core only (the scores, softmax and weighted sum,
  whose ``a·s²`` values dominate a layer's activations): the function a model passes
  through :func:`selective` runs under :func:`jax.checkpoint`, so its backward recomputes it
  from the queries, keys and values it keeps (Megatron-LM's ``checkpoint_core_attention``).
  The named remat policies (``"save_dots"``, ``"save_qkv_proj"``, ``"save_mlp_inputs"``)
  checkpoint each block a model passes through :func:`block_checkpoint`, saving the values
  the block tags with :func:`saved` under the policy's names (:data:`POLICY_NAMES`; JAX's
  ``save_only_these_names``): the backward reruns the block from its input and those.
- ``precision``: ``"fp32"``, or ``"bf16"`` as Megatron-LM and torchtitan train: the
  parameters are fp32 master weights (and the optimizer state fp32); each step the worker
  casts them once to a bf16 copy that every ``F`` and ``B`` of the step reads (kept by
  reference, never per microbatch), the stages compute in bf16, activations and their
  gradients travel between stages in bf16 (a stage's floating-point inputs and outputs are
  cast to bf16), and every microbatch's weight gradient is accumulated, and reduced over
  ``"data"``, in fp32. A model may compute parts in fp32 (the built-in models' norms,
  softmax and loss).
- ``sequence_parallel``: under tensor parallelism, the values a model passes through
  :func:`sequence_sharded` (the residual stream around norms and dropout) are split along
  the sequence over ``"tensor"`` (Korthikanti et al.), so XLA turns the tensor-parallel
  all-reduces into a reduce-scatter and an all-gather and each device keeps ``1/tp`` of them.

A model cooperates through four helpers: :func:`selective` around its attention core,
:func:`block_checkpoint` around each block and :func:`saved` on the values a remat policy may
keep, and :func:`sequence_sharded` on its sequence-major activations. Outside a pipeline (a
one-device reference) they leave the computation as it is, so the same model function is the
reference.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pipedsl.executor.stages.mesh import TENSOR, data_axes, data_size
from pipedsl.run_options import Precision, RecomputeMode, RunOptions

__all__ = [
    "POLICY_NAMES",
    "StageOptions",
    "block_checkpoint",
    "saved",
    "selective",
    "sequence_sharded",
    "tracing",
]

POLICY_NAMES: dict[str, tuple[str, ...]] = {
    "save_dots": ("qkv_proj", "out_proj", "ffn_in"),
    "save_qkv_proj": ("qkv_proj", "out_proj"),
    "save_mlp_inputs": ("mlp_input",),
}
"""The names of the values each named remat policy saves (the rest of a block is rerun):
the outputs of the products with weights (Q, K and V or the fused QKV, the attention's output
projection, the feed-forward's input products), of the QKV and output projections, or the
feed-forward block's input. The planner counts the same values
(:func:`pipedsl.simulator.activations.compiled_layer_bytes`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageOptions:
    """How one stage runs (module docstring): made by :meth:`per_stage` from checked options."""

    recompute: RecomputeMode = "none"
    precision: Precision = "fp32"
    sequence_parallel: bool = False
    pack_residuals: bool | None = None

    @classmethod
    def per_stage(cls, options: RunOptions, num_stages: int) -> tuple[StageOptions, ...]:
        """Each of ``num_stages`` stages' options under ``options``; refuses a recompute mode
        per stage for another number of stages (:class:`~pipedsl.run_options.RunOptionsError`)."""
        return tuple(
            cls(
                recompute=mode,
                precision=options.precision,
                sequence_parallel=options.sequence_parallel,
                pack_residuals=options.pack_residuals,
            )
            for mode in options.stage_recompute(num_stages)
        )

    def checkpoint(self, fn: Any) -> Any:
        """``fn`` (the whole stage) under :func:`jax.checkpoint` for ``"full"``; ``fn``
        itself otherwise (``"selective"`` checkpoints what the model passes through
        :func:`selective`)."""
        return jax.checkpoint(fn) if self.recompute == "full" else fn

    def in_compute_dtype(self, values: Any) -> tuple[Any, ...]:
        """``values`` (arrays or ``jax.ShapeDtypeStruct``) in the stage's compute dtype
        where they are floating point: its parameters as its programs take them, and the
        activations and gradients that pass between stages (bf16 moves half the bytes);
        other values as they are."""
        if self.precision == "fp32":
            return tuple(values)
        return tuple(_in_bf16(v) if _is_float(v) else v for v in values)


def _is_float(x: Any) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.floating))


def _in_bf16(v: Any) -> Any:
    if isinstance(v, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(v.shape, jnp.bfloat16, sharding=v.sharding)
    return v.astype(jnp.bfloat16)


@dataclass(frozen=True, slots=True)
class _Tracing:
    mesh: Mesh
    options: StageOptions


_CURRENT: contextvars.ContextVar[_Tracing | None] = contextvars.ContextVar("pipedsl_stage_tracing", default=None)


@contextmanager
def tracing(mesh: Mesh, options: StageOptions) -> Iterator[None]:
    """While a stage on ``mesh`` is traced with ``options``: what :func:`sequence_sharded` reads."""
    token = _CURRENT.set(_Tracing(mesh, options))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def sequence_sharded(x: jax.Array, *, axis: int = 1) -> jax.Array:
    """``x`` (a ``[batch, seq, ...]`` activation; ``axis`` is its sequence axis) split
    along the sequence over the mesh axis ``"tensor"`` when traced in a pipeline stage with
    ``sequence_parallel`` and ``tp > 1``; ``x`` itself otherwise (no pipeline, no tensor
    parallelism, or a sequence that does not divide by ``tp``)."""
    current = _CURRENT.get()
    if current is None or not current.options.sequence_parallel:
        return x
    mesh = current.mesh
    tp = mesh.shape.get(TENSOR, 1)
    if tp == 1 or x.ndim <= axis or x.shape[axis] % tp:
        return x
    spec = PartitionSpec(*([None] * axis), TENSOR)
    # With dp > 1 the stage runs under shard_map over its data axes (pipedsl.executor.stages.shards):
    # the constraint then names the mesh as that program sees it, those axes manual.
    where = (
        mesh.abstract_mesh.update_axis_types(dict.fromkeys(data_axes(mesh), AxisType.Manual))
        if data_size(mesh) > 1
        else mesh
    )
    return jax.lax.with_sharding_constraint(x, NamedSharding(where, spec))


def selective(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a model's attention core) under :func:`jax.checkpoint` when traced in a
    pipeline stage with ``recompute="selective"``, so its backward recomputes it; ``fn``
    itself otherwise."""
    current = _CURRENT.get()
    if current is None or current.options.recompute != "selective":
        return fn
    return jax.checkpoint(fn)


def saved(x: jax.Array, name: str) -> jax.Array:
    """``x`` named ``name`` (one of :data:`POLICY_NAMES`' values) for the remat policies:
    the value itself, which a block under :func:`block_checkpoint` saves where its policy
    names it."""
    return checkpoint_name(x, name)


def block_checkpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (one block of a model) under :func:`jax.checkpoint` with the stage's named
    remat policy when traced in a pipeline stage with one (:data:`POLICY_NAMES`): its
    backward reruns it from its inputs and the values the policy saves; ``fn`` itself
    otherwise."""
    current = _CURRENT.get()
    if current is None or current.options.recompute not in POLICY_NAMES:
        return fn
    policy = jax.checkpoint_policies.save_only_these_names(*POLICY_NAMES[current.options.recompute])
    return jax.checkpoint(fn, policy=policy)
