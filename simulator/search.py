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
What the shapes cost is counted from the plans before any is evaluated, and a search past
:mod:`~pipedsl.simulator.search_work`'s bound is refused with a PlanError saying so.

The plans tried are :func:`~pipedsl.simulator.candidates.candidate_plans`. The SPMD
plans and each schedule's plans are ranked apart (a pipeline plan is pruned only against
its own schedule's best; on a shortlist, also against the SPMD plans', ranked first), in
worker processes for a large search (:mod:`~pipedsl.simulator.workers`), with the same
ranking, and the same plans bounded, either way.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipedsl import library
from pipedsl.arrays import paused_collector
from pipedsl.errors import PipedslError, RequirementFailed, ScheduleEvalError, ScheduleInvalid
from pipedsl.ir import Schedule
from pipedsl.simulator.candidates import candidate_plans, default_global_batch, searched_schedules
from pipedsl.simulator.estimate import DoesNotFit, Estimate, Prepared, work_bound
from pipedsl.simulator.explain import Explanation
from pipedsl.simulator.hardware import Cluster, Model, load_cluster, load_model
from pipedsl.simulator.pipelines import Pipelines
from pipedsl.simulator.plan import Plan, PlanError, schedule_name
from pipedsl.simulator.policy_plans import prepare_plan, takes_limit
from pipedsl.simulator.ranked import COLUMNS, RankedPlan, Summary, describe, plan_columns, summarize
from pipedsl.simulator.search_work import SearchWork, stages_per_device
from pipedsl.simulator.workers import Advance, available_cores, run_in_workers
from pipedsl.validate import validate

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "search",
    "search_plans",
    "search_ranking",
    "Ranking",
    "RankedPlan",
    "candidate_plans",
    "Summary",
    "summarize",
    "describe",
    "default_global_batch",
    "COLUMNS",
    "DEFAULT_PRUNE",
    "PARALLEL_FROM",
    "BOUNDED_COLUMNS",
    "Bounded",
]

BOUNDED_COLUMNS = (
    *COLUMNS[1:16], "sequence_parallel", "flash_attention", "reduce_bytes", "shared_devices", "memory_bytes_per_gpu",
    "step_time_bound_s",
)  # fmt: skip
"""The columns of ``attrs["bounded"]``: a plan's own (:func:`~pipedsl.simulator.ranked.plan_columns`),
the memory of its fullest device and its lower bound on the step time."""

Progress = Callable[[str, int, int], None]
"""Called with (phase, plans done, plans in all) as the search goes: phase ``"costing"``
and ``"simulating"``."""

