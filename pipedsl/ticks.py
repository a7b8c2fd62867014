"""Ticks: a schedule run as one program over every pipeline device, all stepping together.

Where every pipeline device is a device of its own, the executor can run a whole step as
one SPMD program over the devices (:mod:`pipedsl.executor.local.ticked`): time is cut into
global *ticks*, and at each tick every device runs at most one action of its order. Values
move between devices between ticks, all at once. The tick of each action follows from two
rules:

- a device runs its actions in its order, one a tick: an action runs at least one tick
  after the action before it on its device;
- an action that needs a value another device produces runs at least one tick after the
  tick of that producer (the value moves at the end of the producer's tick).

Each action runs at the first tick both rules allow. This one table is what the executor
runs and what the simulator prices (:func:`pipedsl.simulator.tick_step_seconds`): a tick
lasts as long as its slowest action plus its transfers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pipedsl.errors import PipedslError
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.validate import checked, dependencies

__all__ = ["Transfer", "TickTable", "tick_table", "ticks_fit"]


def ticks_fit(*, pipeline_devices: int, devices_each: int, shared_devices: bool, shared_parameters: bool) -> bool:
    """Whether a step's pipeline devices can run it as one program over them, tick by tick:
    two or more pipeline devices, each one device of its own (``devices_each`` devices per
    pipeline device: a stage's own collectives would need a second manual mesh axis), none
    sharing its device with another; and no parameter used by two stages (its gradients
    are summed between devices, which only the update per task does). The executor adds
    what only a traced stage shows (:func:`pipedsl.executor.local.ticked.ticks_apply`)."""
    return pipeline_devices >= 2 and devices_each == 1 and not shared_devices and not shared_parameters


@dataclass(frozen=True, slots=True)
class Transfer:
    """A value that moves between devices at the end of the tick its ``producer`` runs:
    from device ``src`` to device ``dst``, where ``consumer`` needs it."""

    src: int
    dst: int
    producer: Action
    consumer: Action


@dataclass(frozen=True, slots=True)
class TickTable:
    """Which action each device runs at each tick, and what moves after each tick.

    Attributes:
      num_devices: D.
      actions: per tick, per device, the action it runs or None (idle); shape (T, D).
      transfers: per tick, the values that move at its end.
      tick_of: per device, the tick of each action of its order (in that order).
    """

    num_devices: int
    actions: tuple[tuple[Action | None, ...], ...]
    transfers: tuple[tuple[Transfer, ...], ...]
    tick_of: tuple[tuple[int, ...], ...]

    @property
    def num_ticks(self) -> int:
        return len(self.actions)

    def pairs(self, tick: int) -> tuple[tuple[int, int], ...]:
        """The (src, dst) device pairs of the values that move at the end of ``tick``."""
        return tuple((t.src, t.dst) for t in self.transfers[tick])


def tick_table(schedule: Schedule) -> TickTable:
    """The tick table of ``schedule`` (module docstring); the schedule is validated first
    (an invalid one raises :class:`pipedsl.errors.ScheduleInvalid`)."""
    checked(schedule)
    num_stages, devices = schedule.num_stages, schedule.num_devices
    split = {(a.stage, a.microbatch) for _, a in schedule.actions() if a.kind is Kind.I}
    where = {a.key: (d, k) for d, order in enumerate(schedule.orders) for k, a in enumerate(order)}
    ticks: list[list[int]] = [[] for _ in range(devices)]
    done: dict[tuple[Kind, int, int], int] = {}
    waiting: dict[tuple[Kind, int, int], list[int]] = {}
    ready = deque(range(devices))
    while ready:
        d = ready.popleft()
        mine = ticks[d]
        while len(mine) < len(schedule.orders[d]):
            next_action = schedule.orders[d][len(mine)]
            needs = dependencies(next_action, num_stages=num_stages, split=split)
            missing = next((key for key in needs if key not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(d)
                break
            at = max([mine[-1] + 1 if mine else 0, *(done[key] + 1 for key in needs)])
            mine.append(at)
            done[next_action.key] = at
            ready.extend(waiting.pop(next_action.key, ()))
    if any(len(ticks[d]) < len(schedule.orders[d]) for d in range(devices)):
        raise PipedslError(f"schedule {schedule.name!r}: its orders cannot all run, so it has no tick table")
    count = 1 + max((t[-1] for t in ticks if t), default=-1)
    grid: list[list[Action | None]] = [[None] * devices for _ in range(count)]
    moves: list[list[Transfer]] = [[] for _ in range(count)]
    for d, order in enumerate(schedule.orders):
        for action, tick in zip(order, ticks[d], strict=True):
            grid[tick][d] = action
            for key in dependencies(action, num_stages=num_stages, split=split):
                src, k = where[key]
                if src != d:
                    moves[done[key]].append(Transfer(src, d, schedule.orders[src][k], action))
    return TickTable(
        num_devices=devices,
        actions=tuple(tuple(row) for row in grid),
        transfers=tuple(tuple(sorted(m, key=lambda t: (t.src, t.dst))) for m in moves),
        tick_of=tuple(tuple(t) for t in ticks),
    )
