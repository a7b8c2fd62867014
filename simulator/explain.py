"""Why a search found no plan, and what would make a plan that does not fit fit.

A search counts what removed plans in two places: the enumeration, through the
``skipped`` counter :func:`~pipedsl.simulator.search.candidate_plans` fills (parallel
layouts that do not divide the batch or the layers), and the costing, by the error each
dropped plan raised. :class:`Explanation` gathers both with the schedules that kept no
plan, and says it in words. :func:`fit_advice` tries single changes to a plan that does
not fit in memory and reports those that fit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipedsl.errors import PipedslError
from pipedsl.simulator.estimate import prepare
from pipedsl.simulator.hardware import Cluster, Model
from pipedsl.simulator.memory import Memory
from pipedsl.simulator.pipelines import Pipelines
from pipedsl.simulator.plan import Plan, Recompute
from pipedsl.words import plural

__all__ = ["Explanation", "Advice", "fit_advice", "misfit_text"]

_GIB = 2**30


@dataclass(frozen=True, slots=True)
class Explanation:
    """What a search removed and why.

    Attributes:
      considered: plans the enumeration produced.
      ranked: plans that fit and were ranked.
      skipped: (rule, values, count) for combinations the enumeration never produced,
        most first: the rule, the values of dp or pp × vpp that broke it, and how many
        (layout, microbatch size, schedule) combinations it removed.
      dropped: (reason, count) for produced plans that were dropped, most first.
      schedules_without_plan: schedules that kept no ranked plan.
    """

    considered: int
    ranked: int
    skipped: tuple[tuple[str, tuple[int, ...], int], ...]
    dropped: tuple[tuple[str, int], ...]
    schedules_without_plan: tuple[str, ...]

    @classmethod
    def of(
        cls,
        *,
        considered: int,
        ranked: int,
        skipped: Mapping[tuple[str, int], int],
        dropped: Mapping[str, int],
        schedules: Sequence[str],
        ranked_schedules: Sequence[str],
    ) -> Explanation:
        def most_first(counts: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
            return tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

        kept = set(ranked_schedules)
        values: dict[str, set[int]] = {}
        counts: dict[str, int] = {}
        for (rule, value), count in skipped.items():
            values.setdefault(rule, set()).add(value)
            counts[rule] = counts.get(rule, 0) + count
        return cls(
            considered=considered,
            ranked=ranked,
            skipped=tuple((rule, tuple(sorted(values[rule])), count) for rule, count in most_first(counts)),
            dropped=most_first(dropped),
            schedules_without_plan=tuple(s for s in schedules if s not in kept),
        )

    def lines(self, *, devices: str = "GPUs") -> list[str]:
        """The explanation, one sentence a line (empty when nothing was removed);
        ``devices`` is what the cluster's devices are called (``GPUs`` or ``chips``)."""
        out = [
            f"left out {plural(count, 'combination')}: {rule} ({', '.join(map(str, values))})"
            for rule, values, count in self.skipped
        ]
        out += [f"dropped {count:,}: {reason}" for reason, count in self.dropped]
        if self.schedules_without_plan:
            out.append(f"no feasible plan for schedule(s): {', '.join(self.schedules_without_plan)}")
        if self.ranked == 0:
            out.append(
                "nothing fits: choose a global batch that is a multiple of dp × microbatch size, "
                f"a {devices.removesuffix('s')} count whose factors divide the heads and layers, or a larger cluster"
                if self.considered == 0
                else f"nothing fits: see the reasons above; more {devices}, recomputation or ZeRO may help"
            )
        return out


@dataclass(frozen=True, slots=True)
class Advice:
    """A single change to a plan (``change`` in words) and the memory it needs then."""

    change: str
    plan: Plan
    memory: Memory


def _variants(plan: Plan) -> list[tuple[str, Plan]]:
    out: list[tuple[str, Plan]] = []
    for mode in (Recompute.SELECTIVE, Recompute.FULL):
        if mode is not plan.recompute and not (mode is Recompute.SELECTIVE and plan.recompute is Recompute.FULL):
            out.append((f"recompute {mode.value}", dataclasses.replace(plan, recompute=mode)))
    if plan.dp > 1:
        for zero in range(plan.zero + 1, 4):
            out.append((f"ZeRO {zero}", dataclasses.replace(plan, zero=zero)))
    if plan.microbatch_size > 1:
        smaller = plan.microbatch_size // 2
        out.append((f"microbatch size {smaller}", dataclasses.replace(plan, microbatch_size=smaller)))
    if not plan.flash_attention:
        out.append(("FlashAttention", dataclasses.replace(plan, flash_attention=True)))
    if not plan.sequence_parallel and plan.tp > 1:
        out.append(("sequence parallelism", dataclasses.replace(plan, sequence_parallel=True)))
    return out


def fit_advice(model: Model, cluster: Cluster, plan: Plan, *, pipelines: Pipelines | None = None) -> list[Advice]:
    """Single changes to ``plan`` (recomputation, a higher ZeRO stage, half the
    microbatch size, FlashAttention, sequence parallelism) that make it fit, least
    memory first. Changes the plan cannot take (a schedule's ``require``) are skipped."""
    pipelines = pipelines if pipelines is not None else Pipelines(keep_simulations=False)
    found = []
    for change, variant in _variants(plan):
        try:
            memory = prepare(model, cluster, variant, pipelines=pipelines).memory
        except PipedslError:
            continue
        if memory.fits:
            found.append(Advice(change, variant, memory))
    return sorted(found, key=lambda a: a.memory.total)


def misfit_text(memory: Memory, advice: Sequence[Advice]) -> list[str]:
    """Lines that say by how much a plan does not fit and what would make it fit."""
    lines = [f"does not fit: needs {memory.text()}; {memory.excess / _GIB:.1f} GiB too much"]
    lines += [f"  fits with {a.change}: {a.memory.total / _GIB:.1f} GiB" for a in advice]
    static = memory.weights + memory.gradients + memory.optimizer
    if static > memory.usable:
        factor = math.ceil(static / memory.usable)
        lines.append(
            f"  weights, gradients and optimizer state alone need {static / _GIB:.1f} GiB: spread them over at "
            f"least {factor}x more tensor x pipeline parallelism, or shard them with ZeRO over more data-parallel ranks"
        )
    elif not advice:
        lines.append("  no single change (recomputation, ZeRO, smaller microbatches) makes it fit; "
                     "use more tensor or pipeline parallelism, or GPUs with more memory")  # fmt: skip
    return lines
