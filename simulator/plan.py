"""A parallel plan, and the pipeline schedule it runs.

A :class:`Plan` says how a model is trained on a cluster: data-parallel ``dp``,
tensor-parallel ``tp`` and pipeline-parallel ``pp`` degrees, ``vpp`` stages per pipeline
device, the microbatch size, the global batch, the ZeRO stage, the recomputation mode and,
for ``pp > 1``, the schedule: a library name (``1f1b``) or a ``.sched`` file, evaluated
with the plan's ``pp``, ``microbatches`` and (when it takes one) ``vpp``.

:class:`Pipelines` evaluates, lowers and simulates those schedules and remembers every
result, so that a search over thousands of plans does each piece of work once.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pipedsl import library
from pipedsl.errors import PipedslError
from pipedsl.ir import Kind, Schedule
from pipedsl.program import Program
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.engine import Simulation, simulate

__all__ = [
    "Recompute",
    "PlanError",
    "Plan",
    "Pipelines",
    "ScheduleKey",
    "Timing",
    "load_pipeline",
    "peak_residual_bytes",
]


class Recompute(enum.Enum):
    """Which activations the backward recomputes instead of storing."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class PlanError(PipedslError):
    """A plan is malformed or does not fit the model or the cluster (a division that is
    not whole, a schedule that is missing or places stages differently)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """How to train: the parallel degrees, batch split, sharding and recomputation.

    Attributes:
      dp, tp, pp: data-, tensor- and pipeline-parallel degrees; GPUs = dp·tp·pp.
      vpp: model stages per pipeline device (virtual pipeline stages).
      microbatch_size: sequences per microbatch b.
      global_batch: sequences per step; must be a multiple of dp·b.
      zero: ZeRO stage 0–3 (sharding over the dp ranks).
      recompute: ``none``, ``selective`` or ``full`` (a :class:`Recompute` or its name).
      schedule: for pp > 1, a library schedule's name (``1f1b``) or a ``.sched`` path;
        None for an SPMD plan (pp = 1).
      sequence_parallel: whether tensor-parallel ranks also split norms and dropout
        along the sequence (Korthikanti et al.).
      flash_attention: whether attention runs fused without storing the a·s² scores.
      dp_overlap: fraction in [0, 1] of the covering computation that can hide
        data-parallel traffic (see :mod:`pipedsl.simulator.estimate`).
      reduce_bytes: bytes per gradient value in data-parallel reductions: 4 (fp32, as
        Megatron-LM reduces) or 2 (bf16, as mixed-precision FSDP often does).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    microbatch_size: int = 1
    global_batch: int
    zero: int = 0
    recompute: Recompute = Recompute.NONE
    schedule: str | None = None
    sequence_parallel: bool = True
    flash_attention: bool = True
    dp_overlap: float = 1.0
    reduce_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "vpp", "microbatch_size", "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"plan: {name} must be a whole number >= 1, got {value!r}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise PlanError(f"plan: zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.recompute, Recompute):
            try:
                object.__setattr__(self, "recompute", Recompute(self.recompute))
            except ValueError:
                choices = ", ".join(r.value for r in Recompute)
                raise PlanError(f"plan: recompute must be one of {choices}, got {self.recompute!r}") from None
        for name in ("sequence_parallel", "flash_attention"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"plan: {name} must be true or false, got {getattr(self, name)!r}")
        overlap = self.dp_overlap
        if isinstance(overlap, bool) or not isinstance(overlap, int | float) or not 0.0 <= overlap <= 1.0:
            raise PlanError(f"plan: dp_overlap must be a fraction in [0, 1], got {overlap!r}")
        if isinstance(self.reduce_bytes, bool) or self.reduce_bytes not in (2, 4):
            raise PlanError(f"plan: reduce_bytes must be 2 (bf16) or 4 (fp32), got {self.reduce_bytes!r}")
        per_step = self.dp * self.microbatch_size
        if self.global_batch % per_step:
            raise PlanError(
                f"plan: global batch {self.global_batch} is not a multiple of dp × microbatch size = "
                f"{self.dp} × {self.microbatch_size} = {per_step}; every data-parallel rank needs whole microbatches"
            )
        if self.pp == 1 and self.schedule is not None:
            raise PlanError(
                f"plan: pp = 1 is an SPMD plan and runs no pipeline schedule; drop schedule {self.schedule!r}"
            )
        if self.pp == 1 and self.vpp != 1:
            raise PlanError(f"plan: vpp = {self.vpp} needs a pipeline (pp > 1)")
        if self.pp > 1 and self.schedule is None:
            raise PlanError(f"plan: pp = {self.pp} needs a schedule (a library name such as 1f1b, or a .sched file)")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def microbatches(self) -> int:
        """Microbatches per data-parallel rank per step: global batch / (dp · b)."""
        return self.global_batch // (self.dp * self.microbatch_size)

    @property
    def label(self) -> str:
        """A short description such as ``1f1b dp8 tp8 pp16 mb1 zero1 selective``."""
        kind = "spmd" if self.schedule is None else _schedule_label(self.schedule)
        vpp = f" vpp{self.vpp}" if self.vpp > 1 else ""
        return (
            f"{kind} dp{self.dp} tp{self.tp} pp{self.pp}{vpp} mb{self.microbatch_size} "
            f"zero{self.zero} {self.recompute.value}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp,
            "microbatch_size": self.microbatch_size,
            "global_batch": self.global_batch,
            "microbatches": self.microbatches,
            "zero": self.zero,
            "recompute": self.recompute.value,
            "schedule": self.schedule,
            "sequence_parallel": self.sequence_parallel,
            "flash_attention": self.flash_attention,
            "dp_overlap": self.dp_overlap,
            "reduce_bytes": self.reduce_bytes,
        }


def _schedule_label(spec: str) -> str:
    name = spec.replace("\\", "/").rsplit("/", 1)[-1]
    return name.removesuffix(".sched")


# --- schedules --------------------------------------------------------------------------


def load_pipeline(spec: str, *, pp: int, vpp: int, microbatches: int) -> Schedule:
    """Evaluate schedule ``spec`` with ``pp``, ``microbatches`` and, if it takes one, ``vpp``.

    Each file is parsed once per version (:mod:`pipedsl.library`); evaluation runs every call.
    """
    path = library.resolve(spec)
    names = library.parameters(path)
    for needed in ("pp", "microbatches"):
        if needed not in names:
            raise PlanError(
                f"{path}: a pipeline plan sets parameters pp and microbatches, but the schedule has no {needed!r}"
            )
    params = {"pp": pp, "microbatches": microbatches}
    if "vpp" in names:
        params["vpp"] = vpp
    return library.load(path, **params)


# --- the cache ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timing:
    """What a plan needs from one pipeline simulation.

    ``makespan`` in seconds; ``bubble_ratio`` the idle fraction of devices × makespan;
    ``simulation`` the whole result, when the :class:`Pipelines` keeps them.
    """

    makespan: float
    bubble_ratio: float
    simulation: Simulation | None


class ScheduleKey(NamedTuple):
    """Which evaluated schedule a plan runs: ``vpp`` is 0 for a schedule without a
    ``vpp`` parameter, so that plans differing only there share one evaluation."""

    spec: str
    pp: int
    vpp: int
    microbatches: int


@dataclass(slots=True)
class _Entry:
    """One evaluated schedule and what was derived from it, made when first needed."""

    schedule: Schedule
    walk: _Walk | None = None
    program: Program | None = None


class Pipelines:
    """Evaluates, lowers and simulates schedules, remembering results.

    One instance shared across many estimates (as :mod:`pipedsl.simulator.search` does)
    evaluates each (schedule, pp, vpp, microbatches) once, lowers it once when a plan
    needs its timing, and simulates each distinct cost model once per program.

    Args:
      keep_simulations: keep each simulation whole (its timeline too); otherwise keep
        only makespan and bubble, as a search of hundreds of simulations needs.
      max_schedules: keep at most this many evaluated schedules (with their lowered
        programs), dropping the least recently used; None keeps all. A schedule of
        millions of actions takes hundreds of megabytes once lowered.
    """

    def __init__(self, *, keep_simulations: bool = True, max_schedules: int | None = None) -> None:
        self._keep = keep_simulations
        self._max = max_schedules
        self._entries: OrderedDict[ScheduleKey, _Entry] = OrderedDict()
        self._errors: dict[ScheduleKey, PipedslError] = {}
        self._timings: dict[tuple[ScheduleKey, CostModel], Timing] = {}
        self._takes_vpp: dict[str, bool] = {}

    def key(self, plan: Plan) -> ScheduleKey:
        """The schedule ``plan`` runs (a pipeline plan: ``plan.schedule`` is set)."""
        spec = plan.schedule
        if spec is None:
            raise PlanError(f"{plan.label} is an SPMD plan and runs no schedule")
        takes_vpp = self._takes_vpp.get(spec)
        if takes_vpp is None:
            takes_vpp = self._takes_vpp[spec] = "vpp" in library.parameters(spec)
        return ScheduleKey(spec, plan.pp, plan.vpp if takes_vpp else 0, plan.microbatches)

    def _entry(self, key: ScheduleKey) -> _Entry:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        error = self._errors.get(key)
        if error is not None:
            raise error
        try:
            schedule = load_pipeline(key.spec, pp=key.pp, vpp=max(key.vpp, 1), microbatches=key.microbatches)
        except PipedslError as err:
            self._errors[key] = err
            raise
        entry = self._entries[key] = _Entry(schedule)
        if self._max is not None and len(self._entries) > self._max:
            self._entries.popitem(last=False)
        return entry

    def schedule(self, key: ScheduleKey) -> Schedule:
        """The schedule evaluated for ``key``; raises what evaluation raised."""
        return self._entry(key).schedule

    def _walk_of(self, key: ScheduleKey) -> _Walk:
        entry = self._entry(key)
        if entry.walk is None:
            entry.walk = _walk(entry.schedule)
        return entry.walk

    def peak_residual_bytes(self, key: ScheduleKey, residual: tuple[int, ...]) -> tuple[int, ...]:
        """:func:`peak_residual_bytes` of the schedule of ``key``."""
        return _peaks(self._walk_of(key), residual)

    def lower_bound_s(self, key: ScheduleKey, seconds: np.ndarray) -> float:
        """Seconds the schedule of ``key`` takes at least, without simulating it, when
        ``seconds[k, s]`` is the duration of kind k (F, B, I, W) on stage s (shape
        (4, S)): each device's order against each action's own chain of dependencies,
        with free transfers."""
        return _chain_bound(self._walk_of(key), seconds)

    @property
    def num_simulations(self) -> int:
        """Distinct simulations run so far."""
        return len(self._timings)

    def timing(self, key: ScheduleKey, costs: CostModel) -> Timing:
        """Simulate the schedule of ``key`` (validated and lowered once) under ``costs``,
        once per distinct costs."""
        found = self._timings.get((key, costs))
        if found is None:
            entry = self._entry(key)
            if entry.program is None:
                entry.program = entry.schedule.lower()
            result = simulate(entry.program, costs)
            found = Timing(result.makespan, result.bubble_ratio, result if self._keep else None)
            self._timings[(key, costs)] = found
        return found


@dataclass(frozen=True, slots=True)
class _Walk:
    """A schedule's actions as flat arrays in device order, for vectorised passes.

    ``stages`` and ``kinds`` (0 F, 1 B, 2 I, 3 W) have one entry per action; device d's
    actions are ``bounds[d]:bounds[d + 1]``; ``split`` says whether backwards are split.
    """

    stages: np.ndarray
    kinds: np.ndarray
    bounds: tuple[int, ...]
    split: bool


_KIND_CODE = {Kind.F: 0, Kind.B: 1, Kind.I: 2, Kind.W: 3}
# Residual sets held: F adds one, B and W drop one; I hands its set on to W.
_HELD_CHANGE = np.array([1, -1, 0, -1], dtype=np.int64)


def _walk(schedule: Schedule) -> _Walk:
    stages: list[int] = []
    kinds: list[int] = []
    bounds = [0]
    for order in schedule.orders:
        for action in order:
            stages.append(action.stage)
            kinds.append(_KIND_CODE[action.kind])
        bounds.append(len(stages))
    kind_array = np.array(kinds, dtype=np.int64)
    split = bool(np.any(kind_array == 2))
    return _Walk(np.array(stages, dtype=np.int64), kind_array, tuple(bounds), split)


def _peaks(walk: _Walk, residual: tuple[int, ...]) -> tuple[int, ...]:
    change = _HELD_CHANGE[walk.kinds] * np.asarray(residual, dtype=np.int64)[walk.stages]
    peaks = []
    for start, stop in zip(walk.bounds, walk.bounds[1:]):
        held = np.cumsum(change[start:stop])
        peaks.append(max(int(held.max()), 0) if stop > start else 0)
    return tuple(peaks)


def _chain_bound(walk: _Walk, seconds: np.ndarray) -> float:
    """Seconds the schedule takes at least when ``seconds[k, s]`` is the duration of kind k
    (F, B, I, W) on stage s and transfers are free.

    Each action starts no earlier than its own microbatch's chain of dependencies allows
    when nothing else waits: F on stage s after the forwards of stages before s; a
    backward (B or I) on stage s after every forward and the backwards of the stages
    after s; W after that and its own I. A device runs its actions in order, so it ends
    no earlier than, for every k, the k-th action's earliest start plus the durations of
    it and of everything after it on the device.
    """
    forward = seconds[0]
    backward = seconds[2] if walk.split else seconds[1]
    before = np.concatenate([[0.0], np.cumsum(forward)[:-1]])
    after = np.concatenate([np.cumsum(backward[::-1])[::-1][1:], [0.0]])
    total_forward = float(forward.sum())
    stage_chain = np.stack([before, total_forward + after, total_forward + after, total_forward + after + seconds[2]])
    earliest = stage_chain[walk.kinds, walk.stages]
    duration = seconds[walk.kinds, walk.stages]
    bound = 0.0
    for start, stop in zip(walk.bounds, walk.bounds[1:]):
        if stop > start:
            remaining = np.cumsum(duration[start:stop][::-1])[::-1]
            bound = max(bound, float((earliest[start:stop] + remaining).max()))
    return bound


def peak_residual_bytes(schedule: Schedule, residual: tuple[int, ...]) -> tuple[int, ...]:
    """Per device, the most activation bytes held at once, shape (D,).

    ``residual[s]`` is what one microbatch's ``F`` on stage s keeps until its ``B`` (or,
    split, until its ``W``: ``I`` hands the same bytes on). Memory follows each device's
    order alone, so this is the simulator's peak without running the simulation.
    """
    return _peaks(_walk(schedule), residual)
