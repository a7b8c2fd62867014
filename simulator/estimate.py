"""The plan estimator: step time, throughput, MFU and memory of one parallel plan.

:func:`estimate` turns a :class:`~pipedsl.simulator.plan.Plan` into per-stage costs and
runs the pipeline part through the simulator. It is ``prepare(...).finish()``:
:func:`prepare` does everything that needs no simulation (the costs, the memory, a lower
bound on the step time), so a search can drop or order plans before it simulates any.

This module assembles four models:

- :mod:`~pipedsl.simulator.transformer`: each layer's, the embedding's and the head's
  work per microbatch on one GPU (matrix shapes, the size-dependent compute model,
  elementwise traffic, kernel launches, tensor-parallel collectives);
- :mod:`~pipedsl.simulator.collectives`: all-reduce, all-gather, reduce-scatter and
  sends by algorithm and by the group's place in the nodes;
- :mod:`~pipedsl.simulator.memory`: bytes per GPU by ZeRO stage;
- :mod:`~pipedsl.simulator.data_parallel`: gradient and weight traffic between
  data-parallel ranks, its overlap, and the optimizer step.

Assembly:

- Stages: the layers split evenly over ``pp × vpp`` stages (or as ``stage_layers``
  says); the first stage adds the embedding, the last the final norm, logits and loss.
  Pipeline sends carry b·s·h/t values per GPU (Megatron's scatter/gather), on NVLink
  when both pipeline neighbours sit in one node and at the GPU's network share
  otherwise. Ranks are laid out tensor-parallel innermost, then data-parallel, then
  pipeline (Megatron's order).
- Data-parallel traffic by ZeRO stage, what of it the computation hides, and the
  optimizer step: :mod:`~pipedsl.simulator.data_parallel`.

Step time = pipeline makespan (simulated) + the slowest device's exposed data-parallel
tail and optimizer step (times the wait for the slowest node where the cluster prices
stragglers, :func:`~pipedsl.simulator.network.straggler_factor`; over several TPU slices the
tail holds the wait for the slowest slice at every layer,
:func:`~pipedsl.simulator.network.slice_wait_s`). Devices that share a host's cores (``Cluster.host_cores``,
forced CPU devices) are priced at their rates with every device of the node busy, and
the simulator shares the cores among the pipeline devices that compute at each moment
(processor sharing: :meth:`Cluster.speedup`), or, where the pipeline devices are meshes of
several of them, runs their programs one at a time in the order they are dispatched, as
XLA's CPU client does (worked out for the plan in one place, :func:`_sharing`); an SPMD
plan is one pipeline device that is always busy. Pipeline devices that share their devices
(``Plan.shared_devices``: a pipeline on one chip) are what the executor runs as one
program of the whole step, a loop over the microbatches, each through every stage: their
actions one after another, no transfers, no dispatch per action, every stage's
parameters and optimizer state and one microbatch's activations of every stage on the
devices.
MFU = 6·N·tokens / (GPUs × peak × step time). Every estimate
lists the :class:`Assumption` s it priced.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import count
from operator import attrgetter
from typing import Any

import numpy as np

from pipedsl.simulator.assumptions import Assumption, assumptions
from pipedsl.simulator.collectives import ring_all_reduce_seconds, ring_gather_seconds
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.data_parallel import least_optimizer_seconds, tails
from pipedsl.simulator.engine import Simulation
from pipedsl.simulator.flops import DEFAULT_FLOP_COUNT, FlopCount, step_flops
from pipedsl.simulator.frameworks import framework
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.memory import GRAD_BYTES, DoesNotFit, Memory, device_memory, optimizer_bytes
from pipedsl.simulator.network import straggler_factor, straggler_units
from pipedsl.simulator.pipelines import Pipelines, ScheduleKey
from pipedsl.simulator.plan import Plan, PlanError
from pipedsl.simulator.stages import split_layers, stage_params, stage_residual, stage_weight_residual, stage_work
from pipedsl.simulator.torus import crosses_slices, dcn_split, slice_shape
from pipedsl.simulator.transformer import Shapes, Work
from pipedsl.stage_costs import Layout

__all__ = [
    "Assumption",
    "DoesNotFit",
    "Memory",
    "Estimate",
    "Prepared",
    "prepare",
    "work_bound",
    "estimate",
    "assumptions",
    "check_divides",
    "ring_all_reduce_seconds",
    "ring_gather_seconds",
    "GRAD_BYTES",
    "optimizer_bytes",
]


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
      assumptions: what was priced (:func:`assumptions`), in the order printed.
      simulation: the pipeline simulation (None for SPMD).
      inflight_limit: the in-flight limit (``max_inflight``) a policy schedule was
        synthesised with when the search chose one for the plan's memory; None otherwise.
      synthesis_costs: the cost model that policy schedule was synthesised against (the
        plan's own); None otherwise.
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
    assumptions: tuple[Assumption, ...] = ()
    simulation: Simulation | None = field(default=None, repr=False)
    inflight_limit: int | None = None
    synthesis_costs: CostModel | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def memory_bytes_per_gpu(self) -> int:
        return self.memory.total

    def mfu_by(self, count: FlopCount) -> float:
        """MFU with the model FLOPs counted by ``count`` (:mod:`~pipedsl.simulator.flops`)."""
        return step_flops(self.model, self.plan, count) / (self.plan.gpus * self.cluster.peak_flops * self.step_time_s)

    def tflops_per_gpu(self, count: FlopCount) -> float:
        """Model TFLOP/s per GPU with the FLOPs counted by ``count``."""
        return step_flops(self.model, self.plan, count) / (self.plan.gpus * self.step_time_s) / 1e12

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
            "inflight_limit": self.inflight_limit,
            "assumptions": {a.name: {"value": a.value, "meaning": a.meaning} for a in self.assumptions},
        }


# --- groups and links -------------------------------------------------------------------


def _pipeline_link_inter(a: int, b: int, plan: Plan, cluster: Cluster) -> bool:
    """Whether pipeline devices a and b talk between nodes for some replica.

    Rank of (tensor rank r, context rank c, data rank d, pipeline device p) is
    r + tp·(c + cp·(d + dp·p)); the send from p to q pairs equal (r, c, d), so the link is
    inter-node if any pair crosses. On a torus the link is DCN where a and b sit in
    different slices, one ICI link otherwise.
    """
    if cluster.torus:
        return crosses_slices(a, b, plan, cluster)
    block, node = plan.tp * plan.cp * plan.dp, cluster.gpus_per_node
    return any((a * block + j) // node != (b * block + j) // node for j in range(block))


def _transfer_costs(placement: tuple[int, ...], shapes: Shapes) -> tuple[float, float, tuple[int, ...]]:
    """(latency, bandwidth, bytes per stage boundary) for the simulator's one-link model.

    Boundaries inside a node keep their real bytes; a boundary between nodes is given
    the bytes that take NVLink as long as the network takes the real ones, so that each
    transfer lasts exactly its own link's alpha + bytes/beta. With every boundary
    between nodes the bytes are real.
    """
    plan, cluster, model = shapes.plan, shapes.cluster, shapes.model
    size = shapes.tokens * model.hidden * model.dtype_bytes / plan.tp
    inter = [_pipeline_link_inter(placement[b], placement[b + 1], plan, cluster) for b in range(len(placement) - 1)]
    fast_bw, fast_lat = cluster.link(inter_node=False)
    _, slow_lat = cluster.link(inter_node=True)
    slow_bw = cluster.network_share
    if all(inter):
        return slow_lat, slow_bw, tuple(round(size) for _ in inter)
    slow_as_fast = size * fast_bw / slow_bw + (slow_lat - fast_lat) * fast_bw
    return fast_lat, fast_bw, tuple(round(slow_as_fast if x else size) for x in inter)


# --- checks -----------------------------------------------------------------------------


def check_divides(model: Model, cluster: Cluster, plan: Plan) -> None:
    """Raise :class:`PlanError` when ``plan`` does not divide ``model`` or ``cluster``:
    heads, key/value heads or the feed-forward width by tp, the sequence by 2·cp, tp
    against the GPUs per node, or on a torus the plan against its slices (the layers by
    pp × vpp are checked when the stages are split)."""
    t = plan.tp
    if model.heads % t or (model.num_kv_heads % t and t % model.num_kv_heads):
        raise PlanError(f"tp = {t} does not divide {model.name}'s {model.heads} attention heads evenly")
    if model.ffn_hidden % t:
        raise PlanError(f"tp = {t} does not divide {model.name}'s feed-forward width {model.ffn_hidden}")
    if model.seq_len % (2 * plan.cp) and plan.cp > 1:
        raise PlanError(
            f"cp = {plan.cp} does not split {model.name}'s sequence of {model.seq_len} tokens into 2·cp equal "
            "chunks (each context-parallel rank takes two, one from each end, to balance causal attention)"
        )
    if cluster.torus:
        _check_slices(cluster, plan)
        return
    node = cluster.gpus_per_node
    if node % t and t % node:
        raise PlanError(f"tp = {t} neither divides nor is a multiple of {node} GPUs per node")


def _check_slices(cluster: Cluster, plan: Plan) -> None:
    """On a torus: the chips split evenly over the slices, each slice a shape the torus
    offers, and the pipeline and data parallelism span the slices."""
    if plan.gpus % cluster.slices:
        raise PlanError(f"{plan.gpus} chips do not split evenly over {cluster.slices} slices")
    slice_shape(plan.gpus // cluster.slices, cluster)
    dcn_split(plan, cluster)


def _check_schedule(plan: Plan, schedule: Layout) -> None:
    if schedule.num_devices != plan.pp or schedule.num_stages != plan.pp * plan.vpp:
        per_device = schedule.num_stages // max(schedule.num_devices, 1)
        raise PlanError(
            f"schedule {plan.schedule} runs {schedule.num_stages} stages on {schedule.num_devices} devices, "
            f"but the plan has pp = {plan.pp} and vpp = {plan.vpp}; this schedule needs vpp = {per_device}"
        )


# --- the estimate -------------------------------------------------------------------------


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
      tails: (exposed data-parallel seconds, optimizer seconds) of the device where they
        sum to the most (:func:`~pipedsl.simulator.data_parallel.tails`), worked out once.
      speedup: how many times as fast as priced a pipeline device computes while n of
        them compute, at index n - 1, shape (pp,), where devices share a host's cores
        (:func:`_sharing`); None where each has compute of its own.
      serial: whether, sharing a host's cores, the pipeline devices take turns rather
        than share them (:func:`_sharing`).
    """

    shapes: Shapes
    key: ScheduleKey | None
    placement: tuple[int, ...]
    pipelines: Pipelines | None
    work: tuple[Work, ...]
    residual: tuple[int, ...]
    weight_residual: tuple[int, ...]
    device_params: tuple[float, ...]
    memory: Memory
    lower_bound_s: float
    tails: tuple[float, float]
    speedup: tuple[float, ...] | None
    serial: bool

    @property
    def plan(self) -> Plan:
        return self.shapes.plan

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def cost_model(self) -> CostModel:
        """The pipeline's cost model: per-stage F, I, W seconds, the links' transfer times
        and the residual bytes per microbatch."""
        work = self.work
        if self.plan.shared_devices:
            # The stages share their devices: a value stays where it is.
            latency, bandwidth, boundary_bytes = 0.0, None, (0,) * (len(work) - 1)
        else:
            latency, bandwidth, boundary_bytes = _transfer_costs(self.placement, self.shapes)
        backward, input_grad, weight_grad = _backward_seconds(work)
        return CostModel(
            forward=tuple(w.forward for w in work),
            backward=backward,
            input_grad=input_grad,
            weight_grad=weight_grad,
            latency=latency,
            bandwidth=bandwidth,
            activation_bytes=boundary_bytes,
            residual_bytes=self.residual,
            weight_residual_bytes=self.weight_residual,
            speedup=self.speedup,
            serial=self.serial,
            dispatch=self.shapes.action_overhead_s,
        )

    def finish(self) -> Estimate:
        """Simulate the pipeline (if any) and assemble the :class:`Estimate`."""
        if self.key is not None and self.pipelines is not None:
            costs = self.cost_model()
            timing = self.pipelines.timing(self.key, costs)
            steady = None
            if not self.plan.update_barrier and not self.plan.shared_devices:
                # Every device's tail and update priced as the slowest device's, after its own last backward.
                per_stage = sum(self.tails) / self.plan.vpp
                steady = self.pipelines.steady_s(self.key, costs.with_changes(update=per_stage))
            return self.assemble(timing.makespan, timing.bubble_ratio, timing.simulation, steady_s=steady)
        work = self.work
        # One pipeline device, always busy: the engine's speed-up at one busy device.
        busy = 1.0 if self.speedup is None else self.speedup[0]
        return self.assemble(self.plan.microbatches * (work[0].forward + work[0].backward) / busy, 0.0, None)

    def assemble(
        self, pipeline_time: float, bubble: float, simulation: Simulation | None, *, steady_s: float | None = None
    ) -> Estimate:
        """The :class:`Estimate` of a pipeline part of ``pipeline_time`` seconds with idle
        fraction ``bubble`` (of the pipeline devices): adds the data-parallel tail and the
        optimizer step. Pipeline devices that share their devices run every action back to
        back in one program: the devices never wait, whichever pipeline device is idle.
        ``steady_s``: where the plan's update has no barrier, seconds of a step in a long run,
        its tail and update included (the step's own drain overlapping the next warm-up),
        which is then the step's time instead of the three end to end."""
        shapes, work = self.shapes, self.work
        model, cluster, plan = shapes.model, shapes.cluster, shapes.plan
        if plan.shared_devices:
            bubble = 0.0
        tail, optimizer = self.tails
        # Every device waits for the slowest node at the step's synchronisation.
        units = straggler_units(plan.gpus, cluster)
        step = (pipeline_time + tail + optimizer if steady_s is None else steady_s) * straggler_factor(units, cluster)
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
            mfu=step_flops(model, plan, DEFAULT_FLOP_COUNT) / (plan.gpus * cluster.peak_flops * step),
            memory=self.memory,
            stage_forward_s=tuple(w.forward for w in work),
            stage_backward_s=tuple(w.backward for w in work),
            assumptions=assumptions(model, cluster, plan),
            simulation=simulation,
        )


