"""The plan search: every SPMD and pipeline plan for a model on N GPUs, ranked by step time.

SPMD plans (pp = 1) combine data and tensor parallelism with every ZeRO stage and
recomputation mode. Pipeline plans add a pipeline degree and a schedule from the library
(and any extra ``.sched`` files), with the virtual-stage counts a schedule takes. Each
plan goes through :func:`~pipedsl.simulator.estimate.estimate`; plans that do not fit in
memory, do not divide the model, or that a schedule's ``require`` rejects are dropped
and counted by reason. The rest are ranked by step time.

Cost: memory follows from the schedule's order alone, so a plan that does not fit is
dropped before it is simulated; so is a plan whose lower bound (its schedule's order
against each action's dependency chain) shows it cannot come within ``prune`` times its
schedule's best. Each (schedule, pp, vpp, microbatches) is evaluated once and lowered at
most once while it is needed (:class:`~pipedsl.simulator.plan.Pipelines`), and plans
that differ only in what the pipeline does not see (ZeRO 0 or 1) share one simulation.

Enumeration, for ``gpus`` GPUs and a global batch B:

- tensor-parallel degrees: powers of two up to the GPUs per node (tensor parallelism
  stays on NVLink) that divide the heads and the feed-forward width;
- pipeline degrees: divisors of ``gpus`` from 2 up, with ``pp × vpp`` dividing the layers;
- virtual stages: ``vpp_sizes`` (2, 3, 4, 6, 8) for schedules with a ``vpp``
  parameter (vpp = 1 is 1F1B's or GPipe's plan); what the schedule places otherwise;
- microbatch sizes: divisors of B/dp up to ``max_microbatch_size``;
- ZeRO: 0–3 for SPMD; 0 and 1 for pipelines (ZeRO 2 and 3 communicate every microbatch,
  which a pipeline of many microbatches multiplies);
- recomputation: none, selective, full (selective is left out with FlashAttention,
  where it is the same plan as none).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipedsl import library
from pipedsl.arrays import paused_collector
from pipedsl.errors import PipedslError, ScheduleEvalError, ScheduleInvalid
from pipedsl.simulator.estimate import DoesNotFit, Estimate, Prepared
from pipedsl.simulator.explain import Explanation
from pipedsl.simulator.hardware import Cluster, Model, load_cluster, load_model
from pipedsl.simulator.pipelines import Pipelines
from pipedsl.simulator.plan import Plan, PlanError, Recompute
from pipedsl.simulator.policy_plans import prepare_plan
from pipedsl.simulator.ranked import COLUMNS, RankedPlan, Summary, describe, summarize

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["search", "search_plans", "RankedPlan", "candidate_plans", "Summary", "summarize", "describe", "default_global_batch", "COLUMNS"]

DEFAULT_TOKENS_PER_STEP = 2**22
"""Tokens per step when no global batch is given: 4 Mi tokens (GPT-3 used 3.1 M)."""

Progress = Callable[[str, int, int], None]
"""Called with (phase, plans done, plans in the phase) as the search goes."""

DEFAULT_PRUNE = 1.25
"""Pipeline plans whose lower bound exceeds this factor times their schedule's best step
time are not simulated."""


def default_global_batch(model: Model) -> int:
    """Sequences per step for about 4 Mi tokens: ``2**22 // seq_len`` (at least 1)."""
    return max(DEFAULT_TOKENS_PER_STEP // model.seq_len, 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_sizes(model: Model, cluster: Cluster, gpus: int) -> list[int]:
    sizes = []
    t = 1
    while t <= min(cluster.gpus_per_node, gpus):
        if gpus % t == 0 and model.heads % t == 0 and model.ffn_hidden % t == 0:
            sizes.append(t)
        t *= 2
    return sizes


@dataclass(frozen=True, slots=True)
class _Schedule:
    """A schedule to try: how plans name it, and whether it takes a ``vpp`` parameter."""

    spec: str
    takes_vpp: bool


def _schedules(schedules: Sequence[str] | None, extra: Sequence[str | Path]) -> list[_Schedule]:
    """The schedules to try. Library schedules without ``pp`` and ``microbatches``
    parameters (fixed tables) are left out; a named one without them is an error."""
    named = [str(p) for p in extra] + ([] if schedules is None else list(schedules))
    shipped = [] if schedules is not None else [n for n in library.library_schedules() if n not in named]
    found = []
    for spec in dict.fromkeys(shipped + named):
        params = library.parameters(spec)
        if "pp" not in params or "microbatches" not in params:
            if spec in shipped:
                continue
            takes = ", ".join(params) or "no parameters"
            raise PlanError(f"schedule {spec}: the search sets pp and microbatches, but it takes {takes}")
        found.append(_Schedule(spec, "vpp" in params))
    return found


def candidate_plans(
    model: Model,
    cluster: Cluster,
    gpus: int,
    *,
    global_batch: int,
    schedules: Sequence[str] | None = None,
    extra_schedules: Sequence[str | Path] = (),
    max_microbatch_size: int = 16,
    vpp_sizes: Sequence[int] = (2, 3, 4, 6, 8),
    spmd_zero: Sequence[int] = (0, 1, 2, 3),
    pipeline_zero: Sequence[int] = (0, 1),
    recompute: Sequence[Recompute | str] = tuple(Recompute),
    flash_attention: bool = True,
    dp_overlap: float = 1.0,
    reduce_bytes: int = 4,
    skipped: Counter[tuple[str, int]] | None = None,
) -> Iterator[Plan]:
    """Every plan the search tries (see the module docstring), SPMD plans first.

    A schedule that takes no ``vpp`` is offered with ``vpp = 1``; the search asks the
    schedule itself how many stages it places per device (ZB-V places two). ``skipped``,
    when given, counts the combinations left out by (rule, the value that broke it).
    """
    skip: Counter[tuple[str, int]] = Counter() if skipped is None else skipped
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"search: gpus must be a whole number >= 1, got {gpus!r}")
    modes = [Recompute(r) for r in recompute]
    if flash_attention:
        # FlashAttention never stores the scores selective recomputation would drop, so
        # selective is the same plan as none.
        modes = [r for r in modes if r is not Recompute.SELECTIVE] or [Recompute.NONE]
    common: dict[str, Any] = {
        "global_batch": global_batch,
        "flash_attention": flash_attention,
        "dp_overlap": dp_overlap,
        "reduce_bytes": reduce_bytes,
    }
    space = _Space(tuple(_tp_sizes(model, cluster, gpus)), tuple(modes), global_batch, max_microbatch_size, skip)
    yield from _spmd_plans(space, gpus, spmd_zero, common)
    found = _schedules(schedules, extra_schedules)
    yield from _pipeline_plans(space, model, gpus, found, vpp_sizes, pipeline_zero, common)


