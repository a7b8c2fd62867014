"""The plan estimator: step time, throughput, MFU and memory of one parallel plan.

:func:`estimate` turns a :class:`~pipedsl.simulator.plan.Plan` into per-stage costs with
the standard formulas and runs the pipeline part through the simulator. It is
``prepare(...).finish()``: :func:`prepare` does everything that needs no simulation (the
costs, the memory, a lower bound on the step time), so a search can drop or order plans
before it simulates any.

What is modelled, per GPU and per microbatch of ``b`` sequences of ``s`` tokens (h hidden,
a heads, V vocabulary, t = tp):

- Matrix multiplications: forward 2 FLOPs per weight per token over t GPUs, plus
  attention's 4·b·s²·h/t; the backward twice that, of which ``W`` (weight gradients) is
  the linear layers' share and ``I`` the rest. They run at ``peak × matmul_efficiency``.
- Elementwise work (norms, dropout, activations, softmax, the loss) is bound by memory
  bandwidth: each byte a layer stores for its backward (Korthikanti et al. 2022:
  s·b·h·(34 + 5·a·s/h)/t with sequence parallelism) costs two bytes of HBM traffic in the
  forward and four in the backward. FlashAttention never writes the a·s² scores, so it
  drops that term from both traffic and memory.
- Recomputation: ``full`` reruns each layer's forward (compute and tensor-parallel
  collectives) inside ``I`` and stores only the layer input (2·s·b·h/t); ``selective``
  reruns attention's core (its FLOPs and score traffic) and stores 34·s·b·h/t.
- Tensor parallelism: 2 all-reduces of b·s·h values in the forward and 2 in the backward
  per layer (2 more with full recomputation), ring alpha-beta on NVLink when
  ``tp <= gpus_per_node``, otherwise on the inter-node link. Sequence parallelism turns
  each into a reduce-scatter plus an all-gather of the same cost.
- Stages: the layers split evenly over ``pp × vpp`` stages; the first stage adds the
  embedding, the last the final norm, logits (2·b·s·h·V/t FLOPs) and the loss, whose fp32
  softmax (4·b·s·V/t bytes) it keeps for the backward. Pipeline sends carry b·s·h/t
  values per GPU (Megatron's scatter/gather), on NVLink when both pipeline neighbours sit
  in one node and on the inter-node link otherwise. Ranks are laid out tensor-parallel
  innermost, then data-parallel, then pipeline (Megatron's order).
- Data parallelism, reducing gradients of ``reduce_bytes`` (4, fp32, by default): ZeRO 0
  all-reduces them once per step,
  ZeRO 1 reduce-scatters them and all-gathers the updated 16-bit weights, ZeRO 2
  reduce-scatters every microbatch's gradients (that is what frees their memory) and
  all-gathers the weights once, ZeRO 3 also all-gathers the weights in every forward and
  backward. Overlap: ``dp_overlap`` is the fraction of the covering computation that can
  hide this traffic. Once-per-step gradient reduction can hide only behind the last
  microbatch's backward (the gradients are final only then), the weight all-gather only
  behind the next step's first forward; per-microbatch ZeRO 2/3 traffic hides behind that
  microbatch's own forward or backward. The default ``dp_overlap = 1`` therefore gives
  partial overlap: full for one microbatch, a tail for many.
- Memory: 16-bit weights, fp32 gradients and 12 bytes of Adam state (fp32 master, m, v)
  per parameter, sharded by ZeRO stage; activations are the simulator's peak of
  residual bytes held per device under the schedule, plus one layer's working set under
  full recomputation; ZeRO 3 adds two layers' gathered weights.
- The optimizer step reads and writes 30 bytes per local parameter at HBM bandwidth.

Step time = pipeline makespan (simulated) + the slowest device's exposed data-parallel
tail and optimizer step. MFU = 6·N·tokens / (GPUs × peak × step time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipedsl.ir import Schedule
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.engine import Simulation
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.pipelines import Pipelines, ScheduleKey
from pipedsl.simulator.plan import Plan, PlanError, Recompute

__all__ = [
    "DoesNotFit",
    "Memory",
    "Estimate",
    "Prepared",
    "prepare",
    "estimate",
    "ring_all_reduce_seconds",
    "ring_gather_seconds",
    "GRAD_BYTES",
    "OPTIMIZER_BYTES",
]

GRAD_BYTES = 4
"""Bytes per gradient value held: fp32, as accumulated over microbatches."""
OPTIMIZER_BYTES = 12
"""Bytes of Adam state per parameter: fp32 master weight, first and second moments."""
_OPTIMIZER_TRAFFIC = 30
"""HBM bytes the Adam update moves per parameter: reads grad, master, m, v (16), writes
master, m, v (12) and the 16-bit weight (2)."""
_LOSS_BYTES = 4
"""Bytes per logit of the fp32 softmax the loss keeps for its backward."""


class DoesNotFit(PlanError):
    """A plan needs more memory per GPU than the cluster has; ``memory`` says where it goes."""

    def __init__(self, plan: Plan, memory: Memory) -> None:
        self.plan = plan
        self.memory = memory
        super().__init__(
            f"{plan.label} needs {memory.total / 2**30:.1f} GiB per GPU (weights {memory.weights / 2**30:.1f}, "
            f"gradients {memory.gradients / 2**30:.1f}, optimizer {memory.optimizer / 2**30:.1f}, "
            f"activations {memory.activations / 2**30:.1f}), above the {memory.usable / 2**30:.1f} GiB usable"
        )


# --- collectives ------------------------------------------------------------------------


def ring_all_reduce_seconds(num_bytes: float, ranks: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``ranks``: 2(n−1)·α + 2(n−1)/n · S/B seconds."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * num_bytes / bandwidth


def ring_gather_seconds(num_bytes: float, ranks: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-gather or reduce-scatter of ``num_bytes`` (the whole, unsharded size) over
    ``ranks``: (n−1)·α + (n−1)/n · S/B seconds."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return (ranks - 1) * latency + (ranks - 1) / ranks * num_bytes / bandwidth


# --- per-block work ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Work:
    """Seconds of one block for one microbatch: forward, input-gradient and weight-gradient
    halves of the backward (``B = I + W``)."""

    forward: float = 0.0
    input_grad: float = 0.0
    weight_grad: float = 0.0

    def __add__(self, other: _Work) -> _Work:
        return _Work(
            self.forward + other.forward, self.input_grad + other.input_grad, self.weight_grad + other.weight_grad
        )

    def __mul__(self, factor: float) -> _Work:
        return _Work(self.forward * factor, self.input_grad * factor, self.weight_grad * factor)

    @property
    def backward(self) -> float:
        return self.input_grad + self.weight_grad


@dataclass(frozen=True, slots=True)
class _Shapes:
    """The numbers every formula below needs, for one plan: b, s, h, a, t and friends."""

    model: Model
    cluster: Cluster
    plan: Plan

    @property
    def tokens(self) -> int:
        """Tokens per microbatch b·s."""
        return self.plan.microbatch_size * self.model.seq_len

    def matmul_seconds(self, flops: float) -> float:
        return flops / self.cluster.matmul_flops

    def traffic_seconds(self, num_bytes: float) -> float:
        return num_bytes / self.cluster.hbm_bandwidth

    def tp_all_reduce(self) -> float:
        """One tensor-parallel all-reduce of b·s·h values, in seconds."""
        tp = self.plan.tp
        bandwidth, latency = self.cluster.link(inter_node=tp > self.cluster.gpus_per_node)
        size = self.tokens * self.model.hidden * self.model.dtype_bytes
        return ring_all_reduce_seconds(size, tp, bandwidth=bandwidth, latency=latency)

    def layer_activation_bytes(self, recompute: Recompute) -> float:
        """Bytes one layer keeps per microbatch for its backward (Korthikanti et al. 2022)."""
        m, t = self.model, self.plan.tp
        sbh = self.tokens * m.hidden
        scores = 0.0 if self.plan.flash_attention else 5 * m.heads * m.seq_len / m.hidden
        if recompute is Recompute.FULL:
            return 2 * sbh / (t if self.plan.sequence_parallel else 1)
        if recompute is Recompute.SELECTIVE:
            scores = 0.0
        replicated = 10 / t if self.plan.sequence_parallel else 10
        return sbh * (replicated + 24 / t + scores / t)

    def layer_work(self) -> _Work:
        """One transformer layer for one microbatch on one GPU."""
        m, plan = self.model, self.plan
        t = plan.tp
        linear = self.matmul_seconds(2 * self.tokens * m.layer_matmul_params / t)
        attention = self.matmul_seconds(4 * plan.microbatch_size * m.seq_len**2 * m.hidden / t)
        stored = self.layer_activation_bytes(Recompute.NONE)
        score_bytes = 0.0
        if not plan.flash_attention:
            score_bytes = self.tokens * m.hidden * 5 * m.heads * m.seq_len / m.hidden / t
        elementwise = self.traffic_seconds(2 * stored)
        collectives = 2 * self.tp_all_reduce()
        forward = linear + attention + elementwise + collectives
        # I carries everything on the activation-gradient path: the input-gradient matmuls,
        # attention's core, the elementwise backward and the backward collectives.
        input_grad = linear + 2 * attention + 2 * elementwise + collectives
        if plan.recompute is Recompute.FULL:
            input_grad += forward
        elif plan.recompute is Recompute.SELECTIVE and not plan.flash_attention:
            input_grad += attention + self.traffic_seconds(2 * score_bytes)
        return _Work(forward, input_grad, linear)

    def embedding_work(self) -> _Work:
        """Token (and position) lookup, its dropout, and the scatter-add of its gradient."""
        size = self.tokens * self.model.hidden * self.model.dtype_bytes / self.plan.tp
        seconds = self.traffic_seconds(2 * size)
        return _Work(seconds, 0.0, 2 * seconds)

    def head_work(self) -> _Work:
        """Final norm, logits (2·b·s·h·V/t FLOPs) and the vocabulary-parallel loss."""
        m, t = self.model, self.plan.tp
        logits = self.matmul_seconds(self.tokens * m.logit_forward_flops_per_token / t)
        loss = self.traffic_seconds(2 * self.head_activation_bytes())
        return _Work(logits + loss, logits + 2 * loss, logits)

    def head_activation_bytes(self) -> float:
        """The loss's fp32 softmax plus the final norm's input, per microbatch."""
        m, t = self.model, self.plan.tp
        return self.tokens * (m.vocab * _LOSS_BYTES + m.hidden * m.dtype_bytes) / t

    def embedding_activation_bytes(self) -> float:
        """The embedding dropout's mask, one byte per value."""
        return self.tokens * self.model.hidden / self.plan.tp


