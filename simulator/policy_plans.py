"""Policy schedules in the plan search, at the in-flight limits the plan's memory allows.

A policy schedule with a ``max_inflight`` parameter (``zb_auto``, ``zbv_auto``) is a
family of orders: the more microbatches a device may hold, the less of the pipeline is
idle, and the more activation memory it needs. The search should not try it only at its
default limit, which may not fit (and then drops the plan) or may leave memory unused.
:func:`prepare_plan` instead tries, for each candidate plan, a few limits that fit:

- the largest: the device memory left after weights, gradients, optimizer state and
  working memory (:func:`~pipedsl.simulator.memory.device_memory`), over the bytes the
  most expensive (stage, microbatch) pair on the device keeps, on the device where that
  is least; never more than the pairs a device can hold at all (its stages × M);
- the schedule's default limit, and ``2pp - 1`` (ZB-H2's) where that is above the
  default, each where it is below the largest.

Each limit is synthesised against the plan's own cost model (per-stage F, I, W and the
links' transfer times, :meth:`~pipedsl.simulator.estimate.Prepared.cost_model`), lowered,
and its memory taken from the order itself (the exact peak of residual bytes held), so a
limit whose order does not fit after all is dropped. Each surviving limit is one
:class:`LimitedPlan`, ranked by the search like any other plan; its estimate records the
limit (``inflight_limit``). Costing a plan synthesises nothing: its limits are chosen
from the policy's placement and the plan's memory (:func:`~pipedsl.simulator.estimate.prepare`
given the policy as its ``layout``), and only a limit the search finishes is synthesised.
Syntheses are cached by (schedule, shape, limit, cost model): plans that differ only in
what the pipeline does not see (ZeRO 0 or 1, the data parallel degree at one microbatch
count) share one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from pipedsl import library
from pipedsl.analysis import peak_held
from pipedsl.policy import Policy
from pipedsl.program import ProgramArrays
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.engine import step_timing
from pipedsl.simulator.estimate import DoesNotFit, Estimate, Prepared, prepare
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.memory import device_memory, static_memory, transient_bytes
from pipedsl.simulator.pipelines import Pipelines, states_policy, synthesized_arrays, synthesized_program
from pipedsl.simulator.plan import Plan

__all__ = [
    "LIMIT",
    "LimitedPlan",
    "takes_limit",
    "fitting_limit",
    "candidate_limits",
    "prepare_plan",
    "synthesized_program",
]

LIMIT = "max_inflight"
"""The parameter a policy schedule takes for its per-device in-flight limit."""

_CACHE_SIZE = 4096
"""Syntheses kept (each a few int arrays of one schedule's actions)."""

_Synthesis = tuple[ProgramArrays, np.ndarray, tuple[int, ...]]
_cache: OrderedDict[tuple[object, ...], _Synthesis] = OrderedDict()
_policies: OrderedDict[tuple[str, tuple[tuple[str, int], ...]], Policy] = OrderedDict()


def takes_limit(spec: str | None) -> bool:
    """Whether ``spec`` is a policy schedule (a ``policy`` block) with a ``max_inflight``
    parameter, which :func:`prepare_plan` tries at the limits memory allows."""
    return spec is not None and LIMIT in library.parameters(spec) and states_policy(spec)


def _loaded(spec: str, params: tuple[tuple[str, int], ...]) -> Policy:
    """``spec`` evaluated under ``params``, as the Policy :func:`takes_limit` promised;
    cached, since a search asks again for every plan of one shape."""
    key = (spec, params)
    found = _policies.get(key)
    if found is None:
        loaded = library.load(spec, **dict(params))
        assert isinstance(loaded, Policy)
        _policies[key] = found = loaded
        if len(_policies) > _CACHE_SIZE:
            _policies.popitem(last=False)
    return found


@dataclass(frozen=True, slots=True, eq=False)
class LimitedPlan(Prepared):
    """A prepared plan whose policy schedule runs at in-flight limit ``limit``.

    Its order is synthesised when the plan is finished (a plan the search prunes costs no
    synthesis), against :attr:`costs`, the plan's cost model. Until then ``memory`` is the
    bound the limit was chosen by (every device holding ``limit`` of its most expensive
    pairs) and ``lower_bound_s`` a bound that holds for any order (:func:`_any_order_bound`);
    the :class:`Estimate` has the order's exact memory.
    """

    limit: int
    params: tuple[tuple[str, int], ...]

    @property
    def costs(self) -> CostModel:
        """The plan's cost model (:meth:`~pipedsl.simulator.estimate.Prepared.cost_model`),
        made when asked: most prepared plans are pruned before it is needed."""
        return self.cost_model()

    def finish(self) -> Estimate:
        assert self.plan.schedule is not None and self.key is not None and self.pipelines is not None
        costs = self.costs
        arrays, order, activations = _synthesis(
            self.plan.schedule, self.params, self.limit, costs, self.residual, self.weight_residual
        )
        makespan, bubble = step_timing(arrays, costs.resolve(self.pipelines.policy(self.key)), order=order)
        memory = device_memory(self.shapes, self.device_params, activations)
        estimate = self.assemble(makespan, bubble, None)
        return replace(estimate, memory=memory, inflight_limit=self.limit, synthesis_costs=costs)


def fitting_limit(base: Prepared) -> int:
    """The largest in-flight limit whose activations fit every device of ``base``'s
    plan: per device, the bytes left after its static memory and working memory over
    the most any of its (stage, microbatch) pairs keeps, capped at the pairs it can hold
    (its stages × M); the least over the devices. 0 when not even that fits."""
    shapes, plan = base.shapes, base.plan
    transient = transient_bytes(shapes)
    usable = shapes.cluster.usable_bytes
    limit = None
    for params, stages in zip(base.device_params, _stages_by_device(base), strict=True):
        left = usable - sum(static_memory(plan, params, shapes.model.stored_bytes)) - transient
        pair = max(max(base.residual[s], base.weight_residual[s]) for s in stages)
        pairs = len(stages) * plan.microbatches
        here = pairs if pair <= 0 else min(pairs, int(max(left, 0) // pair))
        limit = here if limit is None else min(limit, here)
    return 0 if limit is None else limit


def candidate_limits(default: int, pp: int, least: int, most: int) -> tuple[int, ...]:
    """The limits to try, increasing: ``most`` (the largest that fits) and, below it, the
    schedule's ``default`` and ``2pp - 1`` (ZB-H2's) when that is above the default; none
    under ``least`` (the stages on a device: fewer holds no microbatch on all of them).
    Empty when ``most < least``."""
    if most < least:
        return ()
    wanted = {most, default} | ({2 * pp - 1} if 2 * pp - 1 > default else set())
    return tuple(sorted(v for v in wanted if least <= v <= most))


def prepare_plan(model: Model, cluster: Cluster, plan: Plan, *, pipelines: Pipelines) -> list[Prepared]:
    """``plan`` prepared for the search: one :class:`LimitedPlan` per fitting limit
    (:func:`candidate_limits`) for a policy schedule with a ``max_inflight`` parameter, or
    only the limit the plan sets (``Plan.schedule_params``); otherwise ``[prepare(..., fits_first=True)]``.

    Raises what :func:`~pipedsl.simulator.estimate.prepare` raises; DoesNotFit when no
    limit's order fits.
    """
    spec = plan.schedule
    # As takes_limit, from what the shared Pipelines has read once.
    if spec is None or LIMIT not in pipelines.parameters(spec) or not pipelines.is_policy(spec):
        return [prepare(model, cluster, plan, pipelines=pipelines, fits_first=True)]
    key = pipelines.key(plan)
    # A limit the plan sets (-p max_inflight=N) is the only one tried; its other parameters pass on.
    fixed = dict(key.params).get(LIMIT)
    own = tuple(pair for pair in key.params if pair[0] != LIMIT)
    params = (("pp", plan.pp), ("microbatches", plan.microbatches), *((("vpp", plan.vpp),) if key.vpp else ()), *own)
    default = pipelines.policy(key)
    # Each limit's order is synthesised when its plan is finished: none at the default cost model.
    base = prepare(model, cluster, plan, pipelines=pipelines, layout=default)
    least = max(len(default.stages_on(d)) for d in range(default.num_devices))
    if fixed is not None:
        # A limit no order can keep is the policy's own error (rule unsatisfiable-policy).
        default.check()
        limits: tuple[int, ...] = (fixed,)
    else:
        limits = candidate_limits(max(default.max_inflight or (least,)), plan.pp, least, fitting_limit(base))
    found: list[Prepared] = []
    for limit in limits:
        held = _held_at_most(base, limit)
        memory = device_memory(base.shapes, base.device_params, held)
        if memory.fits:
            found.append(
                LimitedPlan(
                    **{name: getattr(base, name) for name in _PREPARED_FIELDS},
                    memory=memory,
                    lower_bound_s=_any_order_bound(base, default.split_backward, limit),
                    limit=limit,
                    params=params,
                )
            )
    if not found:
        raise DoesNotFit(plan, device_memory(base.shapes, base.device_params, _held_at_most(base, least)))
    return found


def _held_at_most(base: Prepared, limit: int) -> list[int]:
    """Per device, the most activation bytes an order within ``limit`` can hold: that
    many of its most expensive (stage, microbatch) pairs."""
    return [
        limit * max(max(base.residual[s], base.weight_residual[s]) for s in stages)
        for stages in _stages_by_device(base)
    ]


def _stages_by_device(base: Prepared) -> list[list[int]]:
    """The stages of each device of ``base``'s plan, increasing, shape (D, its stages)."""
    stages: list[list[int]] = [[] for _ in base.device_params]
    for s, owner in enumerate(base.placement):
        stages[owner].append(s)
    return stages


def _any_order_bound(base: Prepared, split: bool, limit: int) -> float:
    """Seconds any order of ``base``'s plan within in-flight ``limit`` takes at least,
    with free transfers: per device, none of its work starts before microbatch 0 has passed
    the stages before its first (their forwards), and then it needs both its own work and,
    holding at most ``limit`` (stage, microbatch) pairs at once, M times the shortest time
    a microbatch holds its pairs over ``limit``. A microbatch admitted at the device's first
    stage holds a pair for each of the device's stages (the synthesiser reserves them all
    as it admits it) from that first F through every later F and the backwards down to
    the stage's own, to its W (or B) ending. The most over the devices, at the fastest the
    devices compute where they share cores (``base.speedup``), plus ``base``'s tails (its
    data-parallel tail and optimizer step, seconds)."""
    work, m = base.work, base.plan.microbatches
    # Per stage, once for every device: its forward, its backward (I when split) and all its work.
    forward = [w.forward for w in work]
    back = [w.input_grad if split else w.backward for w in work]
    whole = [w.forward + (w.input_grad + w.weight_grad if split else w.backward) for w in work]
    seconds = []
    for own in _stages_by_device(base):
        first = own[0]
        busy = m * sum(whole[s] for s in own)
        ahead = sum(forward[first:])
        held = sum(ahead + sum(back[s:]) + (work[s].weight_grad if split else 0.0) for s in own)
        seconds.append(sum(forward[:first]) + max(busy, m * held / limit))
    fastest = 1.0 if base.speedup is None else max(base.speedup)
    total = max(seconds) / fastest + sum(base.tails)
    # The bound can be tight, and the same seconds summed in another order can land a
    # rounding step above the simulated time: keep it below by a hair.
    return total * (1.0 - 1e-9)


_PREPARED_FIELDS = (
    "shapes", "key", "placement", "pipelines", "work", "residual", "weight_residual", "device_params", "tails",
    "speedup", "serial",
)  # fmt: skip
"""What a :class:`LimitedPlan` keeps of the plan prepared at the default limit."""


def _synthesis(
    spec: str,
    params: tuple[tuple[str, int], ...],
    limit: int,
    costs: CostModel,
    residual: tuple[int, ...],
    weight_residual: tuple[int, ...],
) -> _Synthesis:
    """The lowered order of ``spec`` at in-flight ``limit`` synthesised against ``costs``,
    the order its computes can be timed in (:func:`~pipedsl.simulator.pipelines.synthesized_arrays`) and its peak residual
    bytes per device, shape (D,); cached."""
    key = (spec, params, limit, costs)
    found = _cache.get(key)
    if found is not None:
        _cache.move_to_end(key)
        return found
    policy = _loaded(spec, (*params, (LIMIT, limit)))
    arrays, order = synthesized_arrays(policy, costs)
    held = tuple(int(p) for p in peak_held(arrays.actions, residual, weight_residual))
    _cache[key] = found = (arrays, order, held)
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return found