def prepare(
    model: Model,
    cluster: Cluster,
    plan: Plan,
    *,
    pipelines: Pipelines | None = None,
    fits_first: bool = False,
    stage_layers: Sequence[int] | None = None,
    layout: Layout | None = None,
) -> Prepared:
    """Work out ``plan``'s costs and memory without simulating (see :class:`Prepared`).

    ``pipelines`` caches evaluated schedules and simulations across calls. ``stage_layers`` gives
    each of the pp × vpp stages its layers (default: the plan's, else an even split). With ``layout``, an order made
    later (a policy synthesised per plan): ``lower_bound_s`` from the work alone (the average
    device's) and the tails, and no activations.

    Raises:
      PlanError: the plan does not divide the model or does not match its schedule.
      DoesNotFit: with ``fits_first``, when the plan does not fit; if not even the average device's
        weights, gradients and optimizer state fit, before the schedule is evaluated.
      PipedslError: a schedule's own errors, such as a failed ``require``.
    """
    shapes = Shapes(model, cluster, plan)
    figures = _figures(shapes, stage_layers)
    layers, params, residual, weight_residual = (
        figures.layers,
        figures.params,
        figures.residual,
        figures.weight_residual,
    )
    # The fullest device holds at least the average share: a cheap test before the
    # schedule is evaluated.
    if fits_first and not figures.average.fits:
        raise DoesNotFit(plan, figures.average)
    if plan.pp > 1 and pipelines is None:
        pipelines = Pipelines()
    key, placement = _schedule_of(plan, pipelines, layout)
    device_params = _device_params(plan, placement, params)
    if plan.shared_devices:
        # One program that loops over the microbatches, each through every stage (the
        # executor's default for shared devices): one microbatch's activations of every stage.
        memory = device_memory(shapes, [sum(device_params)], [sum(residual)])
    else:
        held = _peak_residual(key, pipelines, residual, weight_residual) if layout is None else (0,) * plan.pp
        memory = device_memory(shapes, device_params, held)
    if fits_first and not memory.fits:
        raise DoesNotFit(plan, memory)
    work, speedup, serial = figures.work, figures.speedup, figures.serial
    tail = tails(shapes, work, placement, device_params, layers=layers, serial=serial)
    fastest = 1.0 if speedup is None else max(speedup)
    return Prepared(
        shapes=shapes,
        key=key,
        placement=placement,
        pipelines=pipelines,
        work=work,
        residual=residual,
        weight_residual=weight_residual,
        device_params=device_params,
        memory=memory,
        # An order made later (a policy's, synthesised per plan) is bounded by its work alone.
        lower_bound_s=(_average_busy(plan, work) if layout is not None else _lower_bound(shapes, work, key, pipelines))
        / fastest
        + sum(tail),
        tails=tail,
        speedup=speedup,
        serial=serial,
    )


