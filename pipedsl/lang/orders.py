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
from itertools import compress

import numpy as np

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
        iterations = len(columns.stages) // max(len(columns.kinds), 1)
        kinds, poses = columns.kinds * iterations, columns.poses * iterations
        stages, microbatches = columns.stages, columns.microbatches
        if columns.keep is not None:
            flags = columns.keep.tolist()
            kinds, poses = tuple(compress(kinds, flags)), tuple(compress(poses, flags))
            stages, microbatches = stages[columns.keep], microbatches[columns.keep]
        self.actions.extend(make_actions(kinds, stages.tolist(), microbatches.tolist(), poses))


class ActionCodes:
    """One device's actions as int columns (kind code, stage, microbatch), in order: the
    actions emitted one at a time gathered in lists, a vectorised loop's kept as arrays."""

    def __init__(self) -> None:
        self.kinds: list[int] = []
        self.stages: list[int] = []
        self.microbatches: list[int] = []
        # Every stretch of actions before the current one, as (kind codes, stages, microbatches).
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def append(self, kind: Kind, stage: int, microbatch: int, pos: SourcePos | None) -> None:
        """One action (no object is made for it; its position is not kept)."""
        self.kinds.append(KIND_CODE[kind])
        self.stages.append(stage)
        self.microbatches.append(microbatch)

    def extend(self, columns: Columns) -> None:
        self._close()
        iterations = len(columns.stages) // max(len(columns.kinds), 1)
        codes = np.tile(np.array([KIND_CODE[kind] for kind in columns.kinds], dtype=np.int8), iterations)
        if columns.keep is None:
            self.parts.append((codes, columns.stages, columns.microbatches))
        else:
            keep = columns.keep
            self.parts.append((codes[keep], columns.stages[keep], columns.microbatches[keep]))

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kind codes (int8), stages and microbatches (int64) of every action, in order."""
        self._close()
        if not self.parts:
            return np.zeros(0, dtype=np.int8), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if len(self.parts) == 1:
            return self.parts[0]
        kinds, stages, microbatches = zip(*self.parts, strict=True)
        return np.concatenate(kinds), np.concatenate(stages), np.concatenate(microbatches)

    def _close(self) -> None:
        """The actions emitted one at a time since the last stretch, as a stretch of their own."""
        if self.kinds:
            self.parts.append((
                np.array(self.kinds, dtype=np.int8), np.array(self.stages, dtype=np.int64),
                np.array(self.microbatches, dtype=np.int64),
            ))  # fmt: skip
            self.kinds, self.stages, self.microbatches = [], [], []


DeviceOutput = ActionList | ActionCodes
Orders = tuple[tuple[Action, ...], ...]
"""Every device's actions as objects, in order."""


def collected(outputs: Sequence[DeviceOutput], *, objects: bool) -> Orders | ActionArrays:
    """Every device's output, all of the kind ``objects`` says: the orders from
    :class:`ActionList`\\ s, their columns from :class:`ActionCodes`."""
    if objects:
        return tuple(tuple(out.actions) for out in outputs if isinstance(out, ActionList))
    columns = [out.columns() for out in outputs if isinstance(out, ActionCodes)]
    return ActionArrays.of_arrays([c[0] for c in columns], [c[1] for c in columns], [c[2] for c in columns])


def most_microbatch(found: Orders | ActionArrays) -> int:
    """The largest microbatch index in what :func:`collected` gave; -1 when there is no action."""
    if isinstance(found, ActionArrays):
        return int(found.microbatch.max(initial=-1))
    return max((a.microbatch for order in found for a in order), default=-1)
