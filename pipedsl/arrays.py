"""Int-coded actions: a schedule's actions as flat integer columns.

Validation, lowering, analysis and the simulator all work on these columns rather than
on one object per action: a schedule of a million actions is a handful of numpy arrays,
built once per evaluated schedule. The frozen :class:`~pipedsl.ir.Action` objects stay
the source of truth for positions in the source text; :meth:`ActionArrays.action`
fetches one when an error has to point at it. A caller that only validates and times
a schedule (the plan search, thousands of them) can have it evaluated straight into
these columns, a :class:`ScheduleArrays`, without an object per action; an error found
there names the action without its place in the file.

Kinds are coded in :class:`~pipedsl.ir.Kind`'s declaration order: 0 ``F``, 1 ``B``,
2 ``I``, 3 ``W`` (the same codes as :class:`~pipedsl.timeline.EventKind`'s computes).
"""

from __future__ import annotations

import dataclasses
import gc
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter

import numpy as np

from pipedsl.errors import SourcePos
from pipedsl.ir import Action, Kind, Schedule

__all__ = ["F", "B", "I", "W", "KIND_CODE", "ActionArrays", "ScheduleArrays", "make_actions", "paused_collector"]

F, B, I, W = 0, 1, 2, 3  # noqa: E741 - PyTorch's letters
KIND_CODE: dict[Kind, int] = {kind: code for code, kind in enumerate(Kind)}
"""Kind to its int code (0 F, 1 B, 2 I, 3 W)."""
_KINDS = tuple(Kind)

_stage = attrgetter("stage")
_microbatch = attrgetter("microbatch")
_kind = attrgetter("kind")