DEFAULT_PRUNE = 1.25
"""Pipeline plans whose lower bound exceeds this factor times their schedule's best step
time are not simulated."""


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
    shortlist: int | None = None,
    prune: float | None = DEFAULT_PRUNE,
    progress: Progress | None = None,
    jobs: int | None = None,
    **space: Any,
) -> pd.DataFrame:
    """Rank every plan for ``model`` on ``gpus`` GPUs of ``cluster`` by step time.

    Plans are costed first (no simulation). SPMD plans need nothing more. Pipeline plans
    are then simulated schedule by schedule, in order of their lower bound on the step
    time, until that schedule's best plan is certain; with ``prune``, the schedule's
    plans whose lower bound exceeds ``prune`` times its best are dropped unsimulated
    (they cannot come within that factor). Every row is exact, and so is every
    schedule's best. ``prune=None`` simulates every plan that fits.

    With ``shortlist`` K, only the best K plans overall and each schedule's best (and the
    best SPMD plan) are ranked: the same rows, in the same order, as the whole ranking
    has there, at a fraction of the simulations. Past its best, a schedule's plans are
    then finished only while their lower bound is below both its own K-th best step time
    and the K-th best SPMD plan's (ranked first). ``top`` implies it.

    Args:
      model, cluster: descriptions, preset names or TOML paths.
      gpus: GPUs to use, all of them.
      global_batch: sequences per step; default :func:`default_global_batch`.
      schedules: library names or ``.sched`` paths to try; default the whole library.
      extra_schedules: more ``.sched`` files to try besides.
      top: keep only the best ``top`` rows (and rank no more than they need).
      shortlist: rank only the best this many plans and each schedule's best; None,
        every plan within ``prune``.
      prune: the factor above (default :data:`DEFAULT_PRUNE`), or None.
      progress: called with (phase, plans done, plans in all), phase ``"costing"`` and
        ``"simulating"`` (a schedule's plans count as simulated once it is ranked).
      jobs: processes ranking schedules at once, the same ranking for any number; by
        default one per core from :data:`PARALLEL_FROM` pipeline plans, else 1 (this one).
      **space: options of :func:`candidate_plans` (``max_microbatch_size``,
        ``vpp_sizes``, ``spmd_zero``, ``pipeline_zero``, ``recompute``, ``spmd_recompute``,
        ``flash_attention``, ``dp_overlap``, ``tp_overlap``, ``reduce_bytes``).

    Returns a DataFrame with :data:`COLUMNS`, best first. ``attrs`` holds ``considered``
    (plans tried), ``dropped`` (a dict from reason to count), ``simulations`` (distinct
    pipeline simulations run), ``seconds`` (wall time), ``processes`` (that ranked the
    plans, this one included when 1), ``model``, ``cluster``,
    ``gpus``, ``devices_word`` (``GPUs`` or ``chips``), ``assumptions`` (the best plan's, as
    (name, value, meaning) triples), ``global_batch`` and ``explanation`` (an
    :class:`~pipedsl.simulator.explain.Explanation` of what removed plans and why). :func:`search_plans` gives the same ranking as frozen
    :class:`RankedPlan` records.

    Raises PlanError before any work when the plans' schedules come to more (stage,
    microbatch) pairs than :mod:`~pipedsl.simulator.search_work` bounds (a very large
    global batch over few replicas), and when memory runs out under a tighter cap.
    """
    import pandas as pd

    ranking = search_ranking(
        model, cluster, gpus, global_batch=global_batch, schedules=schedules, extra_schedules=extra_schedules,
        top=top, shortlist=shortlist, prune=prune, progress=progress, jobs=jobs, **space,
    )  # fmt: skip
    frame = pd.DataFrame([p.row() for p in ranking.plans], columns=list(COLUMNS))
    if not ranking.plans:
        frame["rank"] = frame["rank"].astype("int64")
    frame.attrs.update(ranking.attrs)
    frame.attrs["bounded"] = pd.DataFrame([b.row() for b in ranking.bounded], columns=[*BOUNDED_COLUMNS])
    return frame


@dataclass(frozen=True, slots=True)
class Ranking:
    """What :func:`search` finds, without a table (for a caller that does not import
    pandas): the ranked plans, best first; the plans not ranked, by increasing bound
    (``attrs["bounded"]``'s rows); and what :func:`search` puts in ``attrs`` besides."""

    plans: tuple[RankedPlan, ...]
    bounded: tuple[Bounded, ...]
    attrs: dict[str, Any]


def search_ranking(
    model: Model | str | Path,
    cluster: Cluster | str | Path,
    gpus: int,
    *,
    global_batch: int | None = None,
    schedules: Sequence[str] | None = None,
    extra_schedules: Sequence[str | Path] = (),
    top: int | None = None,
    shortlist: int | None = None,
    prune: float | None = DEFAULT_PRUNE,
    progress: Progress | None = None,
    jobs: int | None = None,
    **space: Any,
) -> Ranking:
    """:func:`search`'s rows, its ``attrs`` and its not-ranked plans as a :class:`Ranking`
    (the same arguments; ``top`` keeps the best ``top`` rows)."""
    ranked, attrs = _search(
        model, cluster, gpus, global_batch=global_batch, schedules=schedules, extra_schedules=extra_schedules,
        keep=_keep(top, shortlist), prune=prune, progress=progress, jobs=jobs, **space,
    )  # fmt: skip
    bounded = tuple(attrs.pop("bounded"))
    return Ranking(ranked if top is None else ranked[:top], bounded, attrs)