@dataclass(frozen=True, slots=True)
class _Space:
    """What every part of the enumeration shares: the tensor-parallel sizes and
    recomputation modes to try, the batch and the largest microbatch, and the counter
    of combinations left out."""

    tps: tuple[int, ...]
    modes: tuple[Recompute, ...]
    global_batch: int
    max_microbatch_size: int
    skip: Counter[tuple[str, int]]

    def microbatch_sizes(self, dp: int) -> list[int]:
        """Microbatch sizes that split the batch evenly over ``dp`` replicas."""
        if self.global_batch % dp:
            self.skip[f"global batch {self.global_batch} is not a multiple of dp", dp] += 1
            return []
        return [b for b in _divisors(self.global_batch // dp) if b <= self.max_microbatch_size]


def _spmd_plans(space: _Space, gpus: int, spmd_zero: Sequence[int], common: dict[str, Any]) -> Iterator[Plan]:
    for tp in space.tps:
        dp = gpus // tp
        for b in space.microbatch_sizes(dp):
            for zero in spmd_zero:
                for mode in space.modes:
                    yield Plan(dp=dp, tp=tp, pp=1, microbatch_size=b, zero=zero, recompute=mode, **common)


def _pipeline_plans(
    space: _Space,
    model: Model,
    gpus: int,
    found: list[_Schedule],
    vpp_sizes: Sequence[int],
    pipeline_zero: Sequence[int],
    common: dict[str, Any],
) -> Iterator[Plan]:
    for pp in _divisors(gpus)[1:]:
        if pp > model.layers:
            space.skip[f"pp exceeds the {model.layers} layers", pp] += 1
            break
        for tp in space.tps:
            if gpus % (pp * tp):
                continue
            dp = gpus // (pp * tp)
            for b in space.microbatch_sizes(dp):
                for sched in found:
                    for vpp in vpp_sizes if sched.takes_vpp else (1,):
                        if model.layers % (pp * vpp):
                            space.skip[f"{model.layers} layers do not split over pp × vpp", pp * vpp] += 1
                            continue
                        for zero in pipeline_zero:
                            for mode in space.modes:
                                yield Plan(
                                    dp=dp, tp=tp, pp=pp, vpp=vpp, microbatch_size=b, zero=zero,
                                    recompute=mode, schedule=sched.spec, **common,
                                )  # fmt: skip


def _with_schedule_vpp(plan: Plan, pipelines: Pipelines) -> Plan:
    """For a schedule without a ``vpp`` parameter, the plan with the vpp it places."""
    if plan.schedule is None:
        return plan
    key = pipelines.key(plan)
    if key.vpp:
        return plan
    # The layout alone: a policy schedule's order is not synthesised for this.
    layout = pipelines.layout(key)
    vpp = layout.num_stages // layout.num_devices
    return plan if vpp == plan.vpp else replace(plan, vpp=vpp)


def _group(plan: Plan) -> tuple[str, int, int, int]:
    """Plans that run the same evaluated schedule sort next to each other."""
    return (plan.schedule or "", plan.pp, plan.vpp, plan.microbatches)


def search(
    model: Model | str | Path,
    cluster: Cluster | str | Path,
    gpus: int,
    *,
    global_batch: int | None = None,
    schedules: Sequence[str] | None = None,
    extra_schedules: Sequence[str | Path] = (),
    top: int | None = None,
    prune: float | None = DEFAULT_PRUNE,
    progress: Progress | None = None,
    **space: Any,
) -> pd.DataFrame:
    """Rank every plan for ``model`` on ``gpus`` GPUs of ``cluster`` by step time.

    Plans are costed first (no simulation). SPMD plans need nothing more. Pipeline plans
    are then simulated schedule by schedule, in order of their lower bound on the step
    time, until that schedule's best plan is certain; with ``prune``, the schedule's
    plans whose lower bound exceeds ``prune`` times its best are dropped unsimulated
    (they cannot come within that factor). Every row is exact, and so is every
    schedule's best. ``prune=None`` simulates every plan that fits.

    Args:
      model, cluster: descriptions, preset names or TOML paths.
      gpus: GPUs to use, all of them.
      global_batch: sequences per step; default :func:`default_global_batch`.
      schedules: library names or ``.sched`` paths to try; default the whole library.
      extra_schedules: more ``.sched`` files to try besides.
      top: keep only the best ``top`` rows.
      prune: the factor above (default :data:`DEFAULT_PRUNE`), or None.
      progress: called with (phase, done, total), phase ``"costing"`` then ``"simulating"``.
      **space: options of :func:`candidate_plans` (``max_microbatch_size``,
        ``vpp_sizes``, ``spmd_zero``, ``pipeline_zero``, ``recompute``,
        ``flash_attention``, ``dp_overlap``, ``reduce_bytes``).

    Returns a DataFrame with :data:`COLUMNS`, best first. ``attrs`` holds ``considered``
    (plans tried), ``dropped`` (a dict from reason to count), ``simulations`` (distinct
    pipeline simulations run), ``seconds`` (wall time), ``model``, ``cluster``,
    ``gpus``, ``global_batch`` and ``explanation`` (an
    :class:`~pipedsl.simulator.explain.Explanation` of what removed plans and why). :func:`search_plans` gives the same ranking as frozen
    :class:`RankedPlan` records.
    """
    import pandas as pd

    ranked, attrs = _search(
        model, cluster, gpus, global_batch=global_batch, schedules=schedules, extra_schedules=extra_schedules,
        prune=prune, progress=progress, **space,
    )  # fmt: skip
    frame = pd.DataFrame([p.row() for p in ranked], columns=list(COLUMNS))
    if not ranked:
        frame["rank"] = frame["rank"].astype("int64")
    if top is not None:
        frame = frame.head(top)
    frame.attrs.update(attrs)
    return frame


def search_plans(
    model: Model | str | Path,
    cluster: Cluster | str | Path,
    gpus: int,
    *,
    global_batch: int | None = None,
    schedules: Sequence[str] | None = None,
    extra_schedules: Sequence[str | Path] = (),
    top: int | None = None,
    prune: float | None = DEFAULT_PRUNE,
    progress: Progress | None = None,
    **space: Any,
) -> tuple[RankedPlan, ...]:
    """:func:`search`'s ranking, best first, as frozen :class:`RankedPlan` records
    (the same arguments; ``top`` keeps the best ``top``)."""
    ranked, _ = _search(
        model, cluster, gpus, global_batch=global_batch, schedules=schedules, extra_schedules=extra_schedules,
        prune=prune, progress=progress, **space,
    )  # fmt: skip
    return ranked if top is None else ranked[:top]


def _search(
    model: Model | str | Path,
    cluster: Cluster | str | Path,
    gpus: int,
    *,
    global_batch: int | None,
    schedules: Sequence[str] | None,
    extra_schedules: Sequence[str | Path],
    prune: float | None,
    progress: Progress | None,
    **space: Any,
) -> tuple[tuple[RankedPlan, ...], dict[str, Any]]:
    """The ranking and what :func:`search` puts in ``attrs``."""
    model = load_model(model)
    cluster = load_cluster(cluster)
    if prune is not None and not prune >= 1.0:
        raise PlanError(f"search: prune must be a factor >= 1 (or None to simulate everything), got {prune!r}")
    batch = default_global_batch(model) if global_batch is None else global_batch
    if type(batch) is not int or batch < 1:
        raise PlanError(f"search: global_batch must be a whole number >= 1, got {batch!r}")
    started = time.perf_counter()
    skipped: Counter[tuple[str, int]] = Counter()
    plans = list(
        candidate_plans(
            model, cluster, gpus, global_batch=batch, schedules=schedules, extra_schedules=extra_schedules,
            skipped=skipped, **space,
        )
    )  # fmt: skip
    # Plans are costed grouped by evaluated schedule, so few schedule objects need to be
    # held at once; every shape's lowered arrays are kept for the simulations.
    pipelines = Pipelines(keep_simulations=False, max_schedules=32)
    dropped: Counter[str] = Counter()
    with paused_collector():
        prepared = _cost(model, cluster, plans, pipelines, dropped, progress)
        # A stable sort: plans of equal step time keep the order they were finished in.
        finished = sorted(_simulate(prepared, prune, dropped, progress), key=lambda e: e.step_time_s)
    ranked = tuple(RankedPlan.of(rank, e) for rank, e in enumerate(finished, start=1))
    attrs = dict(
        considered=len(plans),
        dropped=dict(dropped),
        simulations=pipelines.num_simulations,
        seconds=time.perf_counter() - started,
        model=model.name,
        cluster=cluster.name,
        gpus=gpus,
        global_batch=batch,
        explanation=Explanation.of(
            considered=len(plans),
            ranked=len(ranked),
            skipped=skipped,
            dropped=dropped,
            schedules=[_schedule_label(s.spec) for s in _schedules(schedules, extra_schedules)],
            ranked_schedules=sorted({_schedule_label(e.plan.schedule) for e in finished if e.plan.schedule}),
        ),
    )
    return ranked, attrs


def _schedule_label(spec: str) -> str:
    return Path(spec).name.removesuffix(".sched")


def _cost(
    model: Model, cluster: Cluster, plans: list[Plan], pipelines: Pipelines, dropped: Counter[str], progress: Progress | None
) -> list[Prepared]:
    """Cost every plan without simulating; count the dropped ones by reason."""
    prepared: list[Prepared] = []
    for done, plan in enumerate(sorted(plans, key=_group), start=1):
        try:
            plan = _with_schedule_vpp(plan, pipelines)
            # Policy schedules come back once per in-flight limit that fits (policy_plans).
            prepared.extend(prepare_plan(model, cluster, plan, pipelines=pipelines))
        except PipedslError as err:
            dropped[_reason(err)] += 1
        if progress is not None:
            progress("costing", done, len(plans))
    return prepared


def _reason(err: PipedslError) -> str:
    """Why a plan was dropped, as counted in ``attrs["dropped"]``."""
    if isinstance(err, DoesNotFit):
        return "does not fit in memory"
    if isinstance(err, ScheduleEvalError):
        return "rejected by the schedule (require)"
    if isinstance(err, ScheduleInvalid):
        return "invalid schedule"
    if isinstance(err, PlanError):
        return "does not divide the model"
    return "schedule failed to load"


def _simulate(
    prepared: list[Prepared], prune: float | None, dropped: Counter[str], progress: Progress | None
) -> list[Estimate]:
    """Finish the prepared plans. SPMD plans cost nothing more and are all finished.
    Pipeline plans go schedule by schedule: best-first by lower bound until that
    schedule's best step time is settled (no lower bound left below it), then the rest
    within ``prune`` times it, grouped by evaluated schedule so that each is lowered
    once. So every schedule's best plan is exact, however far behind the others."""
    results = [p.finish() for p in prepared if p.key is None]
    by_schedule: dict[str, list[Prepared]] = {}
    for p in prepared:
        if p.key is not None:
            by_schedule.setdefault(p.key.spec, []).append(p)
    total = len(prepared)
    done = len(results)
    for plans in by_schedule.values():
        order = sorted(plans, key=lambda p: p.lower_bound_s)
        best = float("inf")
        settled = 0
        while settled < len(order) and order[settled].lower_bound_s <= best:
            results.append(order[settled].finish())
            best = min(best, results[-1].step_time_s)
            settled += 1
        rest = order[settled:]
        if prune is not None:
            kept = [p for p in rest if p.lower_bound_s <= prune * best]
            if len(kept) < len(rest):
                dropped[f"over {prune:g}x its schedule's best step time (lower bound)"] += len(rest) - len(kept)
            rest = kept
        rest.sort(key=lambda p: _group(p.plan))
        for item in rest:
            results.append(item.finish())
        done += len(plans)
        if progress is not None:
            progress("simulating", done, total)
    return results