# --- results ----------------------------------------------------------------------------


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

    def to_json(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
            "usable": self.usable,
        }


@dataclass(frozen=True, slots=True)
class Estimate:
    """What one plan costs per training step.

    Attributes:
      model, cluster, plan: what was estimated.
      step_time_s: seconds per step.
      pipeline_time_s: seconds of the forward/backward part (the simulated makespan for
        a pipeline; microbatches × (F + B) for SPMD).
      dp_tail_s: exposed data-parallel communication after the pipeline, seconds.
      optimizer_s: the optimizer update, seconds.
      bubble: idle fraction of the pipeline part (0 for SPMD).
      tokens_per_s: tokens trained per second, whole cluster.
      mfu: model FLOPs utilisation, 6·N·tokens / (GPUs × peak × step time).
      memory: bytes per GPU on the fullest device.
      stage_forward_s, stage_backward_s: per-stage seconds per microbatch, shape (S,).
      simulation: the pipeline simulation (None for SPMD).
    """

    model: Model
    cluster: Cluster
    plan: Plan
    step_time_s: float
    pipeline_time_s: float
    dp_tail_s: float
    optimizer_s: float
    bubble: float
    tokens_per_s: float
    mfu: float
    memory: Memory
    stage_forward_s: tuple[float, ...]
    stage_backward_s: tuple[float, ...]
    simulation: Simulation | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def memory_bytes_per_gpu(self) -> int:
        return self.memory.total

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "cluster": self.cluster.name,
            "gpus": self.plan.gpus,
            "plan": self.plan.to_json(),
            "step_time_s": self.step_time_s,
            "pipeline_time_s": self.pipeline_time_s,
            "dp_tail_s": self.dp_tail_s,
            "optimizer_s": self.optimizer_s,
            "bubble": self.bubble,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "memory_bytes_per_gpu": self.memory.total,
            "memory": self.memory.to_json(),
            "fits": self.fits,
            "stage_forward_s": list(self.stage_forward_s),
            "stage_backward_s": list(self.stage_backward_s),
        }


