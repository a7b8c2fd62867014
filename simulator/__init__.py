"""The simulator: cost models, event simulation, plots and traces, model and cluster
descriptions, the plan estimator, the plan search and calibration (``pipedsl.simulator``).

Imports only the core ``pipedsl`` modules (never JAX, Ray or the executor), so checking
and simulating stay quick to start and run anywhere; matplotlib is imported only when
a picture is drawn.

    >>> from pipedsl.library import library_path, load
    >>> from pipedsl.simulator import CostModel, simulate
    >>> sim = simulate(load(library_path("1f1b"), pp=4, microbatches=8), CostModel(forward=1, backward=2))
    >>> sim.makespan, round(sim.bubble_ratio, 4)
    (33.0, 0.2727)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipedsl.simulator.calibration.timelines import CalibrationError, Fit, fit_costs
    from pipedsl.simulator.costs import CostError, CostModel
    from pipedsl.simulator.engine import DeviceStats, Simulation, simulate
    from pipedsl.simulator.estimate import Estimate, estimate, prepare
    from pipedsl.simulator.hardware import Cluster, Model, load_cluster, load_model
    from pipedsl.simulator.plan import Plan, Recompute
    from pipedsl.simulator.plot import Panel, plot_timelines, save_figure
    from pipedsl.simulator.ranked import RankedPlan
    from pipedsl.simulator.search import Ranking, search, search_plans, search_ranking, summarize
    from pipedsl.simulator.ticked import TickTiming, tick_timing
    from pipedsl.simulator.trace import chrome_trace, write_trace

# Each name's module, imported on first use: ``pipedsl simulate`` needs the engine and
# the cost model, not the plan search or the plotting.
_HOMES = {
    "calibration.timelines": ("CalibrationError", "Fit", "fit_costs"),
    "costs": ("CostError", "CostModel"),
    "engine": ("DeviceStats", "Simulation", "simulate"),
    "estimate": ("Estimate", "estimate", "prepare"),
    "hardware": ("Cluster", "Model", "load_cluster", "load_model"),
    "plan": ("Plan", "Recompute"),
    "plot": ("Panel", "plot_timelines", "save_figure"),
    "ranked": ("RankedPlan",),
    "search": ("Ranking", "search", "search_plans", "search_ranking", "summarize"),
    "ticked": ("TickTiming", "tick_timing"),
    "trace": ("chrome_trace", "write_trace"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """This package's module type. Importing a submodule binds it on the package under
    its own name; for ``search`` and ``estimate``, whose function is exported under
    that name, the function is bound instead, as the eager imports used to leave it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _HOME_OF.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "CostError",
    "CostModel",
    "DeviceStats",
    "Simulation",
    "simulate",
    "Panel",
    "plot_timelines",
    "save_figure",
    "chrome_trace",
    "write_trace",
    "CalibrationError",
    "Fit",
    "fit_costs",
    "Estimate",
    "estimate",
    "prepare",
    "Cluster",
    "Model",
    "load_cluster",
    "load_model",
    "Plan",
    "Recompute",
    "search",
    "search_plans",
    "search_ranking",
    "Ranking",
    "RankedPlan",
    "summarize",
    "TickTiming",
    "tick_timing",
]