def work_bound(model: Model, cluster: Cluster, plan: Plan) -> float:
    """Seconds a step of ``plan`` takes at least, from its work alone, before its schedule
    is evaluated: the pipeline devices' average busy time (every stage's forward and
    backward of every microbatch over the ``pp`` devices; one after another where they
    share their devices), at the fastest the shared cores allow, and the optimizer step of
    the average device (:func:`~pipedsl.simulator.data_parallel.least_optimizer_seconds`). No more than
    :func:`prepare`'s ``lower_bound_s`` for a schedule that states its order (the busiest
    device is busy at least the average; the tails add to it), so a search can leave a
    plan whose bound is past what it needs unevaluated.

    Raises PlanError as :func:`prepare` does when the plan does not divide the model, and
    DoesNotFit as it does with ``fits_first`` when not even the average device's weights,
    gradients and optimizer state fit.
    """
    figures = _figures(Shapes(model, cluster, plan), None)
    if not figures.average.fits:
        raise DoesNotFit(plan, figures.average)
    speedup = figures.speedup
    return _average_busy(plan, figures.work) / (1.0 if speedup is None else max(speedup)) + figures.least_optimizer_s


@dataclass(frozen=True, slots=True, eq=False)
class _Figures:
    """What a plan's stages hold and cost whatever its schedule, shape (S,) each: their
    layers, the parameters each GPU holds, the activation bytes kept per microbatch (F to
    B or I; I to W), their work per microbatch; the memory of a device holding the average
    share of the parameters (none of the activations), where the devices share cores (see
    :func:`_sharing`), and the least optimizer step (seconds)."""

    layers: tuple[int, ...]
    params: tuple[float, ...]
    residual: tuple[int, ...]
    weight_residual: tuple[int, ...]
    work: tuple[Work, ...]
    average: Memory
    speedup: tuple[float, ...] | None
    serial: bool
    least_optimizer_s: float


