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

from pipedsl.simulator.cost_fit import CalibrationError, Fit, fit_costs
from pipedsl.simulator.costs import CostError, CostModel, StageCosts
from pipedsl.simulator.engine import DeviceStats, Simulation, simulate
from pipedsl.simulator.estimate import Estimate, estimate, prepare
from pipedsl.simulator.hardware import Cluster, Model, load_cluster, load_model
from pipedsl.simulator.plan import Plan, Recompute
from pipedsl.simulator.plot import Panel, plot_timelines, save_figure
from pipedsl.simulator.ranked import RankedPlan
from pipedsl.simulator.search import search, search_plans, summarize
from pipedsl.simulator.trace import chrome_trace, write_trace

__all__ = [
    "CostError",
    "CostModel",
    "StageCosts",
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
    "RankedPlan",
    "summarize",
]
