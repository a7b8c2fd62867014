"""Data parallelism: gradient and weight traffic between data-parallel ranks by ZeRO
stage, what of it the computation hides, and the optimizer step.

The ranks that hold the same weights are the dp·cp data- and context-parallel ranks of
one tensor and pipeline rank (context-parallel ranks train the same weights on other
tokens of the same sequences); their gradients are reduced, and ZeRO shards, over that
group. Gradients are reduced at ``reduce_bytes`` per value (4, fp32, by default): ZeRO 0
all-reduces them once per step, ZeRO 1 reduce-scatters them and all-gathers the updated
16-bit weights, ZeRO 2 reduce-scatters every microbatch's gradients (that is what frees
their memory) and all-gathers the weights once, ZeRO 3 also all-gathers the weights in
every forward and again in every backward. The plan's sharding choices change that:
with ``reduce_once`` ZeRO 2 and 3 accumulate the gradients locally and reduce-scatter
them once per step, as ZeRO 1 does; without ``reshard_after_forward`` ZeRO 3 keeps the
forward's gathered weights for the backward (one gather per microbatch), and with
``reduce_once`` besides for the whole step (one gather per step, ZeRO 1's traffic).
Collectives run over the group as :mod:`~pipedsl.simulator.collectives` prices them. With
``Plan.fsdp`` the ZeRO group is a shard group of fsdp·cp ranks, and after the shard group's
reduction each rank's gradient shard is all-reduced across the dp / fsdp replicas (over
DCN between TPU slices, over the network between GPU node groups).

Overlap, as XLA's latency-hiding scheduler and FSDP's prefetch run it: layer by layer
(:func:`~pipedsl.simulator.transformer.pipelined_exposed`), ``dp_overlap`` being the
fraction of the covering computation that can hide this traffic. Once-per-step gradient
reduction can hide only behind the last microbatch's backward (the gradients are final
only then), each layer's once its backward is done, so the last layer's is exposed
whatever; the weight all-gather hides behind the next step's first forward, the first
layer's gather exposed; per-microbatch ZeRO 2/3 traffic hides behind that microbatch's
own forward or backward, layer by layer. The default ``dp_overlap = 1`` therefore gives
partial overlap: all but a layer's for one microbatch, a tail for many. Over several TPU slices
the step also waits for the slowest slice at each of the device's layers, where the layer's
traffic meets the slices over DCN (:func:`~pipedsl.simulator.network.slice_wait_s`): part of
the exposed tail. The optimizer step reads and writes 30 bytes per local
parameter of weights stored in 16 bits (28 of fp32 ones, which are their own master) at HBM
bandwidth; the cluster's fixed cost of a step (``Cluster.step_overhead_s``, 0 on GPUs)
comes with it, once per step however many pipeline devices update.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedsl.simulator.collectives import Group, all_reduce_seconds, gather_seconds, plan_group
from pipedsl.simulator.hardware import Cluster
from pipedsl.simulator.network import slice_wait_s
from pipedsl.simulator.plan import Plan
from pipedsl.simulator.torus import TorusGroup
from pipedsl.simulator.transformer import Shapes, Work, pipelined_exposed

__all__ = ["dp_group", "replica_group", "gathers_per_step", "tails", "zero_per_microbatch"]

_OPTIMIZER_TRAFFIC = 28
"""HBM bytes the Adam update moves per fp32 parameter: reads grad, master, m, v (16),
writes master, m, v (12); a narrower model also writes its weights' copy (dtype_bytes)."""


def dp_group(plan: Plan, cluster: Cluster) -> Group | TorusGroup:
    """The ranks that share ZeRO shards of one tensor and pipeline rank's weights: the
    fsdp·cp ranks of a shard group (dp·cp without ``Plan.fsdp``; stride tp: ranks are
    tensor-parallel innermost, then context-, then the shard group's, then the replicas')."""
    return plan_group(plan, ("fsdp", "context"), cluster)


def replica_group(plan: Plan, cluster: Cluster) -> Group | TorusGroup:
    """The dp / fsdp replicas of one shard: the ranks holding the same shard of the same
    weights in each shard group, which all-reduce it (one rank without ``Plan.fsdp``)."""
    return plan_group(plan, ("data",), cluster)


def gathers_per_step(plan: Plan) -> bool:
    """Whether the updated weights are all-gathered once per step (ZeRO 1 and 2, and ZeRO
    3 that keeps its gathered weights for the whole step); ZeRO 3 otherwise gathers
    them per microbatch, ZeRO 0 not at all."""
    return plan.zero in (1, 2) or (plan.zero == 3 and plan.reduce_once and not plan.reshard_after_forward)


