"""What a plan search will cost, counted from its plans before any is evaluated, and the
bound past which a search is refused.

A pipeline plan runs its schedule at one shape (schedule, pp, vpp, microbatches). The
search evaluates, validates and lowers each shape once and keeps its int-coded arrays
while that schedule's plans are ranked (:class:`~pipedsl.simulator.pipelines.Pipelines`);
both the time and the memory grow with the shape's (stage, microbatch) *pairs*:
pp × stages per device × microbatches, each two or three actions (F and B, or F, I and
W) with their sends and receives. A plan runs global batch / (dp × microbatch size)
microbatches, so a large batch over few replicas makes schedules of millions of pairs:
GPT-3 175B on 1,024 GPUs at a batch of 1,000,000 asks for 474 M pairs, one shape alone
for 24 M.

Measured on a 2-core machine, one process: ``interleaved_1f1b``'s plans of GPT-3 175B on
1,024 A100s at a batch of 65,536 (7.5 M pairs) took 23 s and 1.3 GB at peak, ``1f1b``'s
(1.4 M pairs) 3.9 s and 0.4 GB: about 3 µs and 160 bytes a pair, over a base of about
150 MB. Hence the bounds, checked before any work (:meth:`SearchWork.check`):
:data:`MAX_PAIRS_PER_SCHEDULE` keeps each process under about 1.5 GB (a process ranks one
schedule's plans at a time, and the memory of one schedule's shapes is what it holds), and
:data:`MAX_PAIRS` keeps a whole search within about two minutes of one core. The
searches anyone runs are far inside: GPT-3 175B on 1,024 GPUs at its published batch of
1,536 asks for 0.9 M pairs, at 65,536 for 30 M.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from pipedsl import library
from pipedsl.errors import PipedslError
from pipedsl.simulator.plan import Plan, PlanError, schedule_name

__all__ = ["MAX_PAIRS", "MAX_PAIRS_PER_SCHEDULE", "SearchWork", "stages_per_device"]

MAX_PAIRS = 2**25
"""The most (stage, microbatch) pairs a search evaluates in all, 33.5 M: about two
minutes of one core."""

MAX_PAIRS_PER_SCHEDULE = 2**23
"""The most (stage, microbatch) pairs of one schedule's plans a search evaluates, 8.4 M:
about 1.5 GB held by the process that ranks them."""


def stages_per_device(spec: str) -> int:
    """The stages a device of schedule ``spec`` holds, read from its placement at its
    default parameters (a V placement holds two); 1 where those do not evaluate."""
    try:
        loaded = library.load(spec)
    except PipedslError:
        return 1
    return max(loaded.num_stages // loaded.num_devices, 1)


@dataclass(frozen=True, slots=True)
class SearchWork:
    """The (stage, microbatch) pairs of the distinct shapes a search's pipeline plans
    run, per schedule (its spec)."""

    pairs: Counter[str]

    @classmethod
    def of(cls, plans: Iterable[Plan]) -> SearchWork:
        """Count the pairs of ``plans`` (SPMD plans run no schedule and count none). A
        schedule without a ``vpp`` parameter is offered with vpp 1: its own placement
        says how many stages a device holds."""
        shapes: dict[tuple[str, int, int, int], int] = {}
        # Per schedule, the stages a device holds when the plan's vpp does not say.
        placed: dict[str, int | None] = {}
        for plan in plans:
            spec = plan.schedule
            if spec is None:
                continue
            if spec not in placed:
                placed[spec] = None if "vpp" in library.parameters(spec) else stages_per_device(spec)
            per_device = placed[spec] or plan.vpp
            shapes[(spec, plan.pp, plan.vpp, plan.microbatches)] = plan.pp * per_device * plan.microbatches
        pairs: Counter[str] = Counter()
        for (spec, *_), count in shapes.items():
            pairs[spec] += count
        return cls(pairs)

    @property
    def total(self) -> int:
        """The pairs of every schedule."""
        return sum(self.pairs.values())

    def check(self, *, what: str) -> None:
        """Raise PlanError, naming ``what`` was searched, when the pairs are past
        :data:`MAX_PAIRS` or one schedule's past :data:`MAX_PAIRS_PER_SCHEDULE`."""
        if not self.pairs:
            return
        spec, most = self.pairs.most_common(1)[0]
        if self.total <= MAX_PAIRS and most <= MAX_PAIRS_PER_SCHEDULE:
            return
        raise PlanError(
            f"search: {what} come to {self.total:,} (stage, microbatch) pairs of pipeline schedules to evaluate"
            f" ({schedule_name(spec)}'s plans alone {most:,}); a search evaluates at most {MAX_PAIRS:,} in all"
            f" and {MAX_PAIRS_PER_SCHEDULE:,} per schedule (about two minutes of one core, and 1.5 GB for one"
            " schedule's). A plan runs global batch / (dp × microbatch size) microbatches: a smaller global"
            " batch, or fewer schedules, brings it within the bound"
        )