_FIGURES = 8192
"""Plans whose :class:`_Figures` are kept: a search asks for each plan's once per schedule
(and twice where it is costed), and plans that differ only in their schedule share them."""

_figures_kept: OrderedDict[tuple[object, ...], _Figures] = OrderedDict()
_BY_SCHEDULE = frozenset({"schedule", "schedule_params"})
_figure_fields = attrgetter(*(f.name for f in fields(Plan) if f.name not in _BY_SCHEDULE))
"""The fields of a Plan the figures follow from: all but the schedule's (no formula reads them)."""

_pairs: dict[tuple[Model, Cluster], int] = {}
_numbers = count()
_last_pair: list[Any] = [None, None, -1]
"""The number :func:`_pair_number` gave last, and to which model and cluster."""


def _pair_number(model: Model, cluster: Cluster) -> int:
    """A number for the pair (model, cluster), the same for equal pairs while it is kept:
    a search asks with the same two objects for every plan, and comparing them by identity
    spares hashing their every field each time. Numbers are never given twice."""
    if _last_pair[0] is model and _last_pair[1] is cluster:
        return int(_last_pair[2])
    if len(_pairs) >= _FIGURES:
        _pairs.clear()
    number = _pairs.setdefault((model, cluster), next(_numbers))
    _last_pair[:] = [model, cluster, number]
    return number