def search_plans(
    model: Model | str | Path,
    cluster: Cluster | str | Path,
    gpus: int,
    *,
    global_batch: int | None = None,
    schedules: Sequence[str] | None = None,
    extra_schedules: Sequence[str | Path] = (),
    top: int | None = None,
    shortlist: int | None = None,
    prune: float | None = DEFAULT_PRUNE,
    progress: Progress | None = None,
    jobs: int | None = None,
    **space: Any,
) -> tuple[RankedPlan, ...]:
    """:func:`search`'s ranking, best first, as frozen :class:`RankedPlan` records
    (the same arguments; ``top`` keeps the best ``top``)."""
    return search_ranking(
        model, cluster, gpus, global_batch=global_batch, schedules=schedules, extra_schedules=extra_schedules,
        top=top, shortlist=shortlist, prune=prune, progress=progress, jobs=jobs, **space,
    ).plans  # fmt: skip


def _keep(top: int | None, shortlist: int | None) -> int | None:
    """The shortlist :func:`search` ranks for its ``top`` and ``shortlist``: the best
    ``top`` rows are on a shortlist of ``top``."""
    for name, value in (("top", top), ("shortlist", shortlist)):
        if value is not None and (type(value) is not int or value < 1):
            raise PlanError(f"search: {name} must be a whole number >= 1 (or None for every plan), got {value!r}")
    given = [v for v in (top, shortlist) if v is not None]
    return min(given) if given else None


def _search(
    model: Model | str | Path,
    cluster: Cluster | str | Path,
    gpus: int,
    *,
    global_batch: int | None,
    schedules: Sequence[str] | None,
    extra_schedules: Sequence[str | Path],
    keep: int | None,
    prune: float | None,
    progress: Progress | None,
    jobs: int | None,
    **space: Any,
) -> tuple[tuple[RankedPlan, ...], dict[str, Any]]:
    """The ranking and what :func:`search` puts in ``attrs``."""
    model = load_model(model)
    cluster = load_cluster(cluster)
    if prune is not None and not prune >= 1.0:
        raise PlanError(f"search: prune must be a factor >= 1 (or None to simulate everything), got {prune!r}")
    if jobs is not None and (type(jobs) is not int or jobs < 1):
        raise PlanError(f"search: jobs must be a whole number >= 1 (or None for one per core), got {jobs!r}")
    batch = default_global_batch(model) if global_batch is None else global_batch
    if type(batch) is not int or batch < 1:
        raise PlanError(f"search: global_batch must be a whole number >= 1, got {batch!r}")
    started = time.perf_counter()
    skipped: Counter[tuple[str, int]] = Counter()
    with paused_collector():  # thousands of plans, none in a cycle
        plans = list(
            candidate_plans(
                model, cluster, gpus, global_batch=batch, schedules=schedules, extra_schedules=extra_schedules,
                skipped=skipped, **space,
            )
        )  # fmt: skip
    work = SearchWork.of(plans)
    work.check(what=f"the plans of {model.name} on {gpus:,} GPUs at a global batch of {batch:,}")
    done = _Tally(len(plans), progress)
    split = _parts(plans)
    processes = _processes(jobs, split)
    try:
        parts = _rank_parts(model, cluster, split, keep, prune, processes=processes, advance=done.advance)
    except MemoryError:
        # Within the bound a search holds about 1.5 GB a process: a cap below that.
        raise PlanError(
            f"search: out of memory ranking {len(plans):,} plans of {work.total:,} (stage, microbatch) pairs;"
            " a smaller global batch, or fewer schedules, needs less"
        ) from None
    # A stable sort: plans of equal step time keep the order they were finished in.
    finished = sorted(chain.from_iterable(part.finished for part in parts), key=lambda e: e.step_time_s)
    dropped: Counter[str] = sum((part.dropped for part in parts), Counter())
    bounded = [b for part in parts for b in part.bounded]
    if keep is not None:
        finished = _shortlisted(finished, keep, dropped, bounded)
    ranked = tuple(RankedPlan.of(rank, e) for rank, e in enumerate(finished, start=1))
    attrs = dict(
        considered=len(plans),
        dropped=dict(dropped),
        simulations=sum(part.simulations for part in parts),
        seconds=time.perf_counter() - started,
        processes=processes,
        model=model.name,
        cluster=cluster.name,
        gpus=gpus,
        devices_word=cluster.devices_word,
        assumptions=[(a.name, a.value, a.meaning) for a in finished[0].assumptions] if finished else [],
        global_batch=batch,
        bounded=sorted(bounded, key=lambda b: b.step_time_bound_s),
        explanation=Explanation.of(
            considered=len(plans),
            ranked=len(ranked),
            skipped=skipped,
            dropped=dropped,
            schedules=[schedule_name(s.spec) for s in searched_schedules(schedules, extra_schedules)],
            ranked_schedules=sorted({schedule_name(e.plan.schedule) for e in finished if e.plan.schedule}),
        ),
    )
    return ranked, attrs


