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

A lowered program is held as int arrays (:class:`ProgramArrays`: per compute, the
compute whose sent value it receives first and the device it sends to after); the
instruction objects are built from them only when asked for (:attr:`Program.devices`:
the executor, a printed listing). A program put together by hand from instruction
lists is encoded into the same arrays when the simulator asks for them.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pipedsl.arguments import schedule_argument
from pipedsl.arrays import ActionArrays, B, F, I, W, paused_collector
from pipedsl.errors import PipedslError
from pipedsl.ir import Action, Kind
from pipedsl.validate import checked

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
    "ProgramArrays",
    "Program",
    "lower",
    "program_arrays",
    "compute_io",
    "dispatch_order",
]


class BufferKind(enum.Enum):
    ACTIVATION = "act"
    GRADIENT = "grad"
    RESIDUAL = "res"
    WEIGHT_RESIDUAL = "wres"

    # Identity hashing, as for Kind: a buffer is a transport key, hashed on every send
    # and receive, and Enum's own __hash__ runs Python code.
    __hash__ = object.__hash__


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


NEVER_SENT = -2
"""In :attr:`ProgramArrays.recv_from`: the compute waits for a value no compute sends."""


@dataclass(frozen=True, slots=True, eq=False)
class ProgramArrays:
    """A program's computes and the transfers between them, as int arrays.

    Every compute receives at most one value from another device (its input from the
    neighbouring stage) right before it runs, and sends at most one (its output to the
    neighbouring stage) right after; frees do not take time.

    Attributes:
      actions: the computes, device by device in program order (N rows).
      recv_from: per compute, the row of the compute whose sent output it receives first;
        -1 when it receives nothing, :data:`NEVER_SENT` when no compute sends that value.
      send_to: per compute, the device its output is sent to after it runs; -1 for none.
    """

    actions: ActionArrays
    recv_from: np.ndarray
    send_to: np.ndarray


def dispatch_order(arrays: ProgramArrays) -> np.ndarray:
    """The computes' rows in the order one host thread dispatches them when a receive waits
    only until its value is sent, never until it is computed: the local backend's devices
    taking turns on one thread (``executor/local/cooperative.py``) where sends are asynchronous
    copies (meshes of several devices). Device 0 runs its program up to a receive of a value
    not sent yet, then the next device that can go on does, first come first served: at
    first devices 0, 1, ... in turn, then each device woken by a send, in the order sent,
    once the device that sent it stops. A device waiting for a value never sent stops for
    good. Shape (rows,), int64."""
    actions = arrays.actions
    bounds = actions.bounds.tolist()
    recv_from = arrays.recv_from.tolist()
    count = len(recv_from)
    pointer = bounds[:-1]
    sent = [False] * count
    parked: dict[int, int] = {}  # the row a stopped device waits for -> that device
    ready = deque(range(len(pointer)))
    order: list[int] = []
    while ready:
        d = ready.popleft()
        woken: list[int] = []
        while pointer[d] < bounds[d + 1]:
            row = pointer[d]
            source = recv_from[row]
            if source == NEVER_SENT:
                break
            if source >= 0 and not sent[source]:
                parked[source] = d
                break
            order.append(row)
            sent[row] = True
            pointer[d] = row + 1
            waiting = parked.pop(row, None)
            if waiting is not None:
                woken.append(waiting)
        ready.extend(woken)
    return np.array(order, dtype=np.int64)


@dataclass(frozen=True, slots=True, init=False, eq=False)
class Program:
    """The lowered schedule: one :class:`DeviceProgram` per device.

    ``Program(schedule, devices)`` holds instruction lists given by hand;
    :func:`lower` builds a program from arrays whose instruction lists are made on first
    use of :attr:`devices`.
    """

    schedule: Schedule
    _devices: tuple[DeviceProgram, ...] | None = field(repr=False)
    _arrays: ProgramArrays | None = field(repr=False)

    def __init__(
        self,
        schedule: Schedule,
        devices: tuple[DeviceProgram, ...] | None = None,
        *,
        arrays: ProgramArrays | None = None,
    ) -> None:
        if devices is None and arrays is None:
            raise TypeError("Program needs its device programs or its arrays")
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "_devices", None if devices is None else tuple(devices))
        object.__setattr__(self, "_arrays", arrays)

    @property
    def devices(self) -> tuple[DeviceProgram, ...]:
        """Per device, its instructions (built from the arrays on first use)."""
        if self._devices is None:
            with paused_collector():
                built = tuple(_device_program(self.schedule, d) for d in range(self.schedule.num_devices))
            object.__setattr__(self, "_devices", built)
        return self._devices  # type: ignore[return-value]

    @property
    def arrays(self) -> ProgramArrays:
        """The computes and transfers as arrays (encoded from the instructions on first use)."""
        if self._arrays is None:
            object.__setattr__(self, "_arrays", _encode(self.devices))
        return self._arrays  # type: ignore[return-value]

    @property
    def num_instructions(self) -> int:
        if self._devices is not None:
            return sum(len(p.instructions) for p in self._devices)
        arrays = self.arrays
        kind, stage = arrays.actions.kind, arrays.actions.stage
        last = self.schedule.num_stages - 1
        # F reads the previous stage's activation; B and I their residual and the next
        # stage's gradient; W its weight residual. Every read and every send is freed.
        reads = np.where(kind == F, stage > 0, 1 + ((kind != W) & (stage < last)))
        recvs = int(np.count_nonzero(arrays.recv_from >= 0))
        sends = int(np.count_nonzero(arrays.send_to >= 0))
        return len(kind) + recvs + int(reads.sum()) + 2 * sends

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
    reads: tuple[Buffer, ...]
    writes: tuple[Buffer, ...]
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
    schedule = schedule_argument(schedule, function="lower")
    found = checked(schedule)
    return Program(schedule, arrays=program_arrays(found.actions, found.upstream, schedule.placement))