def _figures(shapes: Shapes, stage_layers: Sequence[int] | None) -> _Figures:
    """``shapes``' plan's :class:`_Figures` (the stages split as :func:`prepare`'s
    ``stage_layers`` says), worked out once per plan and kept for the plans that differ
    only in their schedule. Raises PlanError as :func:`prepare` does."""
    model, cluster, plan = shapes.model, shapes.cluster, shapes.plan
    given = None if stage_layers is None else tuple(stage_layers)
    # The framework's profile, not its name: the figures follow the profile the name has now.
    key = (_pair_number(model, cluster), given, framework(plan.framework), _figure_fields(plan))
    found = _figures_kept.get(key)
    if found is not None:
        _figures_kept.move_to_end(key)
        return found
    check_divides(model, cluster, plan)
    layers = split_layers(model, plan.pp * plan.vpp, plan.stage_layers if given is None else given)
    params = stage_params(model, plan, layers)
    residual = stage_residual(shapes, layers)
    speedup, serial = _sharing(shapes)
    found = _Figures(
        layers=layers,
        params=params,
        residual=residual,
        weight_residual=stage_weight_residual(shapes, layers, residual),
        work=stage_work(shapes, layers, params),
        # Pipeline devices that share their devices hold every stage there.
        average=device_memory(shapes, [sum(params) / (1 if plan.shared_devices else plan.pp)], (0,)),
        speedup=speedup,
        serial=serial,
        least_optimizer_s=least_optimizer_seconds(shapes, params),
    )
    _figures_kept[key] = found
    if len(_figures_kept) > _FIGURES:
        _figures_kept.popitem(last=False)
    return found


