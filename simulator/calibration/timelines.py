"""Fitting the cost model to measured timelines (what ``pipedsl calibrate SCHEDULE`` runs on).

A measured run (``pipedsl run --timeline``, or ``Pipeline.step(..., record=True)``)
writes the same :class:`~pipedsl.timeline.Timeline` record the simulator produces. This
module reads such records, never executor objects, and turns them into a
:class:`~pipedsl.simulator.costs.CostModel` for the machine at hand: the time of each
action kind on each stage, and the latency of a transfer.

Each statistic is a median over microbatches and runs: the first microbatches of a
step are slower (caches, allocator warm-up) and a shared machine adds outliers, which a
median ignores and a mean does not. :func:`timeline_report` states the fit in the
calibration's one report form: each fitted time with the actions behind it, and each
recorded step against its simulation under the fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipedsl.errors import PipedslError
from pipedsl.ir import Schedule
from pipedsl.simulator.calibration.report import Measured, Report, Reproduced
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.engine import simulate
from pipedsl.timeline import EventKind, Timeline

__all__ = ["CalibrationError", "Fit", "fit_costs", "timeline_report"]


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
        raise CalibrationError(
            f"no {kind.value} action was measured on stage {missing[0]}; record a run that covers every stage"
        )
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


def timeline_report(
    fit: Fit, schedule: Schedule, timelines: Sequence[Timeline], cost_model: CostModel, *, platform: str
) -> Report:
    """``fit`` of ``timelines`` (recorded runs of ``schedule``) as a report: each stage's
    fitted seconds per action kind with how many actions were measured, the transfer
    time, and each recorded step's makespan against ``schedule`` simulated under
    ``cost_model`` (the fit as it is used, for instance with blocking sends), on
    ``platform`` (where the runs ran)."""
    lines = []
    for kind, seconds in ((EventKind.F, fit.forward), (EventKind.B, fit.backward), (EventKind.I, fit.input_grad),
                          (EventKind.W, fit.weight_grad)):  # fmt: skip
        if seconds is None:
            continue
        for stage, value in enumerate(seconds):
            count = sum(int(np.count_nonzero(tl.mask(kind) & (tl.stage == stage))) for tl in timelines)
            lines.append(Measured(f"{kind.value} stage {stage}", value, "s", f"median of {count} recorded actions"))
    sends = sum(int(np.count_nonzero(tl.mask(EventKind.SEND))) for tl in timelines)
    lines.append(Measured("transfer", fit.transfer, "s", f"median of {sends} recorded sends"))
    simulated = simulate(schedule, cost_model).makespan
    steps = tuple(Reproduced(f"recorded step {i + 1}", tl.makespan, simulated) for i, tl in enumerate(timelines))
    title = f"{schedule.name}: cost model fitted to {len(timelines)} recorded steps"
    return Report(title, platform, tuple(lines), steps)
