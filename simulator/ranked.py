"""A ranked plan: one row of the plan search's table, as a frozen record; the summary of a ranking.

:func:`pipedsl.simulator.search.search_plans` returns these; :func:`~pipedsl.simulator.search.search`
turns them into its DataFrame (a table is an output, not what modules hand each other).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipedsl.simulator.estimate import Estimate
from pipedsl.simulator.plan import Plan, schedule_name, sharding_words
from pipedsl.simulator.speed import relative_speed

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["COLUMNS", "RankedPlan", "plan_columns", "Summary", "describe", "summarize", "zero_words"]

COLUMNS = (
    "rank",
    "kind",
    "schedule",
    "source",
    "dp",
    "fsdp",
    "tp",
    "cp",
    "pp",
    "vpp",
    "microbatch_size",
    "microbatches",
    "zero",
    "reduce_once",
    "reshard_after_forward",
    "recompute",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "bubble",
    "dp_tail_s",
    "memory_bytes_per_gpu",
    "inflight_limit",
    "synthesis_costs",
    "model",
    "sequence_parallel",
    "flash_attention",
    "reduce_bytes",
    "shared_devices",
)
"""The columns of :func:`search`'s DataFrame, in order."""


@dataclass(frozen=True, slots=True)
class RankedPlan:
    """One ranked plan: a row of :func:`search`'s table (:data:`COLUMNS`), and the plan.

    Seconds are per training step; ``memory_bytes_per_gpu`` is on the fullest GPU.
    ``inflight_limit`` is the ``max_inflight`` a policy schedule was synthesised with for
    this plan's memory (:mod:`pipedsl.simulator.policy_plans`), ``synthesis_costs`` the
    cost model it was synthesised against (:meth:`~pipedsl.simulator.costs.CostModel.to_json`
    as JSON), so that the order run is the order priced; 0 and empty for a schedule that
    states its order. ``model`` is the model's name; ``sequence_parallel``,
    ``flash_attention`` and ``reduce_bytes`` are the plan's, so that a row says all that
    ``pipedsl run --plan`` needs to run what was priced. ``schedule`` is what tables call
    the schedule (:func:`~pipedsl.simulator.plan.schedule_name`), ``source`` what it was
    loaded from (a library name or the path as given; empty for SPMD). ``reduce_once``
    and ``reshard_after_forward`` complete ``zero``'s sharding mode
    (:attr:`~pipedsl.simulator.plan.Plan.sharding`); ``fsdp`` is its shard group (``dp`` where
    the ZeRO state is sharded over all of dp, fewer where shard groups of one slice or node
    are replicas of one another: :attr:`~pipedsl.simulator.plan.Plan.fsdp`). ``shared_devices``: every pipeline
    device on the same GPUs (:attr:`~pipedsl.simulator.plan.Plan.shared_devices`).
    """

    rank: int
    kind: str
    schedule: str
    source: str
    dp: int
    fsdp: int
    tp: int
    cp: int
    pp: int
    vpp: int
    microbatch_size: int
    microbatches: int
    zero: int
    reduce_once: bool
    reshard_after_forward: bool
    recompute: str
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble: float
    dp_tail_s: float
    memory_bytes_per_gpu: int
    inflight_limit: int
    synthesis_costs: str
    model: str
    sequence_parallel: bool
    flash_attention: bool
    reduce_bytes: int
    shared_devices: bool
    plan: Plan

    @classmethod
    def of(cls, rank: int, e: Estimate) -> RankedPlan:
        plan = e.plan
        return cls(
            rank=rank,
            **plan_columns(plan),
            step_time_s=e.step_time_s,
            tokens_per_s=e.tokens_per_s,
            mfu=e.mfu,
            bubble=e.bubble,
            dp_tail_s=e.dp_tail_s,
            memory_bytes_per_gpu=e.memory.total,
            inflight_limit=e.inflight_limit or 0,
            synthesis_costs="" if e.synthesis_costs is None else json.dumps(e.synthesis_costs.to_json()),
            model=e.model.name,
            plan=plan,
        )

    def row(self) -> dict[str, Any]:
        """The :data:`COLUMNS` as a dict (a row of :func:`search`'s table)."""
        return {column: getattr(self, column) for column in COLUMNS}