PARALLEL_FROM = 4000
"""Pipeline plans from which a search ranks its schedules in worker processes by default.
Below it, starting the workers as fresh interpreters (about a third of a second each on a
2-core machine; a forked worker, :mod:`~pipedsl.simulator.workers`, starts at once) costs
about what they save: there, ``demo-small`` on 16 GPUs (2,144 plans) took 1.0 s
in two processes against 0.7 s in one, ``llama-8b`` on 64 H100s (4,612) 2.9 s against
3.8 s, GPT-3 175B on 1024 A100s (8,680) 4.8 s against 8.1 s."""


class _Tally:
    """Plans done per phase, reported to the caller's :data:`Progress` as they add up."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total = total
        self.progress = progress
        self.done: Counter[str] = Counter()

    def advance(self, phase: str, plans: int) -> None:
        self.done[phase] += plans
        if self.progress is not None:
            self.progress(phase, self.done[phase], self.total)


@dataclass(frozen=True, slots=True)
class Bounded:
    """A plan not ranked: its lower bound on the step time, seconds (the step time itself
    for a plan simulated and left off a shortlist), and the bytes its fullest device holds
    (it fits), or None for a plan left uncosted (its bound from the work alone)."""

    plan: Plan
    step_time_bound_s: float
    memory_bytes: int | None

    def row(self) -> dict[str, Any]:
        """The :data:`BOUNDED_COLUMNS` as a dict (a row of ``attrs["bounded"]``)."""
        return {
            **plan_columns(self.plan), "memory_bytes_per_gpu": self.memory_bytes,
            "step_time_bound_s": self.step_time_bound_s,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class _Part:
    """One part of the search ranked: its plans finished, in the order they were
    finished; the plans dropped, by reason; the distinct simulations run."""

    finished: tuple[Estimate, ...]
    dropped: Counter[str]
    simulations: int
    bounded: tuple[Bounded, ...]


def _parts(plans: list[Plan]) -> list[list[Plan]]:
    """``plans`` in the order they are costed (grouped by evaluated schedule, see
    :func:`_group`), cut into the SPMD plans and each schedule's: parts that rank
    independently, since a pipeline plan is pruned only against its own schedule's best.
    Ranking the parts in this order and putting their plans together gives the order
    ranking them all at once would have."""
    parts: dict[str, list[Plan]] = {}
    for plan in sorted(plans, key=_group):
        parts.setdefault(plan.schedule or "", []).append(plan)
    return list(parts.values())


def _processes(jobs: int | None, parts: list[list[Plan]]) -> int:
    """The processes that rank ``parts`` for :func:`search`'s ``jobs``: never more than
    the parts."""
    if jobs is None:
        pipeline_plans = sum(len(part) for part in parts if part[0].schedule is not None)
        jobs = available_cores() if pipeline_plans >= PARALLEL_FROM else 1
    return max(min(jobs, len(parts)), 1)


def _rank_parts(
    model: Model,
    cluster: Cluster,
    parts: list[list[Plan]],
    keep: int | None,
    prune: float | None,
    *,
    processes: int,
    advance: Advance,
) -> list[_Part]:
    """Every part ranked (:func:`_rank_part`), in this process (``processes`` 1) or in
    that many processes (worker processes and a thread of this one); the same parts
    whichever, in the order given. The SPMD plans are ranked first, here (they need no
    schedule: a few milliseconds); with a shortlist of ``keep``, each schedule's part is
    then given their ``keep``-th best step time (:func:`_beyond`), the same however many
    processes rank them and whichever finishes first, so that what is ranked and what is
    bounded (``attrs["bounded"]``) are the same too."""
    spmd = [i for i in range(len(parts)) if parts[i][0].schedule is None]
    ranked = {i: _rank_part(model, cluster, parts[i], keep, prune, float("inf"), advance=advance) for i in spmd}
    beyond = _beyond(list(ranked.values()), keep)
    pipelines = [i for i in range(len(parts)) if i not in ranked]
    limited = {i: takes_limit(parts[i][0].schedule) for i in pipelines}
    # The longest first, so that no worker is left with one at the end; a policy schedule
    # with an in-flight limit is synthesised for each plan it finishes.
    others = sorted((i for i in pipelines if not limited[i]), key=lambda i: -len(parts[i]))
    limits = sorted((i for i in pipelines if limited[i]), key=lambda i: -_synthesis_size(parts[i]))
    # The policy schedules (the longest parts, plan for plan) among the first; two of the
    # smallest others are left per other process, to run alongside them.
    cut = max(len(others) - 2 * (processes - 1), 0)
    order = limits + others if keep is None else others[:cut] + limits + others[cut:]
    calls = [(model, cluster, parts[i], keep, prune, beyond) for i in order]
    if processes == 1:
        done = [_rank_part(*call, advance=advance) for call in calls]
    else:
        done = run_in_workers(
            _rank_part, calls, jobs=processes, advance=advance, names=[_part_label(parts[i]) for i in order], here=True
        )
    ranked.update(zip(order, done, strict=True))
    return [ranked[i] for i in range(len(parts))]


def _synthesis_size(plans: list[Plan]) -> int:
    """How much synthesis a policy schedule's plans ask for, roughly: the actions of their
    orders (stages × microbatches, summed), a device's stages read from the policy's
    placement at its default parameters (one where those do not evaluate). A V placement
    (two stages per device) synthesises twice the actions of one stage per device."""
    spec = plans[0].schedule
    assert spec is not None
    return stages_per_device(spec) * sum(plan.pp * plan.microbatches for plan in plans)


def _beyond(done: Sequence[_Part], keep: int | None) -> float:
    """The ``keep``-th best step time of the plans the ``done`` parts finished (seconds;
    infinite with fewer, or without a shortlist): a plan of another part with a greater
    lower bound is not on the shortlist unless it is its schedule's best."""
    if keep is None:
        return float("inf")
    best = heapq.nsmallest(keep, (e.step_time_s for part in done for e in part.finished))
    return best[-1] if len(best) == keep else float("inf")


