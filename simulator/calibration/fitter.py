"""The one fitter of the cost model: the cluster numbers at which the simulator prices a
set of calibration steps as they were measured.

A calibration step is something measured once (a published run's iteration, a training
step timed on this machine) together with the simulator's price of it on a candidate
cluster (:class:`Step`). A fit varies some of the cluster's fields (:class:`Parameter`)
and keeps the rest, and finds the values whose prices come closest to the measurements,
in one of two ways over the same steps:

- :func:`least_squares`: damped Gauss-Newton on the logs of priced over measured
  seconds, each parameter in a box searched in log space; a parameter that ends within
  a factor ten of its lower bound stands for none and is set to 0 (a fixed cost the
  steps do not call for drifts toward the bound without reaching it).
- :func:`grid_search`: the point of a grid with the least mean over groups of steps of
  their mean absolute relative error, searched block by block (each block's values
  against the best of the blocks before, the later blocks at their first values).

Both return a :class:`Fitted`: the cluster and each step's price on it, which
:mod:`~pipedsl.simulator.calibration.report` prints.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipedsl.simulator.hardware import Cluster

__all__ = ["Parameter", "Step", "Fitted", "least_squares", "grid_search", "group_error"]

_ROUNDS = 60
"""Most damped Gauss-Newton rounds (from a start near the answer they settle within about forty)."""


@dataclass(frozen=True, slots=True)
class Parameter:
    """A cluster field a fit varies: its name, unit, and the box it is searched in
    (``low`` and ``high`` > 0; :func:`least_squares` starts at ``start``). A ``fixed_cost``
    that ends within a factor ten of ``low`` is set to 0: the steps do not call for it."""

    name: str
    unit: str
    low: float
    high: float
    start: float
    fixed_cost: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    """One calibration step: ``name`` (what was measured), ``measured_s`` (seconds) and
    ``priced`` (the simulator's seconds of it on a cluster); for :func:`grid_search`,
    ``cluster`` names the cluster it ran on and ``group`` gathers steps whose errors are
    averaged first (a published source)."""

    name: str
    measured_s: float
    priced: Callable[[Cluster], float]
    group: str = ""
    cluster: str = ""


@dataclass(frozen=True, slots=True)
class Fitted:
    """A fit's result: the ``cluster``, the ``steps`` it was fitted to and each one's
    ``priced_s`` on it (seconds, in the steps' order), and the fields it fitted."""

    cluster: Cluster
    steps: tuple[Step, ...]
    priced_s: tuple[float, ...]
    fitted: tuple[str, ...]

    def errors(self) -> tuple[float, ...]:
        """(priced - measured) / measured of each step."""
        return tuple(p / s.measured_s - 1.0 for p, s in zip(self.priced_s, self.steps, strict=True))


def _at(base: Cluster, names: Sequence[str], values: Sequence[float]) -> Cluster:
    changes: dict[str, Any] = {n: float(v) for n, v in zip(names, values, strict=True)}
    return dataclasses.replace(base, **changes)


def _result(cluster: Cluster, steps: Sequence[Step], names: Sequence[str]) -> Fitted:
    return Fitted(cluster, tuple(steps), tuple(s.priced(cluster) for s in steps), tuple(names))


def least_squares(base: Cluster, parameters: Sequence[Parameter], steps: Sequence[Step]) -> Fitted:
    """``base`` with the ``parameters`` at which the ``steps`` are priced closest to as
    measured (module docstring); the other fields as ``base`` has them."""
    names = [p.name for p in parameters]
    low = np.log([p.low for p in parameters])
    high = np.log([p.high for p in parameters])
    measured = np.log([s.measured_s for s in steps])

    def residuals(x: np.ndarray) -> np.ndarray:
        cluster = _at(base, names, np.exp(x))
        return np.log([s.priced(cluster) for s in steps]) - measured

    x = np.clip(np.log([p.start for p in parameters]), low, high)
    r, damping = residuals(x), 1e-2
    for _ in range(_ROUNDS):
        jacobian = np.column_stack([(residuals(x + 1e-4 * unit) - r) / 1e-4 for unit in np.eye(len(x))])
        normal = jacobian.T @ jacobian
        step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -jacobian.T @ r)
        trial = np.clip(x + step, low, high)
        tried = residuals(trial)
        if tried @ tried < r @ r:
            done = r @ r - tried @ tried < 1e-12
            x, r, damping = trial, tried, damping / 3
            if done:
                break
        else:
            damping *= 4
    values = [
        0.0 if p.fixed_cost and v < lo + np.log(10) else float(np.exp(v))
        for p, v, lo in zip(parameters, x, low, strict=True)
    ]
    return _result(_at(base, names, values), steps, names)


def group_error(steps: Sequence[Step], clusters: Mapping[str, Cluster]) -> float:
    """The mean over the steps' groups of their mean absolute relative error, each step
    priced on its cluster of ``clusters``."""
    groups: dict[str, list[float]] = {}
    for s in steps:
        groups.setdefault(s.group, []).append(abs(s.priced(clusters[s.cluster]) / s.measured_s - 1.0))
    return sum(sum(e) / len(e) for e in groups.values()) / len(groups)


def grid_search(
    bases: Mapping[str, Cluster],
    grid: Mapping[str, Sequence[float]],
    blocks: Sequence[Sequence[str]],
    steps: Sequence[Step],
) -> tuple[dict[str, Cluster], float]:
    """The point of ``grid`` (field to values) with the least :func:`group_error` of
    ``steps`` on ``bases`` (named clusters that share the fit, as a GPU type's presets
    do) set to it: the fields of each of ``blocks`` searched together, the blocks in
    turn, later blocks at their first values, ties to the earlier point. Returns the
    clusters at that point and its error."""
    chosen = {name: values[0] for name, values in grid.items()}
    seen: dict[tuple[float, ...], float] = {}

    def at(point: dict[str, float]) -> dict[str, Cluster]:
        changes: dict[str, Any] = dict(point)
        return {n: dataclasses.replace(c, **changes) for n, c in bases.items()}

    def scored(point: dict[str, float]) -> float:
        key = tuple(point[n] for n in grid)
        if key not in seen:
            seen[key] = group_error(steps, at(point))
        return seen[key]

    for block in blocks:
        options = [
            chosen | dict(zip(block, values, strict=True)) for values in itertools.product(*(grid[n] for n in block))
        ]
        chosen = min(options, key=scored)
    return at(chosen), scored(chosen)