# --- the pipeline part ------------------------------------------------------------------


def _node_of(rank: int, cluster: Cluster) -> int:
    return rank // cluster.gpus_per_node


def _pipeline_link_inter(a: int, b: int, plan: Plan, cluster: Cluster) -> bool:
    """Whether pipeline devices a and b talk over the inter-node link for some replica.

    Rank of (tensor rank r, data rank d, pipeline device p) is r + tp·(d + dp·p); the
    send from p to q pairs equal (r, d), so the link is inter-node if any pair crosses.
    """
    block = plan.tp * plan.dp
    return any(_node_of(a * block + j, cluster) != _node_of(b * block + j, cluster) for j in range(block))


def _transfer_costs(placement: tuple[int, ...], shapes: _Shapes) -> tuple[float, float, tuple[int, ...]]:
    """(latency, bandwidth, bytes per stage boundary) for the simulator's one-link model.

    Boundaries on the faster intra-node link keep their real bytes; a boundary on the
    inter-node link is given the bytes that take the intra-node link as long as the
    inter-node link takes the real ones, so that each transfer lasts exactly its own
    link's alpha + bytes/beta. With every boundary on one link the bytes are real.
    """
    plan, cluster, model = shapes.plan, shapes.cluster, shapes.model
    size = shapes.tokens * model.hidden * model.dtype_bytes / plan.tp
    inter = [_pipeline_link_inter(placement[b], placement[b + 1], plan, cluster) for b in range(len(placement) - 1)]
    fast_bw, fast_lat = cluster.link(inter_node=False)
    slow_bw, slow_lat = cluster.link(inter_node=True)
    if all(inter):
        return slow_lat, slow_bw, tuple(round(size) for _ in inter)
    slow_as_fast = size * fast_bw / slow_bw + (slow_lat - fast_lat) * fast_bw
    return fast_lat, fast_bw, tuple(round(slow_as_fast if x else size) for x in inter)


