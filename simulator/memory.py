"""Memory per GPU of a plan: weights, gradients and optimizer state sharded by ZeRO stage,
activations, and the working memory that is not per microbatch.

As the executor keeps them, per parameter: weights of the model's ``stored_bytes``
(``dtype_bytes`` unless ``param_bytes`` says otherwise), gradients in the precision they are
reduced in (:func:`gradient_bytes`: fp32, :data:`GRAD_BYTES`, under this project's executor)
and Adam's fp32 moments (:data:`ADAM_BYTES`); a 16-bit (bf16) model's weights are the
step's 16-bit copy, and the optimizer state also holds their fp32 master copy
(:data:`MASTER_BYTES`; :func:`optimizer_bytes`: 12 bytes, as Megatron-LM's mixed
precision), while fp32 weights (an fp32 model's, or a bf16 model's stored in fp32 and cast
where used, as MaxText keeps them) are their own master (8 bytes of optimizer state). ZeRO 1 shards the optimizer
state over the dp·cp ranks that hold the same weights (over the fsdp·cp ranks of a shard
group where the plan sets ``fsdp``), ZeRO 2 also the gradients, ZeRO 3
also the weights. Gradients reduced once per step (``reduce_once``) are accumulated
whole until then, so they are not sharded; weights ZeRO 3 keeps gathered after the
forward (no ``reshard_after_forward``) are held whole. Activations are the simulator's
peak of residual bytes held per device under the schedule (computed by the caller),
plus one layer's working set under full recomputation; ZeRO 3 adds two layers' gathered
weights, context parallelism one layer's gathered keys and values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipedsl.simulator.context_parallel import gathered_bytes
from pipedsl.simulator.frameworks import framework
from pipedsl.simulator.plan import Plan, PlanError, Recompute
from pipedsl.simulator.transformer import Shapes

__all__ = [
    "ADAM_BYTES",
    "GRAD_BYTES",
    "MASTER_BYTES",
    "gradient_bytes",
    "DoesNotFit",
    "Memory",
    "device_memory",
    "optimizer_bytes",
    "static_memory",
]

GRAD_BYTES = 4
"""Bytes per gradient value held: fp32, as accumulated over microbatches (by this project's
executor always, and by any plan that reduces its gradients in fp32: :func:`gradient_bytes`)."""
ADAM_BYTES = 8
"""Bytes of Adam's state per parameter: fp32 first and second moments."""
MASTER_BYTES = 4
"""Bytes per parameter of the fp32 master weights that mixed precision keeps beside
16-bit ones."""
_GIB = 2**30


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes per GPU on the fullest device, by what holds them."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    total: int
    usable: int

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def excess(self) -> int:
        """Bytes above what is usable (0 when the plan fits)."""
        return max(0, self.total - self.usable)

    def to_json(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
            "usable": self.usable,
        }

    def text(self) -> str:
        """``61.2 GiB per GPU (weights 4.1, ...), above the 76.0 GiB usable`` in words."""
        where = "above" if not self.fits else "within"
        return (
            f"{self.total / _GIB:.1f} GiB per GPU (weights {self.weights / _GIB:.1f}, "
            f"gradients {self.gradients / _GIB:.1f}, optimizer {self.optimizer / _GIB:.1f}, "
            f"activations {self.activations / _GIB:.1f}), {where} the {self.usable / _GIB:.1f} GiB usable"
        )


class DoesNotFit(PlanError):
    """A plan needs more memory per GPU than the cluster has; ``memory`` says where it goes."""

    def __init__(self, plan: Plan, memory: Memory) -> None:
        self.plan = plan
        self.memory = memory
        super().__init__(f"{plan.label} needs {memory.text()}")


def optimizer_bytes(stored_bytes: int) -> int:
    """Bytes of optimizer state per parameter of a model whose weights are stored in
    ``stored_bytes`` (``Model.stored_bytes``): Adam's moments, and the fp32 master weights
    when the stored weights are narrower than fp32 (fp32 parameters are their own master)."""
    return ADAM_BYTES + (MASTER_BYTES if stored_bytes < MASTER_BYTES else 0)


def gradient_bytes(plan: Plan) -> int:
    """Bytes per gradient value a plan holds: those it reduces them in (``reduce_bytes``), as
    the frameworks that reduce in 16 bits accumulate them (Apex's DistributedFusedAdam with
    ``grad_sync_dtype: bf16`` in NeMo, Megatron-LM's fp16 gradients without
    ``--accumulate-allreduce-grads-in-fp32``, the bf16 gradients of bf16 products); fp32
    (:data:`GRAD_BYTES`) under this project's executor, which accumulates them in fp32."""
    return GRAD_BYTES if framework(plan.framework).name == "pipedsl" else plan.reduce_bytes


def static_memory(plan: Plan, device_params: float, stored_bytes: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per GPU, sharded by the plan's mode, of
    weights stored in ``stored_bytes`` (``Model.stored_bytes``)."""
    shards = plan.shards
    weights = device_params * stored_bytes / (shards if _shards_weights(plan) else 1)
    grads = device_params * gradient_bytes(plan) / (shards if plan.zero >= 2 and not plan.reduce_once else 1)
    optimizer = device_params * optimizer_bytes(stored_bytes) / (shards if plan.zero >= 1 else 1)
    return weights, grads, optimizer


def transient_bytes(shapes: Shapes) -> float:
    """Working memory that is not per microbatch: one layer's full activations while
    a remat policy that reruns each layer (full recomputation or a named policy) rebuilds
    it; ZeRO 3's gathered weights of two layers (the one running and the one prefetched)
    when it reshards after the forward, in the compute dtype; the layer's gathered keys and
    values under context parallelism."""
    plan, model = shapes.plan, shapes.model
    extra = 0.0
    if plan.recompute.per_layer:
        extra += shapes.layer_activation_bytes(Recompute.NONE)
    if _shards_weights(plan):
        extra += 2 * model.layer_params * model.dtype_bytes / plan.tp
    return extra + gathered_bytes(shapes)


def _shards_weights(plan: Plan) -> bool:
    """Whether the weights stay sharded between uses: ZeRO 3 that reshards after the forward."""
    return plan.zero == 3 and plan.reshard_after_forward


def device_memory(shapes: Shapes, device_params: Sequence[float], activations: Sequence[int]) -> Memory:
    """Memory of the fullest of the devices holding ``device_params`` parameters and
    ``activations`` bytes of activations (one number per device), with the plan's
    working memory (:func:`transient_bytes`) on each."""
    plan, model = shapes.plan, shapes.model
    transient = transient_bytes(shapes)
    # Devices of like stages hold like parameters: each distinct count is worked out once.
    shares = {p: static_memory(plan, p, model.stored_bytes) for p in dict.fromkeys(device_params)}
    static = [shares[p] for p in device_params]
    totals = [sum(parts) + held + transient for parts, held in zip(static, activations, strict=True)]
    fullest = max(range(len(totals)), key=lambda d: totals[d])
    weights, grads, optimizer = static[fullest]
    return Memory(
        weights=round(weights),
        gradients=round(grads),
        optimizer=round(optimizer),
        activations=round(activations[fullest] + transient),
        total=round(totals[fullest]),
        usable=shapes.cluster.usable_bytes,
    )