def _part_label(plans: list[Plan]) -> str:
    spec = plans[0].schedule
    return "the SPMD plans" if spec is None else f"the plans of schedule {schedule_name(spec)}"


def _rank_part(
    model: Model,
    cluster: Cluster,
    plans: list[Plan],
    keep: int | None,
    prune: float | None,
    beyond: float,
    *,
    advance: Advance,
) -> _Part:
    """One part's plans (all SPMD, or all one schedule's) costed, then finished as far as
    ``keep``, ``prune`` and ``beyond`` ask (:func:`_simulate`); a schedule's that states its
    order, on a shortlist, costed only as far as their bounds from the work alone let a
    plan on it (:func:`_rank_lazily`)."""
    # Every shape's lowered arrays are kept for the simulations; schedule objects, few at once.
    pipelines = Pipelines(keep_simulations=False, max_schedules=32, refusals_end=True)
    dropped: Counter[str] = Counter()
    bounded: list[Bounded] = []
    spec = plans[0].schedule
    with paused_collector():
        if keep is not None and spec is not None and not takes_limit(spec):
            finished = _rank_lazily(model, cluster, plans, pipelines, keep, prune, beyond, dropped, bounded, advance)
        else:
            prepared = _cost(model, cluster, plans, pipelines, dropped, advance)
            finished = _simulate(prepared, keep, prune, beyond, dropped, bounded)
    advance("simulating", len(plans))
    return _Part(tuple(finished), dropped, pipelines.num_simulations, tuple(bounded))


