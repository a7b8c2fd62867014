"""Stages: a model cut into per-stage functions of flat leaves.

A :class:`StagedModel` is the common form of both ways to give a model:

- explicit stages, ``f_s(params_s, x) -> y`` plus ``loss(y, targets) -> scalar``
  (:func:`explicit_model`, here);
- one function with ``stage_boundary`` markers (:func:`pipedsl.executor.stages.split.marked_model`).

Either way each stage becomes a function of flat leaves ``(params, x, targets) -> outputs``
(tuples of arrays; ``targets`` is empty except on the last stage, whose single output is
the microbatch loss). :func:`pipedsl.executor.stages.stage_program.compile_stage` turns one stage into its compiled
programs.

What moves between stages: an activation is the tuple of all of a stage's outputs; a
gradient is the tuple of cotangents of the floating-point ones (integer outputs such as
token ids travel forward but have no cotangent).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import PyTreeDef

from pipedsl.executor.errors import ExecutionError, stage_failure

__all__ = ["LeafFn", "StagedModel", "explicit_model", "describe_avals", "check_float_params", "check_loss"]

Leaves = tuple[Any, ...]
LeafFn = Callable[[Leaves, Leaves, Leaves], Leaves]
"""A stage as a function of flat leaves: ``(params, x, targets) -> outputs``."""


@dataclass(frozen=True, slots=True)
class StagedModel:
    """A model cut into stages, each a function of flat leaves.

    Attributes:
      functions: per stage, its :data:`LeafFn`; the last one returns ``(loss,)``.
      param_treedef: structure of the user's parameters (a list of per-stage pytrees
        for explicit stages).
      param_avals: shape and dtype of every flat parameter leaf.
      stage_params: per stage, the indices of the flat leaves it takes, in order.
      owner: per flat leaf, the stage that owns it: where its optimizer state lives and
        where the gradients of every stage using it are summed.
      owned_treedefs: per stage, the structure its owned leaves (in index order) are
        shown to the optimizer in.
      input_avals: per stage, its input leaves (stage 0: the inputs), at what one device
        of a stage mesh's ``"data"`` axis computes on: its share of a microbatch.
      target_avals: the leaves of the targets, at the same share.
    """

    functions: tuple[LeafFn, ...]
    param_treedef: PyTreeDef
    param_avals: tuple[jax.ShapeDtypeStruct, ...]
    stage_params: tuple[tuple[int, ...], ...]
    owner: tuple[int, ...]
    owned_treedefs: tuple[PyTreeDef, ...]
    input_avals: tuple[tuple[jax.ShapeDtypeStruct, ...], ...]
    target_avals: tuple[jax.ShapeDtypeStruct, ...]

    @property
    def num_stages(self) -> int:
        return len(self.functions)

    def owned(self, stage: int) -> tuple[int, ...]:
        """The flat leaves ``stage`` owns, in index order."""
        return tuple(i for i, s in enumerate(self.owner) if s == stage)


def describe_avals(avals: Sequence[Any]) -> str:
    """``f32[4,16], i32[4]``: shapes and dtypes for messages."""
    parts = [f"{jnp.dtype(a.dtype).name}[{','.join(map(str, a.shape))}]" for a in avals]
    return ", ".join(parts) if parts else "nothing"


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def check_float_params(
    avals: Sequence[jax.ShapeDtypeStruct], stage_of: Callable[[int], int], placement: Sequence[int]
) -> None:
    """Every parameter leaf must be floating point: it has a gradient and an update."""
    for i, aval in enumerate(avals):
        if not jnp.issubdtype(aval.dtype, jnp.inexact):
            stage = stage_of(i)
            raise ExecutionError(
                f"parameter leaf {i} of stage {stage} (device {placement[stage]}) has dtype "
                f"{jnp.dtype(aval.dtype).name}; parameters must be floating point (pass integer "
                "data as inputs instead)",
                stage=stage,
                device=placement[stage],
            )


def check_loss(aval: Any, *, stage: int, device: int) -> None:
    if tuple(aval.shape) != () or not jnp.issubdtype(aval.dtype, jnp.floating):
        raise ExecutionError(
            f"the loss (on stage {stage}, device {device}) must be a floating-point scalar; "
            f"it returned {describe_avals([aval])}",
            stage=stage,
            device=device,
        )


def explicit_model(
    stages: Sequence[Callable[[Any, Any], Any]],
    loss: Callable[[Any, Any], Any],
    params: Sequence[Any],
    inputs: Any,
    targets: Any,
    *,
    placement: Sequence[int],
) -> StagedModel:
    """Cut nothing: wrap explicit stage functions as leaf functions.

    ``params`` is the list of per-stage parameter pytrees; ``inputs`` and ``targets``
    are one microbatch (arrays or shape structs). Each stage is traced abstractly on the
    previous stage's output, so a stage that raises or rejects its input shapes is
    reported here, naming the stage and its device, before anything runs.
    """
    if not isinstance(params, (list, tuple)) or len(params) != len(stages):
        got = f"{len(params)} entries" if isinstance(params, (list, tuple)) else type(params).__name__
        raise ExecutionError(f"explicit stages take a list of {len(stages)} per-stage parameter pytrees; got {got}")
    param_leaves, param_treedef = jax.tree_util.tree_flatten(list(params))
    param_avals = tuple(_struct(p) for p in param_leaves)
    # Per stage, the indices of its leaves among all stages' flattened parameters, and the
    # tree of its own parameters.
    stage_params: list[tuple[int, ...]] = []
    treedefs: list[PyTreeDef] = []
    start = 0
    for p in params:
        leaves, treedef = jax.tree_util.tree_flatten(p)
        stage_params.append(tuple(range(start, start + len(leaves))))
        treedefs.append(treedef)
        start += len(leaves)
    owner = tuple(s for s, idx in enumerate(stage_params) for _ in idx)
    check_float_params(param_avals, owner.__getitem__, placement)

    x_leaves, x_treedef = jax.tree_util.tree_flatten(inputs)
    t_leaves, t_treedef = jax.tree_util.tree_flatten(targets)
    x_avals = tuple(_struct(x) for x in x_leaves)
    t_avals = tuple(_struct(t) for t in t_leaves)
    last = len(stages) - 1
    functions: list[LeafFn] = []
    input_avals: list[tuple[jax.ShapeDtypeStruct, ...]] = []
    for s, f in enumerate(stages):
        fn, out_treedef = _explicit_fn(f, loss if s == last else None, treedefs[s], x_treedef, t_treedef)
        p_avals = tuple(param_avals[i] for i in stage_params[s])
        source = "the model's inputs" if s == 0 else f"the output of stage {s - 1}"
        what = f"tracing its forward on {source}"
        try:
            out = jax.eval_shape(fn, p_avals, x_avals, t_avals if s == last else ())
        except ExecutionError:
            raise
        except Exception as err:  # a user stage may raise anything while it is traced
            error = stage_failure(s, placement[s], f"{what} ({describe_avals(x_avals)})", err)
            raise error from err
        functions.append(fn)
        input_avals.append(x_avals)
        if s == last:
            check_loss(out[0], stage=s, device=placement[s])
        else:
            x_avals = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out)
            x_treedef = out_treedef()
    return StagedModel(
        functions=tuple(functions),
        param_treedef=param_treedef,
        param_avals=param_avals,
        stage_params=tuple(stage_params),
        owner=owner,
        owned_treedefs=tuple(treedefs),
        input_avals=tuple(input_avals),
        target_avals=t_avals,
    )


def _explicit_fn(
    f: Callable[[Any, Any], Any],
    loss: Callable[[Any, Any], Any] | None,
    p_treedef: PyTreeDef,
    x_treedef: PyTreeDef,
    t_treedef: PyTreeDef,
) -> tuple[LeafFn, Callable[[], PyTreeDef]]:
    """A leaf function for ``f`` (then ``loss`` on the last stage), and a getter for
    the structure of its output, known once it has been traced."""
    seen: list[PyTreeDef] = []

    def fn(p: Leaves, x: Leaves, t: Leaves) -> Leaves:
        y = f(jax.tree_util.tree_unflatten(p_treedef, p), jax.tree_util.tree_unflatten(x_treedef, x))
        if loss is not None:
            return (loss(y, jax.tree_util.tree_unflatten(t_treedef, t)),)
        leaves, treedef = jax.tree_util.tree_flatten(y)
        seen[:] = [treedef]
        return tuple(leaves)

    return fn, lambda: seen[0]