# --- the estimate -------------------------------------------------------------------------


def _split_layers(model: Model, stages: int) -> int:
    if model.layers % stages:
        raise PlanError(
            f"{model.name}'s {model.layers} layers do not split evenly over {stages} stages (pp × vpp); "
            f"choose pp × vpp dividing {model.layers}"
        )
    return model.layers // stages


def _check_fit(model: Model, cluster: Cluster, plan: Plan) -> None:
    t = plan.tp
    if model.heads % t or (model.num_kv_heads % t and t % model.num_kv_heads):
        raise PlanError(f"tp = {t} does not divide {model.name}'s {model.heads} attention heads evenly")
    if model.ffn_hidden % t:
        raise PlanError(f"tp = {t} does not divide {model.name}'s feed-forward width {model.ffn_hidden}")
    node = cluster.gpus_per_node
    if node % t and t % node:
        raise PlanError(f"tp = {t} neither divides nor is a multiple of {node} GPUs per node")


def _stage_params(model: Model, plan: Plan, stages: int, per_stage_layers: int) -> tuple[float, ...]:
    """Parameters each GPU of each stage holds (tensor-parallel shards), shape (S,).

    With a tied embedding and more than one stage, the last stage keeps its own copy of
    the embedding matrix for the logits, as Megatron-LM does.
    """
    t = plan.tp
    params = [per_stage_layers * model.layer_params / t for _ in range(stages)]
    params[0] += model.embedding_params / t
    head = model.head_params / t
    if model.tied_embeddings and stages > 1:
        head += model.vocab * model.hidden / t
    params[-1] += head
    return tuple(params)