def _cost(
    model: Model, cluster: Cluster, plans: list[Plan], pipelines: Pipelines, dropped: Counter[str], advance: Advance
) -> list[Prepared]:
    """Cost every plan without simulating, in the order given; count the dropped ones by reason."""
    prepared: list[Prepared] = []
    for plan in plans:
        prepared.extend(_cost_one(model, cluster, plan, pipelines, dropped))
        advance("costing", 1)
    return prepared


def _cost_one(
    model: Model, cluster: Cluster, plan: Plan, pipelines: Pipelines, dropped: Counter[str]
) -> list[Prepared]:
    """``plan`` costed without simulating (policy schedules come back once per in-flight
    limit that fits: :mod:`~pipedsl.simulator.policy_plans`); none, counted in ``dropped``
    by reason, where it is dropped."""
    try:
        plan = _with_schedule_vpp(plan, pipelines)
        return prepare_plan(model, cluster, plan, pipelines=pipelines)
    except PipedslError as err:
        if not _plan_refused(err) and plan.schedule is not None and plan.schedule not in library.library_schedules():
            raise _users_fault(plan, err) from None
        dropped[_reason(err, plan)] += 1
        return []


_UNCOSTED = "not costed: its bound from the work alone is past the best it could join"
"""The reason counted for a plan :func:`_rank_lazily` never costs."""


def _rank_lazily(
    model: Model,
    cluster: Cluster,
    plans: list[Plan],
    pipelines: Pipelines,
    keep: int,
    prune: float | None,
    beyond: float,
    dropped: Counter[str],
    bounded: list[Bounded],
    advance: Advance,
) -> list[Estimate]:
    """:func:`_simulate`'s shortlist of one schedule's plans (a schedule that states its
    order), with each plan costed (its schedule evaluated) only when needed: plans are
    taken by their bound from the work alone (:func:`~pipedsl.simulator.estimate.work_bound`,
    never above the lower bound costing gives), and a plan is costed only while that
    bound is within what could still put it on the list: the schedule's best until it is
    settled, then the ``keep``-th best here and elsewhere (``beyond``) and ``prune`` times
    the best. Costed plans are finished in the order of their lower bound, as
    :func:`_simulate` finishes them, so the rows are its rows, in its order."""
    # A schedule without a vpp parameter places the stages per device it says at its
    # defaults (read once, not per shape: evaluating each shape is what this spares).
    spec = plans[0].schedule
    assert spec is not None
    placed = None if "vpp" in pipelines.parameters(spec) else stages_per_device(spec)
    cheap: list[tuple[float, int, Plan]] = []
    for index, plan in enumerate(plans):
        try:
            bound = work_bound(
                model, cluster, plan if placed is None or placed == plan.vpp else replace(plan, vpp=placed)
            )
        except DoesNotFit as err:
            dropped[_reason(err, plan)] += 1
            continue
        except PipedslError:
            bound = 0.0  # costed first: costing says why it is dropped
        cheap.append((bound, index, plan))
    cheap.sort(key=lambda item: item[:2])
    costed: list[tuple[float, int, int, Prepared]] = []  # a heap by lower bound, then as _cost orders them
    finished: list[Estimate] = []
    listed: list[tuple[Prepared, Estimate]] = []
    best, settled, taken = float("inf"), False, 0
    kth: list[float] = []  # the keep best step times, negated: a max-heap whose top is the keep-th best
    while True:
        if settled:
            limit = min(beyond, -kth[0] if len(kth) == keep else float("inf"))
            limit = min(limit, prune * best) if prune is not None else limit
        else:
            limit = best
        next_cheap = cheap[taken][0] if taken < len(cheap) else float("inf")
        next_costed = costed[0][0] if costed else float("inf")
        if min(next_cheap, next_costed) > limit or next_cheap == next_costed == float("inf"):
            if settled:
                break
            # The schedule's best is settled: what follows may join the shortlist.
            settled = True
            kth = [-t for t in heapq.nsmallest(keep, (e.step_time_s for e in finished))]
            heapq.heapify(kth)
            continue
        if next_cheap <= next_costed:
            _, index, plan = cheap[taken]
            taken += 1
            for order, item in enumerate(_cost_one(model, cluster, plan, pipelines, dropped)):
                heapq.heappush(costed, (item.lower_bound_s, index, order, item))
            continue
        item = heapq.heappop(costed)[3]
        estimate = item.finish()
        if not settled:
            finished.append(estimate)
            best = min(best, estimate.step_time_s)
            continue
        listed.append((item, estimate))
        if len(kth) < keep:
            heapq.heappush(kth, -estimate.step_time_s)
        elif estimate.step_time_s < -kth[0]:
            heapq.heapreplace(kth, -estimate.step_time_s)
    advance("costing", len(plans))
    left = [item for *_, item in costed]
    if left:
        dropped[_not_listed(keep)] += len(left)
        bounded.extend(_bounded(item) for item in left)
    if taken < len(cheap):
        dropped[_UNCOSTED] += len(cheap) - taken
        bounded.extend(Bounded(plan, bound, None) for bound, _, plan in cheap[taken:])
    # In the order the whole ranking finishes them: equal step times keep it in the final (stable) sort.
    listed.sort(key=lambda pair: _group(pair[0].plan))
    return finished + [estimate for _, estimate in listed]