def program_arrays(actions: ActionArrays, upstream: np.ndarray, placement: Sequence[int]) -> ProgramArrays:
    """The lowered program of valid ``actions``, as arrays: ``upstream`` is each action's
    input from the neighbouring stage (as :class:`~pipedsl.validate.Checked` has it),
    ``placement`` every stage's device."""
    num_stages = len(placement)
    where = np.asarray(placement, dtype=np.int64)
    kind, stage, device = actions.kind, actions.stage, actions.device
    # A compute receives its input from the neighbouring stage when that stage's device is another.
    source = np.where(upstream >= 0, device[np.maximum(upstream, 0)], device)
    recv_from = np.where(source != device, upstream, -1)
    # F sends its activation to stage s+1, B and I their input gradient to stage s-1.
    backward = (kind == B) | (kind == I)
    consumer = np.where(kind == F, stage + 1, stage - 1)
    produces = np.where(kind == F, stage < num_stages - 1, backward & (stage > 0))
    target = where[np.clip(consumer, 0, num_stages - 1)]
    send_to = np.where(produces & (target != device), target, -1)
    return ProgramArrays(actions, recv_from, send_to)


def _device_program(schedule: Schedule, device: int) -> DeviceProgram:
    """Device ``device``'s instruction list (see the module docstring for its form)."""
    placement = schedule.placement
    instructions: list[Instruction] = []
    for action in schedule.orders[device]:
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
    return DeviceProgram(device, schedule.stages_on(device), tuple(instructions))


def _crossing_input(action: Action) -> Buffer | None:
    """The buffer ``action`` reads from the neighbouring stage (None for ``W``): the
    previous stage's activation for ``F``, the next stage's gradient for ``B``/``I``."""
    s, m = action.stage, action.microbatch
    if action.kind is Kind.F:
        return Buffer(BufferKind.ACTIVATION, s - 1, m)
    if action.kind is Kind.W:
        return None
    return Buffer(BufferKind.GRADIENT, s + 1, m)


def _crossing_output(action: Action) -> Buffer | None:
    s, m = action.stage, action.microbatch
    if action.kind is Kind.F:
        return Buffer(BufferKind.ACTIVATION, s, m)
    if action.kind is Kind.W:
        return None
    return Buffer(BufferKind.GRADIENT, s, m)


def _unsupported(device: int, index: int, instruction: Instruction, why: str) -> PipedslError:
    return PipedslError(
        f"device {device}, instruction {index} ({instruction}): {why}; the simulator runs programs in which "
        "each compute receives at most its input from the neighbouring stage just before it and sends at "
        "most its output just after it, as pipedsl.program.lower builds them"
    )


def _encode(devices: Sequence[DeviceProgram]) -> ProgramArrays:
    """:class:`ProgramArrays` of instruction lists given by hand (devices in list order)."""
    orders: list[list[Action]] = []
    received: list[Buffer | None] = []
    sent_to: list[int] = []
    sender: dict[Buffer, int] = {}
    for d, prog in enumerate(devices):
        order: list[Action] = []
        pending: Recv | None = None
        for index, ins in enumerate(prog.instructions):
            if isinstance(ins, Recv):
                if pending is not None:
                    raise _unsupported(d, index, ins, "a second receive before one compute")
                pending = ins
            elif isinstance(ins, Compute):
                if pending is not None and pending.buffer != _crossing_input(ins.action):
                    raise _unsupported(d, index, ins, f"it does not read {pending.buffer} from the neighbouring stage")
                order.append(ins.action)
                received.append(None if pending is None else pending.buffer)
                sent_to.append(-1)
                pending = None
            elif isinstance(ins, Send):
                row = len(sent_to) - 1
                if not order or sent_to[row] >= 0 or ins.buffer != _crossing_output(order[-1]):
                    raise _unsupported(d, index, ins, "it does not send the output of the compute just before it")
                sent_to[row] = ins.peer
                sender[ins.buffer] = row
        if pending is not None:
            raise _unsupported(d, len(prog.instructions) - 1, pending, "no compute follows the receive")
        orders.append(order)
    recv_from = [-1 if buf is None else sender.get(buf, NEVER_SENT) for buf in received]
    return ProgramArrays(
        ActionArrays.of_orders(orders), np.array(recv_from, dtype=np.int64), np.array(sent_to, dtype=np.int64)
    )
