"""Calibration recovers the cost model that produced a timeline."""

from __future__ import annotations

import numpy as np
import pytest

import pipedsl
from pipedsl.simulator import CostModel, simulate
from pipedsl.simulator.calibrate import CalibrationError, fit_costs
from pipedsl.timeline import Event, EventKind, Timeline


def _library(name: str, **params: int) -> pipedsl.Schedule:
    return pipedsl.load(pipedsl.library_path(name), **params)


def test_fit_recovers_uneven_stage_costs_and_latency() -> None:
    truth = CostModel(forward=(1.0, 1.5, 2.0, 1.0), backward=(2.0, 3.0, 4.0, 2.5), latency=0.25)
    timeline = simulate(_library("1f1b", pp=4, microbatches=8), truth).timeline
    fit = fit_costs([timeline], num_stages=4)
    assert fit.forward == (1.0, 1.5, 2.0, 1.0)
    assert fit.backward == (2.0, 3.0, 4.0, 2.5)
    assert fit.input_grad is None and fit.weight_grad is None
    assert fit.transfer == 0.25


def test_fitted_model_predicts_the_run_it_was_fitted_on() -> None:
    truth = CostModel(forward=(1.0, 2.0), input_grad=(1.0, 1.5), weight_grad=(0.5, 0.75), latency=0.1)
    sched = _library("zb_h1", pp=2, microbatches=4)
    measured = simulate(sched, truth)
    fit = fit_costs([measured.timeline], num_stages=2)
    predicted = simulate(sched, fit.cost_model())
    assert predicted.makespan == pytest.approx(measured.makespan, rel=1e-12)
    # The fused backward a 1F1B run would need is derived from the split halves.
    assert fit.cost_model().resolve(_library("1f1b", pp=2, microbatches=4)).backward == (1.5, 2.25)


def test_median_ignores_outliers() -> None:
    events = [Event(0, EventKind.F, 0, m, 0.0, 1.0) for m in range(4)] + [Event(0, EventKind.F, 0, 4, 0.0, 50.0)]
    timeline = Timeline.from_events(events, name="x", num_devices=1, origin="measured")
    assert fit_costs([timeline], num_stages=1).forward == (1.0,)


def test_errors_name_what_is_missing() -> None:
    with pytest.raises(CalibrationError, match="no measured timeline"):
        fit_costs([], num_stages=2)
    only_stage0 = Timeline.from_events([Event(0, EventKind.F, 0, 0, 0.0, 1.0)], name="x", num_devices=2, origin="measured")
    with pytest.raises(CalibrationError, match="stage 1"):
        fit_costs([only_stage0], num_stages=2)
    empty = Timeline.from_events([], name="x", num_devices=1, origin="measured")
    with pytest.raises(CalibrationError, match="no forward"):
        fit_costs([empty], num_stages=1)
    assert np.isfinite(fit_costs([only_stage0], num_stages=1).forward[0])