def _plan_refused(err: PipedslError) -> bool:
    """Whether ``err`` refuses the plan rather than blames the schedule's file: the plan
    does not fit or divide the model, or the schedule's own ``require`` refuses its
    parameters (the first error found is a failed ``require``: what follows it may only
    echo it). Anything else in a user's file (a division by zero, a missing backward) is
    the file's fault, and the search stops on it."""
    return isinstance(err, (PlanError, RequirementFailed))


def _users_fault(plan: Plan, err: PipedslError) -> PipedslError:
    """The error a user's schedule file raised for ``plan``, with its place in the file:
    a validation rule broken by the int-coded actions (which keep no source positions)
    is found again on the schedule's objects, which do."""
    if isinstance(err, ScheduleInvalid) and err.pos is None and plan.schedule is not None:
        params = {"pp": plan.pp, "microbatches": plan.microbatches}
        if "vpp" in library.parameters(plan.schedule):
            params["vpp"] = plan.vpp
        try:
            loaded = library.load(plan.schedule, **params)
            if isinstance(loaded, Schedule):
                validate(loaded)
        except ScheduleInvalid as placed:
            err = placed
        except PipedslError:
            pass
    err.add_note(
        f"{plan.schedule}: the search stopped at plan {plan.label} (pp={plan.pp}, microbatches={plan.microbatches});"
        " a schedule that takes only some parameters says which with `require`"
    )
    return err


def _reason(err: PipedslError, plan: Plan) -> str:
    """Why a plan was dropped, as counted in ``attrs["dropped"]``: for a schedule's own
    refusal, which schedule and which of its rules."""
    if isinstance(err, DoesNotFit):
        return "does not fit in memory"
    label = "" if plan.schedule is None else schedule_name(plan.schedule)
    if isinstance(err, RequirementFailed):
        line = "" if err.pos is None else f" (line {err.pos.line})"
        return f"rejected by {label}'s require{line}: {err.requirement}"
    if isinstance(err, ScheduleInvalid):
        return f"{label} breaks the rule {err.rule}"
    if isinstance(err, ScheduleEvalError):
        return f"{label} does not evaluate: {err.message.splitlines()[0]}"
    if isinstance(err, PlanError):
        return "does not divide the model"
    return f"{label} failed to load: {err.message.splitlines()[0]}"