def tails(
    shapes: Shapes,
    work: Sequence[Work],
    placement: tuple[int, ...],
    device_params: Sequence[float],
    *,
    layers: Sequence[int] | None = None,
    serial: bool = False,
) -> tuple[float, float]:
    """(exposed data-parallel seconds, optimizer seconds) of the device where they sum
    to the most; with ``serial`` (pipeline devices that take turns on a host's cores, see
    :func:`~pipedsl.simulator.estimate.prepare`), of all the devices together: their
    reductions and updates run one after another. ``layers`` are each stage's layers
    (shape (S,); one each when not given): a device's traffic is overlapped with its
    work layer by layer. The optimizer seconds include the executor's fixed cost of a
    step (``Cluster.step_overhead_s``), once per step."""
    # Per device, its stages' backward and forward seconds and layers, summed in stage order.
    pp = shapes.plan.pp
    last_backward, first_forward, device_layers = [0.0] * pp, [0.0] * pp, [0] * pp
    for s, (w, d) in enumerate(zip(work, placement, strict=True)):
        last_backward[d] += w.backward
        first_forward[d] += w.forward
        device_layers[d] += 1 if layers is None else layers[s]
    # Devices of like stages hold like parameters: each distinct device is priced once.
    priced: dict[tuple[float, float, float, int], tuple[float, float]] = {}
    best = total = (0.0, 0.0)
    for d in range(pp):
        device = (device_params[d], last_backward[d], first_forward[d], device_layers[d])
        found = priced.get(device)
        if found is None:
            found = priced[device] = (_dp_tail(shapes, *device), _optimizer_seconds(shapes, device[0]))
        if found[0] + found[1] > sum(best):
            best = found
        total = (total[0] + found[0], total[1] + found[1])
    reduced, updated = total if serial else best
    return reduced, updated + shapes.cluster.step_overhead_s


def _gather(shapes: Shapes, num_bytes: float) -> float:
    return gather_seconds(num_bytes, dp_group(shapes.plan, shapes.cluster), shapes.cluster)


def zero_per_microbatch(shapes: Shapes, stage_params: float, work: Work, layers: int = 1) -> Work:
    """Exposed per-microbatch ZeRO traffic of one stage of ``layers`` layers: stage 2
    reduce-scatters each microbatch's gradients (hidden behind ``W``) unless it reduces
    once per step, stage 3 also gathers the weights for the forward and, when it reshards
    after the forward, again for the backward (none of it per microbatch when it keeps
    them for the step). Each is overlapped layer by layer with the work beside it
    (:func:`~pipedsl.simulator.transformer.pipelined_exposed`): the first layer's gather
    waits for its weights, the last layer's reduction follows its gradients."""
    plan = shapes.plan
    if plan.zero < 2 or plan.shards == 1:
        return Work()
    hide, steps = plan.dp_overlap, max(layers, 1)
    weight_grad = 0.0
    if not plan.reduce_once:
        scatter = _gather(shapes, stage_params * plan.reduce_bytes)
        weight_grad = pipelined_exposed(scatter, hide * work.weight_grad, steps, tail=True)
    if plan.zero == 2 or gathers_per_step(plan):
        return Work(0.0, 0.0, weight_grad)
    gather = _gather(shapes, stage_params * shapes.model.dtype_bytes)
    forward = pipelined_exposed(gather, hide * work.forward, steps, tail=True)
    input_grad = (
        pipelined_exposed(gather, hide * work.input_grad, steps, tail=True) if plan.reshard_after_forward else 0.0
    )
    return Work(forward, input_grad, weight_grad)


def _dp_tail(shapes: Shapes, device_params: float, last_backward: float, first_forward: float, layers: int) -> float:
    """Exposed once-per-step data-parallel seconds of one device, the wait for the slowest
    slice at each of its ``layers`` included (see the module docstring)."""
    plan = shapes.plan
    hide, steps = plan.dp_overlap, max(layers, 1)
    weights = device_params * shapes.model.dtype_bytes
    grads = device_params * plan.reduce_bytes
    # Once-per-step reductions follow the last backward: within the shard group, then of
    # each shard across the replicas.
    reduce = 0.0
    if plan.replicas > 1:
        reduce += all_reduce_seconds(grads / plan.shards, replica_group(plan, shapes.cluster), shapes.cluster)
    tail = 0.0
    if plan.shards > 1:
        if plan.zero == 0:
            reduce += all_reduce_seconds(grads, dp_group(plan, shapes.cluster), shapes.cluster)
        elif plan.reduces_once:
            reduce += _gather(shapes, grads)
        if gathers_per_step(plan):
            tail += pipelined_exposed(_gather(shapes, weights), hide * first_forward, steps, tail=True)
    wait = slice_wait_s(layers, shapes.cluster)
    return wait + tail + pipelined_exposed(reduce, hide * last_backward, steps, tail=True)


def least_optimizer_seconds(shapes: Shapes, stage_params: Sequence[float]) -> float:
    """Seconds of the optimizer step at least, before the stages are placed: the update of
    the average pipeline device's share of ``stage_params`` (shape (S,)) and the step's
    fixed cost. No more than :func:`tails`' optimizer seconds: the update grows with the
    parameters, and the fullest device holds at least the average."""
    return _optimizer_seconds(shapes, sum(stage_params) / shapes.plan.pp) + shapes.cluster.step_overhead_s


def _optimizer_seconds(shapes: Shapes, device_params: float) -> float:
    """The update of a device's parameters."""
    local = device_params / (shapes.plan.shards if shapes.plan.zero >= 1 else 1)
    stored = shapes.model.stored_bytes
    traffic = _OPTIMIZER_TRAFFIC + (stored if stored < 4 else 0)
    return shapes.traffic_seconds(local * traffic)
