"""A plan's model split into pipeline stages: each stage's layers, the parameters each of
its GPUs holds, the activation bytes it keeps per microbatch and its work per microbatch
(forward, input-gradient and weight-gradient seconds), as
:mod:`~pipedsl.simulator.estimate` assembles them. The layers split evenly over
``pp × vpp`` stages unless given; the first stage adds the embedding, the last the final
norm, logits and loss.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedsl.simulator.data_parallel import zero_per_microbatch
from pipedsl.simulator.frameworks import framework
from pipedsl.simulator.hardware import Model
from pipedsl.simulator.plan import Plan, PlanError
from pipedsl.simulator.transformer import Shapes, Work

__all__ = ["split_layers", "ends_split", "stage_params", "stage_residual", "stage_weight_residual", "stage_work"]


def split_layers(model: Model, stages: int, given: Sequence[int] | None) -> tuple[int, ...]:
    """Each of ``stages`` stages' layers: ``given`` when set (checked), else an even split,
    shape (S,). Raises PlanError when they do not add up or do not split evenly."""
    if given is not None:
        layers = tuple(given)
        if len(layers) != stages or sum(layers) != model.layers or min(layers) < 0:
            raise PlanError(
                f"stage_layers {list(layers)} must give {stages} stages (pp × vpp) whose layers sum to "
                f"{model.name}'s {model.layers}"
            )
        return layers
    if model.layers % stages:
        raise PlanError(
            f"{model.name}'s {model.layers} layers do not split evenly over {stages} stages (pp × vpp); "
            f"choose pp × vpp dividing {model.layers}"
        )
    return tuple(model.layers // stages for _ in range(stages))


def ends_split(layers: int, stages: int) -> tuple[int, ...] | None:
    """``layers`` over ``stages`` stages whose first holds only the embedding and whose
    last only the final norm, logits and loss, the others an equal share, shape (S,); None
    where the stages between do not split the layers evenly (or there are fewer than 3).
    Llama 3 405B's 126 layers on 16 × 8 stages: ``(0, 1, 1, ..., 1, 0)``."""
    inner = stages - 2
    if inner < 1 or layers % inner:
        return None
    return (0, *(layers // inner for _ in range(inner)), 0)


def stage_params(model: Model, plan: Plan, layers: tuple[int, ...]) -> tuple[float, ...]:
    """Parameters each GPU of each stage holds (tensor-parallel shards), shape (S,).

    With a tied embedding and more than one stage, the last stage keeps its own copy of
    the embedding matrix for the logits, as Megatron-LM does.
    """
    t = plan.tp
    per_layer = model.layer_params  # a derived property: worked out once, not once per stage
    params = [n * per_layer / t for n in layers]
    params[0] += model.embedding_params / t
    head = model.head_params / t
    if model.tied_embeddings and len(layers) > 1:
        head += model.vocab * model.hidden / t
    params[-1] += head
    return tuple(params)


def stage_work(shapes: Shapes, layers: tuple[int, ...], params: tuple[float, ...]) -> tuple[Work, ...]:
    """Each stage's work per microbatch: its layers, the embedding on the first stage and
    the head on the last; the ZeRO traffic of its parameters and the plan's framework's
    fixed costs (:mod:`~pipedsl.simulator.frameworks`), shape (S,). The executor's dispatch
    is priced per task by the simulation (:attr:`Shapes.action_overhead_s`)."""
    layer = shapes.layer_work()
    last = len(layers) - 1
    # Stages between the ends with like layers and parameters do like work: each is
    # worked out once (a plan of 96 stages has two or three distinct ones).
    inner: dict[tuple[int, float], Work] = {}
    work = []
    for s, (n, p) in enumerate(zip(layers, params, strict=True)):
        found = inner.get((n, p)) if 0 < s < last else None
        if found is None:
            w = layer * n
            if s == 0:
                w = w + shapes.embedding_work()
            if s == last:
                w = w + shapes.head_work()
            found = w + zero_per_microbatch(shapes, p, w, n) + _framework_work(shapes, n)
            if 0 < s < last:
                inner[(n, p)] = found
        work.append(found)
    return tuple(work)


def _framework_work(shapes: Shapes, layers: int) -> Work:
    """The plan's framework's fixed costs per microbatch on a stage of ``layers`` layers:
    its per-microbatch and per-layer seconds and one action's in the forward, one action's
    in the backward (in ``I`` when split)."""
    profile = framework(shapes.plan.framework)
    return Work(profile.microbatch_s + layers * profile.layer_s + profile.action_s, profile.action_s, 0.0)


def stage_residual(shapes: Shapes, layers: tuple[int, ...]) -> tuple[int, ...]:
    """Bytes each stage keeps per microbatch from its forward to its backward, shape (S,)."""
    per_layer = shapes.layer_activation_bytes(shapes.plan.recompute)
    residual = [round(n * per_layer) for n in layers]
    residual[0] += round(shapes.embedding_activation_bytes())
    residual[-1] += round(shapes.head_activation_bytes())
    return tuple(residual)


def stage_weight_residual(shapes: Shapes, layers: tuple[int, ...], residual: tuple[int, ...]) -> tuple[int, ...]:
    """Bytes each stage keeps per microbatch from its ``I`` to its ``W`` where a schedule
    splits the backward, shape (S,): its layers' (:meth:`Shapes.layer_weight_residual_bytes`),
    the head's on the last stage and the embedding's on the first. Under this project's
    executor the first stage has no input gradient to compute, so its ``I`` runs nothing
    and hands ``W`` all that ``F`` kept (``residual[0]``) and the output's cotangent."""
    per_layer = shapes.layer_weight_residual_bytes()
    held = [round(n * per_layer) for n in layers]
    held[-1] += round(shapes.head_weight_residual_bytes())
    if framework(shapes.plan.framework).name == "pipedsl":
        model, plan = shapes.model, shapes.plan
        cotangent = shapes.tokens * model.dtype_bytes * model.hidden / plan.tp if len(layers) > 1 else 0
        held[0] = residual[0] + round(cotangent)
    else:
        held[0] += round(shapes.embedding_weight_residual_bytes())
    return tuple(held)
