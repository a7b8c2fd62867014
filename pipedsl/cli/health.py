"""Training that stops at the first non-finite loss, saying where it came from.

A NaN or infinite loss poisons every later step (the optimizer spreads it into every
parameter), so ``pipedsl run`` stops at the first one unless ``--allow-nonfinite`` is
given. :func:`nonfinite_origin` then looks, in the order a step computes, for the first
place a non-finite value appears, using the parameters that entered the step:

1. the batch (inputs, then targets);
2. the parameters (the previous step's update made them non-finite: a learning rate too
   large, or a non-finite gradient), per stage for explicit stages;
3. explicit stages: each stage's forward output in turn, run on the driver's default
   device with the model's own stage functions; marked functions: the pipeline's
   gradients (``Pipeline.value_and_grad``), first non-finite leaf;
4. else the loss of finite outputs.

JAX is imported by the caller (``pipedsl run``) before this module is used.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pipedsl.executor.errors import ExecutionError

__all__ = ["NonFiniteLoss", "first_nonfinite", "nonfinite_origin"]


class NonFiniteLoss(ExecutionError):
    """A training step's loss was NaN or infinite; ``step`` is its 1-based number and
    ``stage`` the stage where the first non-finite value appeared (None if no stage is to
    blame, for example a non-finite batch)."""

    def __init__(self, message: str, *, step: int, stage: int | None) -> None:
        self.step = step
        super().__init__(message, stage=stage)


def first_nonfinite(tree: Any) -> str | None:
    """The key path (``"[1]['w']"``) of the first leaf of ``tree`` holding a NaN or an
    infinity, ``""`` for a bare array; None when every float leaf is finite."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        value = np.asarray(jax.device_get(leaf))
        if np.issubdtype(value.dtype, np.inexact) and not np.isfinite(value).all():
            return jax.tree_util.keystr(path)
    return None


def nonfinite_origin(
    pipe: Any, model: Any, params: Any, batch: tuple[Any, Any], *, step: int, marked: bool
) -> NonFiniteLoss:
    """The error for a non-finite loss at ``step``, naming where it first appears.

    ``pipe`` is the :class:`~pipedsl.executor.Pipeline` that ran the step, ``model`` its
    :class:`~pipedsl.executor.models.BuiltinModel`, ``params`` the parameters that entered
    the step (on the driver or local devices) and ``batch`` the step's ``(inputs, targets)``.
    """
    stage, where = _origin(pipe, model, params, batch, step=step, marked=marked)
    return NonFiniteLoss(
        f"the loss of step {step} is not finite; {where}. Training stopped (--allow-nonfinite trains on regardless)",
        step=step,
        stage=stage,
    )


def _origin(
    pipe: Any, model: Any, params: Any, batch: tuple[Any, Any], *, step: int, marked: bool
) -> tuple[int | None, str]:
    # On the driver: after a step each stage's parameters sit on that stage's device.
    params, (inputs, targets) = jax.device_get((params, batch))
    for name, tree in (("inputs", inputs), ("targets", targets)):
        path = first_nonfinite(tree)
        if path is not None:
            return None, f"the batch's {name}{path} hold non-finite values"
    made_by = (
        "the initial parameters" if step == 1 else f"the update of step {step - 1} made them so (is --lr too large?)"
    )
    if not marked:
        for s, stage_params in enumerate(params):
            path = first_nonfinite(stage_params)
            if path is not None:
                return s, f"stage {s}'s parameters{path} were already non-finite ({made_by})"
        x = inputs
        for s, (fn, stage_params) in enumerate(zip(model.stages, params, strict=True)):
            x = fn(stage_params, x)
            if first_nonfinite(x) is not None:
                after = (
                    "" if step == 1 else f"; step {step - 1}'s update may have made them too large: try a smaller --lr"
                )
                return (
                    s,
                    f"it first appears in stage {s}'s forward output (its inputs and parameters are finite{after})",
                )
        return None, "every stage's output is finite, the loss of the last one is not"
    path = first_nonfinite(params)
    if path is not None:
        return None, f"the parameters{path} were already non-finite ({made_by})"
    _, grads = pipe.value_and_grad(params, (inputs, targets))
    path = first_nonfinite(grads)
    if path is not None:
        return None, f"the first non-finite gradient is of the parameters{path}"
    return None, "the parameters and their gradients are finite, the loss is not"
