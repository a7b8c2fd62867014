"""A ranked plan: one row of the plan search's table, as a frozen record.

:func:`pipedsl.simulator.search.search_plans` returns these; :func:`~pipedsl.simulator.search.search`
turns them into its DataFrame (a table is an output, not what modules hand each other).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedsl.simulator.estimate import Estimate
from pipedsl.simulator.plan import Plan

__all__ = ["COLUMNS", "RankedPlan"]

COLUMNS = (
    "rank",
    "kind",
    "schedule",
    "dp",
    "tp",
    "pp",
    "vpp",
    "microbatch_size",
    "microbatches",
    "zero",
    "recompute",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "bubble",
    "dp_tail_s",
    "memory_bytes_per_gpu",
    "inflight_limit",
)
"""The columns of :func:`search`'s DataFrame, in order."""


@dataclass(frozen=True, slots=True)
class RankedPlan:
    """One ranked plan: a row of :func:`search`'s table (:data:`COLUMNS`), and the plan.

    Seconds are per training step; ``memory_bytes_per_gpu`` is on the fullest GPU.
    ``inflight_limit`` is the ``max_inflight`` a policy schedule was synthesised with for
    this plan's memory (:mod:`pipedsl.simulator.policy_plans`); 0 for a schedule that
    states its order.
    """

    rank: int
    kind: str
    schedule: str
    dp: int
    tp: int
    pp: int
    vpp: int
    microbatch_size: int
    microbatches: int
    zero: int
    recompute: str
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble: float
    dp_tail_s: float
    memory_bytes_per_gpu: int
    inflight_limit: int
    plan: Plan

    @classmethod
    def of(cls, rank: int, e: Estimate) -> RankedPlan:
        plan = e.plan
        return cls(
            rank=rank,
            kind="spmd" if plan.pp == 1 else "pipeline",
            schedule="spmd" if plan.schedule is None else Path(plan.schedule).name.removesuffix(".sched"),
            dp=plan.dp,
            tp=plan.tp,
            pp=plan.pp,
            vpp=plan.vpp,
            microbatch_size=plan.microbatch_size,
            microbatches=plan.microbatches,
            zero=plan.zero,
            recompute=plan.recompute.value,
            step_time_s=e.step_time_s,
            tokens_per_s=e.tokens_per_s,
            mfu=e.mfu,
            bubble=e.bubble,
            dp_tail_s=e.dp_tail_s,
            memory_bytes_per_gpu=e.memory.total,
            inflight_limit=e.inflight_limit or 0,
            plan=plan,
        )

    def row(self) -> dict[str, Any]:
        """The :data:`COLUMNS` as a dict (a row of :func:`search`'s table)."""
        return {column: getattr(self, column) for column in COLUMNS}
