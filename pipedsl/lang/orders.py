"""Where a device body's actions go as it runs: :class:`~pipedsl.ir.Action` objects, or
int columns without them.

The compiled closures hand the evaluator's :class:`~pipedsl.lang.budget.Run` one action at
a time (``append``) and a vectorised loop's actions as columns (``extend``). An
:class:`ActionList` keeps objects, with their source positions, for a
:class:`~pipedsl.ir.Schedule`; an :class:`ActionCodes` keeps only kind codes, stages and
microbatches, for a :class:`~pipedsl.arrays.ScheduleArrays` (the plan search evaluates
thousands of shapes and never needs the objects).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipedsl.arrays import KIND_CODE, ActionArrays, make_actions
from pipedsl.errors import SourcePos
from pipedsl.ir import Action, Kind
from pipedsl.lang.budget import Columns

__all__ = ["ActionCodes", "ActionList", "DeviceOutput", "Orders", "collected", "most_microbatch"]


class ActionList:
    """One device's actions as :class:`Action` objects, in order."""

    def __init__(self) -> None:
        self.actions: list[Action] = []

    def append(self, kind: Kind, stage: int, microbatch: int, pos: SourcePos | None) -> None:
        self.actions.append(Action(kind, stage, microbatch, pos))

    def extend(self, columns: Columns) -> None:
        self.actions.extend(make_actions(*columns))


class ActionCodes:
    """One device's actions as int columns (kind code, stage, microbatch), in order."""

    def __init__(self) -> None:
        self.kinds: list[int] = []
        self.stages: list[int] = []
        self.microbatches: list[int] = []

    def append(self, kind: Kind, stage: int, microbatch: int, pos: SourcePos | None) -> None:
        """One action (no object is made for it; its position is not kept)."""
        self.kinds.append(KIND_CODE[kind])
        self.stages.append(stage)
        self.microbatches.append(microbatch)

    def extend(self, columns: Columns) -> None:
        kinds, stages, microbatches, _ = columns
        self.kinds.extend(map(KIND_CODE.__getitem__, kinds))
        self.stages.extend(stages)
        self.microbatches.extend(microbatches)


DeviceOutput = ActionList | ActionCodes
Orders = tuple[tuple[Action, ...], ...]
"""Every device's actions as objects, in order."""


def collected(outputs: Sequence[DeviceOutput], *, objects: bool) -> Orders | ActionArrays:
    """Every device's output, all of the kind ``objects`` says: the orders from
    :class:`ActionList`\\ s, their columns from :class:`ActionCodes`."""
    if objects:
        return tuple(tuple(out.actions) for out in outputs if isinstance(out, ActionList))
    codes = [out for out in outputs if isinstance(out, ActionCodes)]
    return ActionArrays.of_columns([o.kinds for o in codes], [o.stages for o in codes], [o.microbatches for o in codes])


def most_microbatch(found: Orders | ActionArrays) -> int:
    """The largest microbatch index in what :func:`collected` gave; -1 when there is no action."""
    if isinstance(found, ActionArrays):
        return int(found.microbatch.max(initial=-1))
    return max((a.microbatch for order in found for a in order), default=-1)