@dataclass(frozen=True, slots=True, eq=False)
class ActionArrays:
    """Every action of a schedule (or of a program's computes), device by device, each
    device in execution order.

    Attributes:
      kind: int8 codes (0 F, 1 B, 2 I, 3 W), shape (N,).
      stage, microbatch: int64, shape (N,).
      device: the device that runs the action, int64, shape (N,).
      position: the action's index in its device's order, int64, shape (N,).
      bounds: device d's actions are rows ``bounds[d]:bounds[d + 1]``, int64, shape (D + 1,).
    """

    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    device: np.ndarray
    position: np.ndarray
    bounds: np.ndarray

    @classmethod
    def of_orders(cls, orders: Sequence[Sequence[Action]]) -> ActionArrays:
        """The columns of per-device orders of actions (one pass over the objects)."""
        flat = list(chain.from_iterable(orders))
        count = len(flat)
        kind = np.fromiter(map(KIND_CODE.__getitem__, map(_kind, flat)), dtype=np.int8, count=count)
        stage = np.fromiter(map(_stage, flat), dtype=np.int64, count=count)
        microbatch = np.fromiter(map(_microbatch, flat), dtype=np.int64, count=count)
        return cls._device_by_device(kind, stage, microbatch, list(map(len, orders)))

    @classmethod
    def of_arrays(
        cls, kinds: Sequence[np.ndarray], stages: Sequence[np.ndarray], microbatches: Sequence[np.ndarray]
    ) -> ActionArrays:
        """The columns of per-device arrays of kind codes (int8), stages and microbatches
        (int64): device d's actions in order are ``kinds[d]``, ``stages[d]``, ``microbatches[d]``."""
        lengths = [len(s) for s in stages]
        if not lengths:
            empty = np.zeros(0, dtype=np.int64)
            return cls._device_by_device(np.zeros(0, dtype=np.int8), empty, empty, lengths)
        kind = np.concatenate(kinds).astype(np.int8, copy=False)
        stage = np.concatenate(stages).astype(np.int64, copy=False)
        microbatch = np.concatenate(microbatches).astype(np.int64, copy=False)
        return cls._device_by_device(kind, stage, microbatch, lengths)

    @classmethod
    def _device_by_device(
        cls, kind: np.ndarray, stage: np.ndarray, microbatch: np.ndarray, lengths: list[int]
    ) -> ActionArrays:
        """The flat columns of every device's actions in turn, device d's ``lengths[d]`` long."""
        counts = np.array(lengths, dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        device = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
        position = np.arange(len(kind), dtype=np.int64) - np.repeat(bounds[:-1], counts)
        return cls(kind, stage, microbatch, device, position, bounds)

    @classmethod
    def of(cls, schedule: Schedule) -> ActionArrays:
        """The columns of ``schedule``'s orders."""
        return cls.of_orders(schedule.orders)

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    @property
    def num_devices(self) -> int:
        return int(self.bounds.shape[0]) - 1

    def action(self, schedule: Schedule | ScheduleArrays, row: int) -> Action:
        """The :class:`Action` object of ``row``: ``schedule``'s own, with its source
        position; made from the columns, without one, for a :class:`ScheduleArrays`."""
        if isinstance(schedule, ScheduleArrays):
            return Action(_KINDS[int(self.kind[row])], int(self.stage[row]), int(self.microbatch[row]), None)
        return schedule.orders[int(self.device[row])][int(self.position[row])]

    def text(self, row: int) -> str:
        """``row``'s action in ``{stage}{kind}{microbatch}`` form (``2F0``)."""
        return f"{int(self.stage[row])}{'FBIW'[int(self.kind[row])]}{int(self.microbatch[row])}"


@dataclass(frozen=True, slots=True, eq=False)
class ScheduleArrays:
    """A schedule evaluated straight into int columns (:func:`pipedsl.lang.evaluate.evaluate_arrays`):
    what a :class:`~pipedsl.ir.Schedule` says, its orders as :attr:`actions` instead of
    one :class:`Action` object each, so without source positions. Validated by
    :func:`pipedsl.validate.checked` like a Schedule; an error then names the action
    without its place in the file.
    """

    name: str
    num_stages: int
    num_devices: int
    num_microbatches: int
    placement: tuple[int, ...]
    actions: ActionArrays
    params: tuple[tuple[str, int], ...] = ()
    source: str | None = None

    @property
    def num_actions(self) -> int:
        return len(self.actions)

    def stages_on(self, device: int) -> tuple[int, ...]:
        """The stages device ``device`` owns, in increasing order."""
        return tuple(s for s, d in enumerate(self.placement) if d == device)

    @property
    def splits_backward(self) -> bool:
        """Whether any action is an ``I`` or ``W`` (the zero-bubble split), as
        :attr:`Schedule.splits_backward <pipedsl.ir.Schedule.splits_backward>` says."""
        return bool((self.actions.kind >= 2).any())

    @classmethod
    def of(cls, schedule: Schedule) -> ScheduleArrays:
        """``schedule``'s columns (for one read from a CSV or JSON file)."""
        return cls(
            name=schedule.name,
            num_stages=schedule.num_stages,
            num_devices=schedule.num_devices,
            num_microbatches=schedule.num_microbatches,
            placement=schedule.placement,
            actions=ActionArrays.of(schedule),
            params=schedule.params,
            source=schedule.source,
        )


# Action's fields in declaration order, each set through its slot's descriptor. A frozen
# dataclass's __init__ is a Python call with one object.__setattr__ per field, which
# took most of a large schedule's loading; these are C calls, a column at a time, that
# leave the same objects.
_SETTERS = tuple(getattr(Action, f.name).__set__ for f in dataclasses.fields(Action))


def make_actions(
    kinds: Sequence[Kind], stages: Sequence[int], microbatches: Sequence[int], poses: Sequence[SourcePos | None]
) -> list[Action]:
    """``[Action(k, s, m, p) for k, s, m, p in zip(...)]``, made column by column; the
    four columns have one length."""
    made = list(map(object.__new__, repeat(Action, len(stages))))
    for setter, column in zip(_SETTERS, (kinds, stages, microbatches, poses), strict=True):
        deque(map(setter, made, column), maxlen=0)
    return made


@contextmanager
def paused_collector() -> Iterator[None]:
    """Pause the cyclic garbage collector for a pass that allocates many acyclic objects.

    The collector's passes over millions of young lists, floats and frozen dataclasses
    find nothing to free and cost more than the pass itself; reference counting still
    frees everything as usual.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
