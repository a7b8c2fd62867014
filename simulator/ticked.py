"""The price of a step run as one program over the pipeline devices, tick by tick.

Where every pipeline device is a device of its own and the executor runs the step as one
SPMD program (:mod:`pipedsl.ticks`, :mod:`pipedsl.executor.local.ticked`), the devices
step together: a tick ends when its slowest action has, then that tick's values move
between devices, all at once. So a step takes the sum over ticks of the slowest action of
the tick plus the slowest of its transfers, plus one dispatch for the whole program
(``dispatch``, charged once, not per task). Where devices share compute (``speedup``), the
actions of a tick run ``speedup[n - 1]`` times as fast as priced when n of them run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipedsl.ir import Kind
from pipedsl.stage_costs import StageCosts
from pipedsl.ticks import TickTable

__all__ = ["TickTiming", "tick_timing"]


@dataclass(frozen=True, slots=True)
class TickTiming:
    """A step priced tick by tick.

    Attributes:
      makespan: seconds of the step, the one dispatch included.
      bubble_ratio: ``1 - busy / (devices x makespan)``.
      ticks: seconds of each tick (its slowest action, then its slowest transfer), shape (T,).
    """

    makespan: float
    bubble_ratio: float
    ticks: np.ndarray


def tick_timing(table: TickTable, costs: StageCosts) -> TickTiming:
    """The step of ``table`` under ``costs`` (resolved for its schedule), as the module
    docstring prices it."""
    seconds = {Kind.F: costs.forward, Kind.B: costs.backward, Kind.I: costs.input_grad, Kind.W: costs.weight_grad}
    ticks = np.zeros(table.num_ticks)
    busy = 0.0
    for t, row in enumerate(table.actions):
        running = [seconds[a.kind][a.stage] for a in row if a is not None]
        if not running:
            continue
        pace = 1.0 if costs.speedup is None else costs.speedup[len(running) - 1]
        moved = [
            costs.activation_transfer[m.producer.stage]
            if m.producer.kind is Kind.F
            else costs.gradient_transfer[m.producer.stage]
            for m in table.transfers[t]
        ]
        ticks[t] = max(running) / pace + max(moved, default=0.0)
        busy += sum(running) / pace
    makespan = float(ticks.sum()) + costs.dispatch
    bubble = 0.0 if makespan <= 0 else 1.0 - busy / (table.num_devices * makespan)
    return TickTiming(makespan=makespan, bubble_ratio=bubble, ticks=ticks)