def _simulate(
    prepared: list[Prepared],
    keep: int | None,
    prune: float | None,
    beyond: float,
    dropped: Counter[str],
    bounded: list[Bounded],
) -> list[Estimate]:
    """Finish the prepared plans. SPMD plans cost nothing more and are all finished.
    Pipeline plans go schedule by schedule: best-first by lower bound until that
    schedule's best step time is settled (no lower bound left below it), then the rest
    within ``prune`` times it, grouped by evaluated schedule so that each is lowered
    once; with a shortlist of ``keep``, the rest only best-first while their bound is
    below both the schedule's ``keep``-th best step time and ``beyond`` (seconds, the
    ``keep``-th best elsewhere). So every schedule's best plan is exact, however far
    behind the others. The plans left unsimulated go to ``bounded``."""
    results = [p.finish() for p in prepared if p.key is None]
    by_schedule: dict[str, list[Prepared]] = {}
    for p in prepared:
        if p.key is not None:
            by_schedule.setdefault(p.key.spec, []).append(p)
    for plans in by_schedule.values():
        order = sorted(plans, key=lambda p: p.lower_bound_s)
        finished: list[Estimate] = []
        best = float("inf")
        settled = 0
        while settled < len(order) and order[settled].lower_bound_s <= best:
            finished.append(order[settled].finish())
            best = min(best, finished[-1].step_time_s)
            settled += 1
        rest = order[settled:]
        if prune is not None:
            kept = [p for p in rest if p.lower_bound_s <= prune * best]
            bounded.extend(_bounded(p) for p in rest if p.lower_bound_s > prune * best)
            if len(kept) < len(rest):
                dropped[f"over {prune:g}x its schedule's best step time (lower bound)"] += len(rest) - len(kept)
            rest = kept
        if keep is None:
            rest.sort(key=lambda p: _group(p.plan))
            done = [(p, p.finish()) for p in rest]
        else:
            done = _settle_best(rest, [e.step_time_s for e in finished], keep, beyond, dropped)
            bounded.extend(_bounded(p) for p in rest[len(done) :])
            # In the order the whole ranking finishes them: equal step times keep it in
            # the final (stable) sort.
            done.sort(key=lambda pair: _group(pair[0].plan))
        results.extend(finished)
        results.extend(estimate for _, estimate in done)
    return results


def _bounded(prepared: Prepared) -> Bounded:
    return Bounded(prepared.plan, prepared.lower_bound_s, prepared.memory.total)


def _not_listed(keep: int) -> str:
    """The reason counted for a plan off a shortlist of ``keep``."""
    return f"not among the best {keep} nor its schedule's best"


def _settle_best(
    rest: list[Prepared], times: list[float], keep: int, beyond: float, dropped: Counter[str]
) -> list[tuple[Prepared, Estimate]]:
    """The plans of ``rest`` (by increasing lower bound) that may be on a shortlist of
    ``keep``, finished, given the step ``times`` of their schedule's plans finished
    before: best-first while their bound is below ``beyond`` (seconds) and the schedule's
    ``keep``-th best time (a plan whose bound is above either is slower than ``keep``
    others, and the schedule's best is already among ``times``)."""
    # The keep best times so far, negated: a max-heap whose top is the keep-th best.
    kth = [-t for t in heapq.nsmallest(keep, times)]
    heapq.heapify(kth)
    done: list[tuple[Prepared, Estimate]] = []
    for item in rest:
        if item.lower_bound_s > beyond or (len(kth) == keep and item.lower_bound_s > -kth[0]):
            dropped[_not_listed(keep)] += len(rest) - len(done)
            break
        estimate = item.finish()
        done.append((item, estimate))
        if len(kth) < keep:
            heapq.heappush(kth, -estimate.step_time_s)
        elif estimate.step_time_s < -kth[0]:
            heapq.heapreplace(kth, -estimate.step_time_s)
    return done


def _shortlisted(ranked: list[Estimate], keep: int, dropped: Counter[str], bounded: list[Bounded]) -> list[Estimate]:
    """The best ``keep`` of ``ranked`` (best first) and the best of each schedule (and
    of the SPMD plans), in the order given; the rest counted in ``dropped`` and added to
    ``bounded`` (their step time, their bound)."""
    seen: set[str | None] = set()
    listed = []
    for rank, estimate in enumerate(ranked):
        schedule = estimate.plan.schedule
        if rank < keep or schedule not in seen:
            listed.append(estimate)
        else:
            bounded.append(Bounded(estimate.plan, estimate.step_time_s, estimate.memory.total))
        seen.add(schedule)
    if len(listed) < len(ranked):
        dropped[_not_listed(keep)] += len(ranked) - len(listed)
    return listed