@dataclass(frozen=True, slots=True, eq=False)
class Prepared:
    """A plan with its costs worked out, before the pipeline is simulated.

    Attributes:
      memory: bytes per GPU on the fullest device (exact: memory follows the schedule's
        order, not its timing).
      lower_bound_s: seconds the step takes at least, whatever the simulation finds: the
        schedule's order against each action's dependency chain with free transfers
        (:meth:`~pipedsl.simulator.plan.Pipelines.lower_bound_s`), plus the
        data-parallel tail and the optimizer step.
    """

    shapes: _Shapes
    key: ScheduleKey | None
    placement: tuple[int, ...]
    pipelines: Pipelines | None
    work: tuple[_Work, ...]
    residual: tuple[int, ...]
    device_params: tuple[float, ...]
    memory: Memory
    lower_bound_s: float

    @property
    def plan(self) -> Plan:
        return self.shapes.plan

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def finish(self) -> Estimate:
        """Simulate the pipeline (if any) and assemble the :class:`Estimate`."""
        shapes, work, key = self.shapes, self.work, self.key
        model, cluster, plan = shapes.model, shapes.cluster, shapes.plan
        simulation: Simulation | None = None
        if key is not None and self.pipelines is not None:
            latency, bandwidth, boundary_bytes = _transfer_costs(self.placement, shapes)
            costs = CostModel(
                forward=tuple(w.forward for w in work),
                input_grad=tuple(w.input_grad for w in work),
                weight_grad=tuple(w.weight_grad for w in work),
                latency=latency,
                bandwidth=bandwidth,
                activation_bytes=boundary_bytes,
                residual_bytes=self.residual,
            )
            timing = self.pipelines.timing(key, costs)
            pipeline_time, bubble, simulation = timing.makespan, timing.bubble_ratio, timing.simulation
        else:
            pipeline_time = plan.microbatches * (work[0].forward + work[0].backward)
            bubble = 0.0
        tail, optimizer = _tails(shapes, work, self.placement, self.device_params)
        step = pipeline_time + tail + optimizer
        tokens = plan.global_batch * model.seq_len
        return Estimate(
            model=model,
            cluster=cluster,
            plan=plan,
            step_time_s=step,
            pipeline_time_s=pipeline_time,
            dp_tail_s=tail,
            optimizer_s=optimizer,
            bubble=bubble,
            tokens_per_s=tokens / step,
            mfu=model.model_flops_per_step(tokens) / (plan.gpus * cluster.peak_flops * step),
            memory=self.memory,
            stage_forward_s=tuple(w.forward for w in work),
            stage_backward_s=tuple(w.backward for w in work),
            simulation=simulation,
        )


