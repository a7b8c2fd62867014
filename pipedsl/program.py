"""Lowering: from a schedule to one instruction list per device.

The lowered :class:`Program` is what both the simulator and the executor consume, so
that what is simulated is exactly what runs. Each device's list holds its compute
actions in schedule order plus the data movement they imply:

- a :class:`Send` right after the compute that produced a value another device needs,
  and a :class:`Recv` right before the compute that needs a value from another device;
- a :class:`Free` right after the last use of every buffer on a device.

Sends are buffered (the sender hands the value to the transport and goes on), so an
order of computes that admits an execution (checked by :mod:`pipedsl.validate`) cannot
deadlock once sends and receives are added this way.

Buffers (each one per (stage, microbatch)):

- ``ACTIVATION`` — the output of ``F`` on stage s, the input of ``F`` on stage s+1
  (the last stage has none: its ``F`` computes the loss);
- ``GRADIENT`` — the cotangent of stage s's input, produced by ``B``/``I`` on stage s
  and consumed by ``B``/``I`` on stage s-1 (stage 0 has none);
- ``RESIDUAL`` — what ``F`` keeps for the backward, freed by ``B`` or ``I``;
- ``WEIGHT_RESIDUAL`` — what ``I`` hands to ``W`` (the inputs and intermediate
  cotangents the weight gradient needs), freed by ``W``.

Parameter gradients are accumulated by every ``B`` and ``W`` into a per-stage
accumulator that lives for the whole step; it is not a buffer here.
"""

from __future__ import annotations

import enum
import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipedsl.ir import Action, Kind

if TYPE_CHECKING:
    from pipedsl.ir import Schedule

__all__ = [
    "BufferKind",
    "Buffer",
    "Compute",
    "Send",
    "Recv",
    "Free",
    "Instruction",
    "DeviceProgram",
    "Program",
    "lower",
    "compute_io",
]


class BufferKind(enum.Enum):
    ACTIVATION = "act"
    GRADIENT = "grad"
    RESIDUAL = "res"
    WEIGHT_RESIDUAL = "wres"


@dataclass(frozen=True, slots=True)
class Buffer:
    """A value named by what produced it: ``kind`` of ``stage`` for ``microbatch``."""

    kind: BufferKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}({self.stage},{self.microbatch})"


@dataclass(frozen=True, slots=True)
class Compute:
    """Run ``action``; it reads ``reads`` and writes ``writes`` (both in fixed order)."""

    action: Action
    reads: tuple[Buffer, ...]
    writes: tuple[Buffer, ...]

    def __str__(self) -> str:
        reads = " ".join(map(str, self.reads)) or "-"
        writes = " ".join(map(str, self.writes)) or "-"
        return f"{str(self.action):<8} reads {reads:<24} writes {writes}"


@dataclass(frozen=True, slots=True)
class Send:
    """Hand ``buffer`` to the transport for device ``peer``; does not wait for it."""

    buffer: Buffer
    peer: int

    def __str__(self) -> str:
        return f"send {self.buffer} -> device {self.peer}"


@dataclass(frozen=True, slots=True)
class Recv:
    """Wait for ``buffer`` from device ``peer``."""

    buffer: Buffer
    peer: int

    def __str__(self) -> str:
        return f"recv {self.buffer} <- device {self.peer}"


@dataclass(frozen=True, slots=True)
class Free:
    """Drop this device's reference to ``buffer`` (its last use has passed)."""

    buffer: Buffer

    def __str__(self) -> str:
        return f"free {self.buffer}"


Instruction = Compute | Send | Recv | Free


@dataclass(frozen=True, slots=True)
class DeviceProgram:
    """Device ``device``'s instructions, in the order it runs them."""

    device: int
    stages: tuple[int, ...]
    instructions: tuple[Instruction, ...]

    @property
    def computes(self) -> tuple[Compute, ...]:
        return tuple(i for i in self.instructions if isinstance(i, Compute))


@dataclass(frozen=True, slots=True)
class Program:
    """The lowered schedule: one :class:`DeviceProgram` per device."""

    schedule: Schedule
    devices: tuple[DeviceProgram, ...]

    @property
    def num_instructions(self) -> int:
        return sum(len(p.instructions) for p in self.devices)

    def format(self) -> str:
        """A readable listing, one block per device."""
        lines: list[str] = []
        for prog in self.devices:
            stages = ", ".join(map(str, prog.stages))
            lines.append(f"device {prog.device} (stages {stages}):")
            lines.extend(f"  {instr}" for instr in prog.instructions)
        return "\n".join(lines)


def compute_io(action: Action, num_stages: int) -> tuple[tuple[Buffer, ...], tuple[Buffer, ...]]:
    """The buffers ``action`` reads and writes, in the order the executor passes them.

    F reads the previous stage's activation and writes its residual, then its own
    activation; B reads its residual, then the next stage's gradient, and writes its
    input gradient; I is B plus the weight residual it writes last; W reads only the
    weight residual.
    """
    s, m = action.stage, action.microbatch
    last = num_stages - 1
    if action.kind is Kind.F:
        reads = (Buffer(BufferKind.ACTIVATION, s - 1, m),) if s > 0 else ()
        writes = (Buffer(BufferKind.RESIDUAL, s, m),)
        if s < last:
            writes += (Buffer(BufferKind.ACTIVATION, s, m),)
        return reads, writes
    if action.kind is Kind.W:
        return (Buffer(BufferKind.WEIGHT_RESIDUAL, s, m),), ()
    reads = (Buffer(BufferKind.RESIDUAL, s, m),)
    if s < last:
        reads += (Buffer(BufferKind.GRADIENT, s + 1, m),)
    writes = (Buffer(BufferKind.GRADIENT, s, m),) if s > 0 else ()
    if action.kind is Kind.I:
        writes += (Buffer(BufferKind.WEIGHT_RESIDUAL, s, m),)
    return reads, writes


def _consumer_stage(buffer: Buffer) -> int:
    """The stage whose compute reads ``buffer``."""
    if buffer.kind is BufferKind.ACTIVATION:
        return buffer.stage + 1
    if buffer.kind is BufferKind.GRADIENT:
        return buffer.stage - 1
    return buffer.stage


def lower(schedule: Schedule) -> Program:
    """Validate ``schedule``, then lower it to per-device programs (see module docstring)."""
    schedule.validate()
    # Lowering allocates millions of small acyclic objects for a large schedule; the
    # cyclic collector's passes over them find nothing and more than double the time
    # (262,144 actions: 7.1 s with it, 3.0 s without), so it is paused meanwhile.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _lower(schedule)
    finally:
        if collecting:
            gc.enable()


def _lower(schedule: Schedule) -> Program:
    placement = schedule.placement
    devices = []
    for device, order in enumerate(schedule.orders):
        instructions: list[Instruction] = []
        for action in order:
            reads, writes = compute_io(action, schedule.num_stages)
            for buf in reads:
                src = placement[buf.stage]
                if src != device:
                    instructions.append(Recv(buf, src))
            instructions.append(Compute(action, reads, writes))
            # Every buffer has exactly one reader, so a read is its last use here.
            instructions.extend(Free(buf) for buf in reads)
            for buf in writes:
                dst = placement[_consumer_stage(buf)]
                if dst != device:
                    instructions.append(Send(buf, dst))
                    instructions.append(Free(buf))
        devices.append(DeviceProgram(device, schedule.stages_on(device), tuple(instructions)))
    return Program(schedule, tuple(devices))