def _average_busy(plan: Plan, work: Sequence[Work]) -> float:
    """Seconds the average pipeline device computes in a step: every stage's forward and
    backward of every microbatch over the ``pp`` devices (over one where they share their
    devices and take turns). The busiest device, and so any order's forward/backward part,
    takes at least this."""
    busy = plan.microbatches * sum(w.forward + w.backward for w in work)
    return busy / (1 if plan.shared_devices else plan.pp)


def _sharing(shapes: Shapes) -> tuple[tuple[float, ...] | None, bool]:
    """Where the devices share a host's cores (``Cluster.host_cores``): how many times as
    fast as priced a pipeline device (a ``dp × cp × tp`` mesh of them) computes while n
    pipeline devices compute at once, at index n - 1, shape (pp,) (the cluster's
    :meth:`~pipedsl.simulator.hardware.Cluster.speedup` at n meshes' devices, at most a
    node's), and whether the pipeline devices take turns instead: meshes of several
    devices, whose programs XLA's CPU client runs one at a time (``serial`` in
    :class:`~pipedsl.simulator.costs.CostModel`). Pipeline devices that share their
    devices (``Plan.shared_devices``) take turns whatever the devices: one program runs
    their actions one after another, at the speed of one mesh busy. The one place that
    prices shared compute; (None, False) where devices have their own."""
    cluster, plan = shapes.cluster, shapes.plan
    if plan.shared_devices:
        mesh = min(plan.dp * plan.cp * plan.tp, cluster.gpus_per_node)
        return (cluster.speedup(mesh),) * plan.pp, True
    if cluster.host_cores is None:
        return None, False
    mesh = plan.dp * plan.cp * plan.tp
    speedup = tuple(cluster.speedup(min(mesh * n, cluster.gpus_per_node)) for n in range(1, plan.pp + 1))
    return speedup, mesh > 1