def prepare(
    model: Model, cluster: Cluster, plan: Plan, *, pipelines: Pipelines | None = None, fits_first: bool = False
) -> Prepared:
    """Work out ``plan``'s costs and memory without simulating (see :class:`Prepared`).

    ``pipelines`` caches evaluated schedules and simulations across calls.

    Raises:
      PlanError: the plan does not divide the model or does not match its schedule.
      DoesNotFit: with ``fits_first``, when the plan does not fit; if not even the
        average device's weights, gradients and optimizer state fit, before the schedule
        is evaluated.
      PipedslError: a schedule's own errors, such as a failed ``require``.
    """
    _check_fit(model, cluster, plan)
    shapes = _Shapes(model, cluster, plan)
    stages = plan.pp * plan.vpp
    per_stage_layers = _split_layers(model, stages)
    params = _stage_params(model, plan, stages, per_stage_layers)
    # The fullest device holds at least the average share: a cheap test before the
    # schedule is evaluated.
    average = _memory(shapes, [sum(params) / plan.pp], (0,), 0.0)
    if fits_first and not average.fits:
        raise DoesNotFit(plan, average)
    key: ScheduleKey | None = None
    placement: tuple[int, ...] = (0,)
    if plan.pp > 1:
        pipelines = pipelines if pipelines is not None else Pipelines()
        key = pipelines.key(plan)
        schedule = pipelines.schedule(key)
        _check_schedule(plan, schedule)
        placement = schedule.placement

    layer = shapes.layer_work()
    work = [layer * per_stage_layers for _ in range(stages)]
    work[0] = work[0] + shapes.embedding_work()
    work[-1] = work[-1] + shapes.head_work()
    work = [w + _zero_per_microbatch(shapes, p, w) for w, p in zip(work, params, strict=True)]
    device_params = [0.0] * plan.pp
    for s, d in enumerate(placement):
        device_params[d] += params[s]

    residual = [round(per_stage_layers * shapes.layer_activation_bytes(plan.recompute)) for _ in range(stages)]
    residual[0] += round(shapes.embedding_activation_bytes())
    residual[-1] += round(shapes.head_activation_bytes())
    activations = (residual[0],)
    if key is not None and pipelines is not None:
        activations = pipelines.peak_residual_bytes(key, tuple(residual))
    memory = _memory(shapes, device_params, activations, _transient_bytes(shapes))
    if fits_first and not memory.fits:
        raise DoesNotFit(plan, memory)
    return Prepared(
        shapes=shapes,
        key=key,
        placement=placement,
        pipelines=pipelines,
        work=tuple(work),
        residual=tuple(residual),
        device_params=tuple(device_params),
        memory=memory,
        lower_bound_s=_lower_bound(plan, work, key, pipelines) + sum(_tails(shapes, work, placement, device_params)),
    )


def estimate(
    model: Model,
    cluster: Cluster,
    plan: Plan,
    *,
    pipelines: Pipelines | None = None,
    fits_first: bool = False,
) -> Estimate:
    """Estimate ``plan`` for ``model`` on ``cluster`` (see the module docstring).

    ``pipelines`` caches evaluated schedules and simulations across calls. With
    ``fits_first``, a plan that does not fit in memory raises :class:`DoesNotFit`
    before anything is simulated; otherwise it is estimated with ``fits`` False.

    Raises as :func:`prepare`.
    """
    return prepare(model, cluster, plan, pipelines=pipelines, fits_first=fits_first).finish()


def _lower_bound(plan: Plan, work: list[_Work], key: ScheduleKey | None, pipelines: Pipelines | None) -> float:
    """Seconds the forward/backward part takes at least (see :meth:`Pipelines.lower_bound_s`);
    for SPMD, exactly its microbatches × (F + B)."""
    if key is None or pipelines is None:
        return plan.microbatches * (work[0].forward + work[0].backward)
    seconds = np.array([[w.forward, w.backward, w.input_grad, w.weight_grad] for w in work]).T
    return pipelines.lower_bound_s(key, seconds)


def _tails(
    shapes: _Shapes,
    work: list[_Work] | tuple[_Work, ...],
    placement: tuple[int, ...],
    device_params: list[float] | tuple[float, ...],
) -> tuple[float, float]:
    """(exposed data-parallel seconds, optimizer seconds) of the device where they sum
    to the most."""
    best = (0.0, 0.0)
    for d in range(shapes.plan.pp):
        own = [s for s, dev in enumerate(placement) if dev == d]
        last_backward = sum(work[s].backward for s in own)
        first_forward = sum(work[s].forward for s in own)
        tail = _dp_tail(shapes, device_params[d], last_backward, first_forward)
        optimizer = _optimizer_seconds(shapes, device_params[d])
        if tail + optimizer > sum(best):
            best = (tail, optimizer)
    return best


def _check_schedule(plan: Plan, schedule: Schedule) -> None:
    if schedule.num_devices != plan.pp or schedule.num_stages != plan.pp * plan.vpp:
        per_device = schedule.num_stages // max(schedule.num_devices, 1)
        raise PlanError(
            f"schedule {plan.schedule} runs {schedule.num_stages} stages on {schedule.num_devices} devices, "
            f"but the plan has pp = {plan.pp} and vpp = {plan.vpp}; this schedule needs vpp = {per_device}"
        )


