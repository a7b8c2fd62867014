"""The schedule IR: what every front end produces and every consumer reads.

A :class:`Schedule` says how many stages, devices and microbatches there are, which
device owns each stage, and the ordered list of :class:`Action` each device runs.
Text (``.sched``), PyTorch's CSV and JSON all become this one form; validation,
lowering, the simulator and the executor all start from it.

Actions use PyTorch pipelining's vocabulary and spelling: ``F`` forward, ``B`` full
backward, ``I`` backward for the input gradient only, ``W`` backward for the weight
gradient only; ``2F0`` is the forward of microbatch 0 on stage 2.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from pipedsl.errors import SourcePos

__all__ = ["Kind", "Action", "Schedule", "parse_action"]


class Kind(enum.Enum):
    """What an action computes for one (stage, microbatch)."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - PyTorch's letter for the input-gradient half
    W = "W"

    # Members are singletons, so identity hashing is exact; Enum's own __hash__ runs
    # Python code on every dict lookup, which dominated validating large schedules.
    __hash__ = object.__hash__

    @property
    def is_backward(self) -> bool:
        return self is not Kind.F


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work: ``kind`` on ``microbatch`` of ``stage``.

    ``pos`` is where the action came from in a source text; it is not part of the
    action's identity (two actions with the same kind, stage and microbatch are equal).
    """

    kind: Kind
    stage: int
    microbatch: int
    pos: SourcePos | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @property
    def key(self) -> tuple[Kind, int, int]:
        """(kind, stage, microbatch): a hashable identity without the position."""
        return (self.kind, self.stage, self.microbatch)


def _count(n: int, noun: str, suffix: str = "s") -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{suffix}"


_ACTION_RE = re.compile(r"^\s*(\d{1,18})\s*([FBIW])\s*(\d{1,18})\s*$")


def parse_action(text: str, *, pos: SourcePos | None = None) -> Action | None:
    """Read ``{stage}{kind}{microbatch}`` (``2F0``, ``5I3``); None if ``text`` is not one."""
    match = _ACTION_RE.match(text)
    if match is None:
        return None
    stage, kind, microbatch = match.groups()
    return Action(Kind(kind), int(stage), int(microbatch), pos)


@dataclass(frozen=True, slots=True, repr=False)
class Schedule:
    """A complete pipeline schedule for one training step.

    Attributes:
      name: the schedule's name (from the source, or the file stem).
      num_stages: number of pipeline stages S; stages are numbered 0..S-1 from the
        model's input to its loss.
      num_devices: number of pipeline devices D; devices are numbered 0..D-1.
      num_microbatches: number of microbatches M the step's batch is split into.
      placement: ``placement[s]`` is the device that owns stage ``s`` (length S).
      orders: ``orders[d]`` is device ``d``'s actions in execution order (length D).
      params: the integer parameters the schedule was evaluated with, in source order.
      source: the file the schedule came from, or None.

    A schedule is plain data: :func:`pipedsl.validate` checks it and :func:`pipedsl.lower`
    lowers it; this module imports neither. Validation keeps what it derived (the int-coded
    actions and their dependencies, a :class:`~pipedsl.validate.Checked`) in a private
    slot, so that validating, lowering and simulating one schedule build them once; it is
    no part of the schedule's identity and :func:`dataclasses.replace` starts a copy
    without it.
    """

    name: str
    num_stages: int
    num_devices: int
    num_microbatches: int
    placement: tuple[int, ...]
    orders: tuple[tuple[Action, ...], ...]
    params: tuple[tuple[str, int], ...] = ()
    source: str | None = None
    # Typed as object so that the IR needs nothing of the validator; only
    # pipedsl.validate reads or writes it.
    _checked: object | None = field(default=None, init=False, repr=False, compare=False)

    def __repr__(self) -> str:
        # A summary: the orders of a real schedule run to thousands of actions.
        params = ", ".join(f"{k}={v}" for k, v in self.params)
        source = f", source={self.source!r}" if self.source is not None else ""
        return (
            f"<Schedule {self.name}({params}): {_count(self.num_stages, 'stage')} on"
            f" {_count(self.num_devices, 'device')}, {_count(self.num_microbatches, 'microbatch', 'es')},"
            f" {_count(self.num_actions, 'action')}{source}>"
        )

    @property
    def num_actions(self) -> int:
        return sum(len(order) for order in self.orders)

    @property
    def parameters(self) -> Mapping[str, int]:
        return dict(self.params)

    def stages_on(self, device: int) -> tuple[int, ...]:
        """The stages device ``device`` owns, in increasing order."""
        return tuple(s for s, d in enumerate(self.placement) if d == device)

    def actions(self) -> Iterator[tuple[int, Action]]:
        """Every (device, action) pair, device by device, each in execution order."""
        for device, order in enumerate(self.orders):
            for action in order:
                yield device, action

    @property
    def splits_backward(self) -> bool:
        """Whether any action is an ``I`` or ``W`` (the zero-bubble split)."""
        return any(a.kind in (Kind.I, Kind.W) for _, a in self.actions())

    def format_grid(self) -> str:
        """The per-device orders as a text grid, one row per device."""
        width = max((len(str(a)) for _, a in self.actions()), default=1)
        rows = []
        for device, order in enumerate(self.orders):
            cells = " ".join(str(a).rjust(width) for a in order)
            rows.append(f"device {device}: {cells}")
        return "\n".join(rows)