def _schedule_of(
    plan: Plan, pipelines: Pipelines | None, layout: Layout | None
) -> tuple[ScheduleKey | None, tuple[int, ...]]:
    """The plan's schedule key and stage-to-device placement; (None, (0,)) for SPMD."""
    if plan.pp == 1 or pipelines is None:
        return None, (0,)
    key = pipelines.key(plan)
    schedule = pipelines.layout(key) if layout is None else layout
    _check_schedule(plan, schedule)
    return key, schedule.placement


def _device_params(plan: Plan, placement: tuple[int, ...], params: tuple[float, ...]) -> tuple[float, ...]:
    """Parameters each pipeline device holds: the sum over the stages placed on it, shape (pp,)."""
    device_params = [0.0] * plan.pp
    for s, d in enumerate(placement):
        device_params[d] += params[s]
    return tuple(device_params)


def _peak_residual(
    key: ScheduleKey | None, pipelines: Pipelines | None, residual: tuple[int, ...], weight_residual: tuple[int, ...]
) -> tuple[int, ...]:
    """Each device's peak of kept activation bytes under the schedule (``residual`` from
    ``F`` to ``B`` or ``I``, ``weight_residual`` from ``I`` to ``W``); one microbatch's for SPMD."""
    if key is None or pipelines is None:
        return (residual[0],)
    return pipelines.peak_residual_bytes(key, residual, weight_residual)


def estimate(
    model: Model,
    cluster: Cluster,
    plan: Plan,
    *,
    pipelines: Pipelines | None = None,
    fits_first: bool = False,
    stage_layers: Sequence[int] | None = None,
) -> Estimate:
    """Estimate ``plan`` for ``model`` on ``cluster`` (see the module docstring).

    ``pipelines`` caches evaluated schedules and simulations across calls. With
    ``fits_first``, a plan that does not fit in memory raises :class:`DoesNotFit`
    before anything is simulated; otherwise it is estimated with ``fits`` False.

    Raises as :func:`prepare`.
    """
    prepared = prepare(model, cluster, plan, pipelines=pipelines, fits_first=fits_first, stage_layers=stage_layers)
    return prepared.finish()


def _lower_bound(shapes: Shapes, work: Sequence[Work], key: ScheduleKey | None, pipelines: Pipelines | None) -> float:
    """Seconds the forward/backward part takes at least (see :meth:`Pipelines.lower_bound_s`);
    for SPMD, exactly its microbatches × (F + B); for pipeline devices that share their
    devices, exactly every stage's, one action after another (a split backward's halves
    sum to its fused one; the executor's dispatch is left out, so the bound holds)."""
    plan = shapes.plan
    backward = _backward_seconds(work)
    if key is None or pipelines is None:
        return plan.microbatches * (work[0].forward + backward[0][0])
    if plan.shared_devices:
        return plan.microbatches * sum(w.forward + b for w, b in zip(work, backward[0], strict=True))
    return pipelines.lower_bound_s(key, np.array([[w.forward for w in work], *backward]))


_Seconds = tuple[float, ...]


def _backward_seconds(work: Sequence[Work]) -> tuple[_Seconds, _Seconds, _Seconds]:
    """Seconds of each stage's fused ``B``, and of its ``I`` and its ``W`` where a schedule
    splits the backward, shape (S,) each, as the executor runs them: ``I`` computes what
    the input's cotangent needs, which the first stage (token ids in) has none of, so there
    ``I`` is no work and ``W`` the fused backward's; elsewhere each half is its share of the
    work. Each task's dispatch is the simulation's (:attr:`Shapes.action_overhead_s`)."""
    fused = tuple(w.backward for w in work)

    def halves(s: int, w: Work) -> tuple[float, float]:
        if s == 0:
            return 0.0, fused[0]
        return w.input_grad, w.weight_grad

    input_grad, weight_grad = zip(*(halves(s, w) for s, w in enumerate(work)), strict=True)
    return fused, input_grad, weight_grad