def _memory(shapes: _Shapes, device_params: list[float], activations: tuple[int, ...], transient: float) -> Memory:
    """Memory of the fullest of the devices holding ``device_params`` parameters and
    ``activations`` bytes of activations (one number per device)."""
    plan, model = shapes.plan, shapes.model
    static = [_static_memory(plan, p, model.dtype_bytes) for p in device_params]
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


def _dp_link(shapes: _Shapes) -> tuple[float, float]:
    plan, cluster = shapes.plan, shapes.cluster
    return cluster.link(inter_node=plan.tp * plan.dp > cluster.gpus_per_node)


def _gather(shapes: _Shapes, num_bytes: float) -> float:
    bandwidth, latency = _dp_link(shapes)
    return ring_gather_seconds(num_bytes, shapes.plan.dp, bandwidth=bandwidth, latency=latency)


def _zero_per_microbatch(shapes: _Shapes, stage_params: float, work: _Work) -> _Work:
    """Exposed per-microbatch ZeRO traffic of one stage: stage 2 reduce-scatters each
    microbatch's gradients (hidden behind ``W``), stage 3 also gathers the weights for
    the forward and again for the backward."""
    plan = shapes.plan
    if plan.zero < 2 or plan.dp == 1:
        return _Work()
    hide = plan.dp_overlap
    scatter = _gather(shapes, stage_params * plan.reduce_bytes)
    weight_grad = max(0.0, scatter - hide * work.weight_grad)
    if plan.zero == 2:
        return _Work(0.0, 0.0, weight_grad)
    gather = _gather(shapes, stage_params * shapes.model.dtype_bytes)
    forward = max(0.0, gather - hide * work.forward)
    input_grad = max(0.0, gather - hide * work.input_grad)
    return _Work(forward, input_grad, weight_grad)


def _dp_tail(shapes: _Shapes, device_params: float, last_backward: float, first_forward: float) -> float:
    """Exposed once-per-step data-parallel seconds of one device (see the module docstring)."""
    plan = shapes.plan
    if plan.dp == 1:
        return 0.0
    hide = plan.dp_overlap
    weights = device_params * shapes.model.dtype_bytes
    grads = device_params * plan.reduce_bytes
    if plan.zero == 0:
        bandwidth, latency = _dp_link(shapes)
        reduce = ring_all_reduce_seconds(grads, plan.dp, bandwidth=bandwidth, latency=latency)
        return max(0.0, reduce - hide * last_backward)
    gather = max(0.0, _gather(shapes, weights) - hide * first_forward)
    if plan.zero == 1:
        return max(0.0, _gather(shapes, grads) - hide * last_backward) + gather
    if plan.zero == 2:
        return gather
    return 0.0


def _static_memory(plan: Plan, device_params: float, dtype_bytes: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per GPU, sharded by ZeRO stage."""
    dp = plan.dp
    weights = device_params * dtype_bytes / (dp if plan.zero >= 3 else 1)
    grads = device_params * GRAD_BYTES / (dp if plan.zero >= 2 else 1)
    optimizer = device_params * OPTIMIZER_BYTES / (dp if plan.zero >= 1 else 1)
    return weights, grads, optimizer


def _transient_bytes(shapes: _Shapes) -> float:
    """Working memory that is not per microbatch: one layer's full activations while
    full recomputation rebuilds it; ZeRO 3's gathered weights of two layers (the one
    running and the one prefetched)."""
    plan, model = shapes.plan, shapes.model
    extra = 0.0
    if plan.recompute is Recompute.FULL:
        extra += shapes.layer_activation_bytes(Recompute.NONE)
    if plan.zero == 3:
        extra += 2 * model.layer_params * model.dtype_bytes / plan.tp
    return extra


def _optimizer_seconds(shapes: _Shapes, device_params: float) -> float:
    local = device_params / (shapes.plan.dp if shapes.plan.zero >= 1 else 1)
    return shapes.traffic_seconds(local * _OPTIMIZER_TRAFFIC)

