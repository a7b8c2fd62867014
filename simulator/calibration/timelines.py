"""Fitting the cost model to measured timelines (what `pipedsl calibrate` runs on).

A measured run (``pipedsl run --timeline``, or ``Pipeline.step(..., record=True)``)
writes the same :class:`~pipedsl.timeline.Timeline` record the simulator produces. This
module reads such records, never executor objects, and turns them into a
:class:`~pipedsl.simulator.costs.CostModel` for the machine at hand: the time of each
action kind on each stage, and the latency of a transfer.

Each statistic is a median over microbatches and runs: the first microbatches of a
step are slower (caches, allocator warm-up) and a shared machine adds outliers, which a
median ignores and a mean does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipedsl.errors import PipedslError
from pipedsl.simulator.costs import CostModel
from pipedsl.timeline import EventKind, Timeline

__all__ = ["CalibrationError", "Fit", "fit_costs"]



class CalibrationError(PipedslError):
    """The measured timelines cannot support a fit (no events of a needed kind)."""


@dataclass(frozen=True, slots=True)
class Fit:
    """Fitted per-stage seconds (shape (S,) each; None where no run measured that kind)
    and the median transfer time in seconds (0 when nothing moved)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...] | None
    input_grad: tuple[float, ...] | None
    weight_grad: tuple[float, ...] | None
    transfer: float
    samples: int

    def cost_model(self, *, per_device: bool = False) -> CostModel:
        """The fitted numbers as a cost model.

        A schedule with a fused ``B`` uses ``backward``; one that splits uses
        ``input_grad`` and ``weight_grad``. When only one form was measured, the other
        is derived from it (``B = I + W``, or ``I = W = B / 2``).
        """
        backward = self.backward
        if backward is None and self.input_grad is not None and self.weight_grad is not None:
            backward = tuple(i + w for i, w in zip(self.input_grad, self.weight_grad, strict=True))
        return CostModel(
            forward=self.forward,
            backward=backward,
            input_grad=self.input_grad,
            weight_grad=self.weight_grad,
            latency=self.transfer,
            per_device=per_device,
        )


def _per_stage(timelines: Sequence[Timeline], kind: EventKind, num_stages: int) -> tuple[float, ...] | None:
    durations: list[list[float]] = [[] for _ in range(num_stages)]
    for tl in timelines:
        mask = tl.mask(kind)
        for stage, seconds in zip(tl.stage[mask].tolist(), tl.durations[mask].tolist(), strict=True):
            if stage >= num_stages:
                raise CalibrationError(f"timeline {tl.name!r} has stage {stage}; the fit is for {num_stages} stages")
            durations[stage].append(seconds)
    if not any(durations):
        return None
    missing = [s for s, d in enumerate(durations) if not d]
    if missing:
        raise CalibrationError(f"no {kind.value} action was measured on stage {missing[0]}; record a run that covers every stage")
    return tuple(float(np.median(d)) for d in durations)


def fit_costs(timelines: Sequence[Timeline], *, num_stages: int) -> Fit:
    """Fit per-stage action times and a transfer time to measured ``timelines``.

    Every timeline must come from a model with ``num_stages`` stages (several schedules
    of the same model may be mixed, so that both fused and split backwards are seen).

    Raises:
      CalibrationError: no timeline, no forward measured, or a stage never measured.
    """
    if not timelines:
        raise CalibrationError("no measured timeline to fit")
    forward = _per_stage(timelines, EventKind.F, num_stages)
    if forward is None:
        raise CalibrationError("the measured timelines hold no forward action")
    sends = np.concatenate([tl.durations[tl.mask(EventKind.SEND)] for tl in timelines])
    return Fit(
        forward=forward,
        backward=_per_stage(timelines, EventKind.B, num_stages),
        input_grad=_per_stage(timelines, EventKind.I, num_stages),
        weight_grad=_per_stage(timelines, EventKind.W, num_stages),
        transfer=float(np.median(sends)) if sends.size else 0.0,
        samples=sum(len(tl) for tl in timelines),
    )