def plan_columns(plan: Plan) -> dict[str, Any]:
    """The :data:`COLUMNS` a plan fills by itself, before it is priced: its kind, schedule
    and degrees, batch, sharding mode and modelling switches."""
    return dict(
        kind="spmd" if plan.pp == 1 else "pipeline",
        schedule="spmd" if plan.schedule is None else schedule_name(plan.schedule),
        source=plan.schedule or "",
        dp=plan.dp,
        fsdp=plan.shard_group,
        tp=plan.tp,
        cp=plan.cp,
        pp=plan.pp,
        vpp=plan.vpp,
        microbatch_size=plan.microbatch_size,
        microbatches=plan.microbatches,
        zero=plan.zero,
        reduce_once=plan.reduce_once,
        reshard_after_forward=plan.reshard_after_forward,
        recompute=plan.recompute.value,
        sequence_parallel=plan.sequence_parallel,
        flash_attention=plan.flash_attention,
        reduce_bytes=plan.reduce_bytes,
        shared_devices=plan.shared_devices,
    )


@dataclass(frozen=True, slots=True)
class Summary:
    """The best SPMD plan, the best plan of each schedule, and how they compare.

    Rows are :func:`search` rows as dicts. ``speedup`` is the best SPMD step time over
    the best pipeline step time (above 1: the pipeline is faster); None when either kind
    has no plan that fits.
    """

    best_spmd: dict[str, Any] | None
    best_by_schedule: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, rows: Sequence[Mapping[str, Any]]) -> Summary:
        """The best SPMD row and each schedule's best row of ``rows`` (a search's, best
        first; schedules best first)."""
        by_schedule: dict[str, dict[str, Any]] = {}
        spmd = None
        for row in rows:
            if row["kind"] == "spmd":
                spmd = dict(row) if spmd is None else spmd
            elif row["kind"] == "pipeline" and row["schedule"] not in by_schedule:
                by_schedule[row["schedule"]] = dict(row)
        return cls(best_spmd=spmd, best_by_schedule=tuple(by_schedule.values()))

    @property
    def best_pipeline(self) -> dict[str, Any] | None:
        return self.best_by_schedule[0] if self.best_by_schedule else None

    @property
    def speedup(self) -> float | None:
        return None if self.best_pipeline is None else self.speedup_of(self.best_pipeline)

    def speedup_of(self, row: dict[str, Any]) -> float | None:
        """The best SPMD step time over ``row``'s; None without an SPMD plan."""
        return None if self.best_spmd is None else self.best_spmd["step_time_s"] / row["step_time_s"]

    def text(self) -> str:
        """One or two sentences for the end of a search's output."""
        best = self.best_pipeline
        if best is None and self.best_spmd is None:
            return "No plan fits."
        if best is None:
            return f"No pipeline plan fits; the best SPMD plan is {describe(self.best_spmd)}."
        if self.best_spmd is None:
            return f"No SPMD plan fits; the best pipeline plan is {describe(best)}."
        speed = relative_speed(best["step_time_s"], self.best_spmd["step_time_s"])
        verdict = f"{speed} as" if speed == "as fast" else f"{speed} than"
        beat = sum(1 for row in self.best_by_schedule if row["step_time_s"] < self.best_spmd["step_time_s"])
        return (
            f"Best pipeline plan {describe(best)} is {verdict} the best SPMD plan "
            f"{describe(self.best_spmd)}; {beat} of {len(self.best_by_schedule)} schedules beat it."
        )


def describe(row: dict[str, Any] | None) -> str:
    """A search row in words: ``(zbv dp=32 tp=4 pp=8 vpp=2 mb=2 zero=1 none: 18.402 s/step, MFU 56.1%)``."""
    assert row is not None
    vpp = f" vpp={row['vpp']}" if row["vpp"] > 1 else ""
    shared = " shared" if row.get("shared_devices", False) else ""
    pp = f" pp={row['pp']}{vpp}{shared}" if row["kind"] == "pipeline" else ""
    name = f"{row['schedule']} " if row["kind"] == "pipeline" else ""
    cp = f" cp={row['cp']}" if row.get("cp", 1) > 1 else ""
    fsdp = f" fsdp={row['fsdp']}" if row.get("fsdp", row["dp"]) != row["dp"] else ""
    return (
        f"({name}dp={row['dp']}{fsdp} tp={row['tp']}{cp}{pp} mb={row['microbatch_size']} zero={zero_words(row)} "
        f"{row['recompute']}: {row['step_time_s']:.3f} s/step, MFU {100 * row['mfu']:.1f}%)"
    )


def zero_words(row: Mapping[str, Any]) -> str:
    """A search row's ZeRO stage with its sharding mode: ``1``, ``2 once``, ``3 once keep``
    (:attr:`~pipedsl.simulator.plan.Plan.sharding`)."""
    return sharding_words(
        row["zero"],
        reduce_once=row.get("reduce_once", False),
        reshard_after_forward=row.get("reshard_after_forward", True),
    )


def summarize(frame: pd.DataFrame) -> Summary:
    """The best SPMD plan and each schedule's best plan in a :func:`search` result
    (schedules best first)."""
    return Summary.of([row.to_dict() for _, row in frame.iterrows()])
