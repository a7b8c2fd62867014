"""Measured timelines: when each action and transfer really ran.

A :class:`Recorder` collects one device's events during a step; the backend joins
every device's events into a :class:`pipedsl.timeline.Timeline` with origin
``"measured"``, the same record the simulator writes, so the two can be drawn side by
side and the cost model fitted to what was measured.

Recording changes how a step runs: JAX dispatches work asynchronously, so a call
returns before its result exists. To time an action the interpreter waits for its
outputs, so each device runs one action at a time (devices still overlap with each
other). An unrecorded step never waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from pipedsl.ir import Action
from pipedsl.program import Buffer
from pipedsl.timeline import Event, EventKind, Timeline

__all__ = ["Recorder", "measured_timeline"]


class Recorder:
    """One device's events, in seconds since ``origin`` on ``clock``.

    Every device of a step must share ``origin`` and ``clock`` (``time.perf_counter``
    within one process; a wall clock across processes).
    """

    __slots__ = ("device", "origin", "clock", "events")

    def __init__(self, device: int, origin: float, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = device
        self.origin = origin
        self.clock = clock
        self.events: list[Event] = []

    def now(self) -> float:
        """Seconds since the step's origin."""
        return self.clock() - self.origin

    def compute(self, action: Action, start: float, end: float) -> None:
        kind = EventKind(action.kind.value)
        self.events.append(Event(self.device, kind, action.stage, action.microbatch, start, end))

    def transfer(self, buffer: Buffer, peer: int, start: float, end: float) -> None:
        self.events.append(
            Event(
                self.device,
                EventKind.SEND,
                buffer.stage,
                buffer.microbatch,
                start,
                end,
                peer=peer,
                buffer=buffer.kind.value,
            )
        )


def measured_timeline(parts: Sequence[Iterable[Event]], *, name: str, num_devices: int) -> Timeline:
    """Every device's events as one measured :class:`Timeline`, ordered by start time."""
    events = sorted((e for part in parts for e in part), key=lambda e: (e.start, e.device))
    return Timeline.from_events(events, name=name, num_devices=num_devices, origin="measured")
