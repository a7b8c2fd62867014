"""The interpreter of one device's lowered program.

A :class:`DeviceRuntime` runs a :class:`pipedsl.program.DeviceProgram` for one step:
it owns the device's buffers by name (:class:`pipedsl.program.Buffer`), dispatches each
``Compute`` to the stage's compiled program (:class:`pipedsl.executor.stages.StageProgram`),
hands each ``Send`` to a :class:`pipedsl.executor.transport.Transport` and asks for each
``Recv`` by yielding a :class:`Receive` (so that one thread may run the programs of
several devices, switching where one has to wait: see :func:`drive`), drops each
buffer at its ``Free`` (its last use), and accumulates every local stage's parameter
gradients over the microbatches. It knows nothing of how devices are connected: the
:class:`pipedsl.executor.worker.Worker` of either backend runs it.

The runtime also keeps the numbers tests and users check: the most (stage,
microbatch) pairs whose residuals were held at once, and any buffer still held at the
end of the step (there should be none).
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from pipedsl.executor.errors import ExecutionError, stage_failure
from pipedsl.executor.stage_program import StageProgram
from pipedsl.executor.timing import Recorder
from pipedsl.executor.transport import Transport, finished
from pipedsl.ir import Kind
from pipedsl.program import Buffer, BufferKind, Compute, DeviceProgram, Free, Recv, Send
from pipedsl.timeline import Event

__all__ = ["Receive", "Computed", "Steps", "drive", "DeviceStep", "DeviceRuntime"]

Leaves = tuple[Any, ...]
_HELD = (BufferKind.RESIDUAL, BufferKind.WEIGHT_RESIDUAL)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Receive:
    """A device's request for ``key`` from device ``src``, answered with the value."""

    key: Hashable
    src: int


@dataclass(frozen=True, slots=True)
class Computed:
    """A device's request to wait until every array of ``value`` is computed (or has
    failed), answered with whether it was within the receive timeout."""

    value: Any


# A device's step as it runs: it yields what it waits for and returns its result.
Steps = Generator[Receive | Computed, Any, T]


def drive(steps: Steps[T], transport: Transport, *, timeout: float) -> T:
    """Run ``steps`` to the end on this thread, answering each request by waiting for
    it: a receive through ``transport``, a computation for at most ``timeout`` seconds.
    A failed wait is raised inside ``steps``, which report it to their peers."""
    try:
        request = next(steps)
        while True:
            try:
                if isinstance(request, Receive):
                    answer = transport.recv(request.key, request.src, timeout=timeout)
                else:
                    answer = finished(request.value, timeout)
            except BaseException as err:
                request = steps.throw(err)
                continue
            request = steps.send(answer)
    except StopIteration as done:
        return done.value


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """What one device's step produced.

    Attributes:
      grads: per local stage, its parameter gradients summed over microbatches (the
        loss is already divided by the number of microbatches, so this is the mean).
      loss: the mean loss over microbatches when the last stage is here, else None.
      peak_held: the most (stage, microbatch) pairs whose residuals (``RESIDUAL`` or
        ``WEIGHT_RESIDUAL``) this device held at once.
      leftover: buffers still held after the last instruction.
      events: the recorded events (empty unless recording).
    """

    grads: Mapping[int, Leaves]
    loss: Any
    peak_held: int
    leftover: tuple[Buffer, ...]
    events: tuple[Event, ...]


# Instruction codes of the compiled program (ints: no Enum compared or hashed per action).
_F, _B, _I, _W, _SEND, _RECV, _FREE = range(7)
_KIND_CODE = {Kind.F: _F, Kind.B: _B, Kind.I: _I, Kind.W: _W}


class DeviceRuntime:
    """Runs ``program`` with the compiled ``stages`` it owns (each on its stage mesh).

    ``recv_timeout`` bounds every wait for another device, in seconds. The program is
    compiled once into flat tuples over numbered buffer slots, so that a step costs
    little more than the JAX dispatches it makes.
    """

    __slots__ = ("program", "stages", "recv_timeout", "at", "_ops", "_buffers", "_held", "_last")

    def __init__(
        self,
        program: DeviceProgram,
        stages: Mapping[int, StageProgram],
        *,
        recv_timeout: float,
    ) -> None:
        missing = sorted(set(program.stages) - set(stages))
        if missing:
            raise ExecutionError(
                f"device {program.device} has no compiled program for stages {missing}", device=program.device
            )
        self.program = program
        self.stages = {s: stages[s] for s in program.stages}
        self.recv_timeout = recv_timeout
        # The index of the instruction being run, -1 outside a step's program: read by
        # another thread to say what a stalled device was doing.
        self.at = -1
        self._last = next((prog for prog in self.stages.values() if prog.last), None)
        slots: dict[Buffer, int] = {}

        def slot(buffer: Buffer) -> int:
            return slots.setdefault(buffer, len(slots))

        ops: list[tuple[Any, ...]] = []
        for instr in program.instructions:
            if isinstance(instr, Compute):
                a = instr.action
                code = _KIND_CODE[a.kind]
                reads = tuple(slot(b) for b in instr.reads)
                # compute_io's order: F writes (residual, activation); B/I write the input
                # gradient (not on stage 0), then I writes the weight residual.
                writes = tuple(slot(b) for b in instr.writes)
                skip = 1 if code == _I and len(writes) == 1 else 0
                ops.append((code, a, self.stages[a.stage], a.microbatch, reads, writes, skip))
            elif isinstance(instr, Send):
                ops.append((_SEND, instr.buffer, slot(instr.buffer), instr.peer))
            elif isinstance(instr, Recv):
                ops.append((_RECV, instr.buffer, slot(instr.buffer), instr.peer))
            elif isinstance(instr, Free):
                ops.append((_FREE, instr.buffer, slot(instr.buffer)))
        self._ops = tuple(ops)
        self._buffers = tuple(sorted(slots, key=slots.__getitem__))
        # Per slot, the (stage, microbatch) whose residuals it holds, else None.
        self._held = tuple((b.stage, b.microbatch) if b.kind in _HELD else None for b in self._buffers)

    def steps(
        self,
        transport: Transport,
        params: Mapping[int, Leaves],
        inputs: Sequence[Leaves],
        targets: Sequence[Leaves],
        *,
        recorder: Recorder | None = None,
    ) -> Steps[DeviceStep]:
        """Run the program once, yielding a :class:`Receive` for each ``Recv``.

        ``params`` holds each local stage's parameter leaves (placed on its mesh);
        ``inputs[m]`` / ``targets[m]`` are microbatch m's input and target leaves, needed
        only where stage 0 / the last stage lives (pass ``()`` elsewhere). With a
        ``recorder``, every action and transfer is waited for and recorded.

        On failure the error names the device, the stage and the action; the transport
        is told first, so that no other device keeps waiting for this one.
        """
        last = self._last
        loss = None if last is None else jax.device_put(jnp.zeros((), jnp.float32), last.layout.replicated)
        state = _StepState(len(self._buffers), {s: prog.zero_grads() for s, prog in self.stages.items()}, loss)
        try:
            for at, op in enumerate(self._ops):
                self.at = at
                code = op[0]
                if code <= _W:
                    self._compute(op, state, params, inputs, targets, recorder)
                elif code == _SEND:
                    self._send(op, state, transport, recorder)
                elif code == _RECV:
                    state.put(op[2], (yield Receive(op[1], op[3])), self._held[op[2]])
                else:
                    self._get(state, op[2])
                    state.drop(op[2], self._held[op[2]])
        except BaseException as err:
            transport.abort(err)
            raise
        self.at = -1
        return DeviceStep(
            grads=state.grads,
            loss=state.loss,
            peak_held=state.peak,
            leftover=tuple(b for b, v in zip(self._buffers, state.values, strict=True) if v is not _EMPTY),
            events=tuple(recorder.events) if recorder is not None else (),
        )

    def doing(self) -> str | None:
        """The instruction being run (as the lowered program writes it), None outside
        the program."""
        at = self.at
        return None if at < 0 else f"instruction {at} ({' '.join(str(self.program.instructions[at]).split())})"

    def _get(self, state: _StepState, slot: int) -> Any:
        value = state.values[slot]
        if value is _EMPTY:
            buffer = self._buffers[slot]
            device = self.program.device
            raise ExecutionError(
                f"device {device} needs {buffer}, which it does not hold (the program reads it "
                "before it is written or after it is freed)",
                stage=buffer.stage,
                device=device,
            )
        return value

    def _send(self, op: tuple[Any, ...], state: _StepState, transport: Transport, recorder: Recorder | None) -> None:
        _, buffer, slot, peer = op
        value = self._get(state, slot)
        if recorder is None:
            transport.send(buffer, value, peer, stage=buffer.stage)
            return
        start = recorder.now()
        transport.send(buffer, value, peer, stage=buffer.stage, wait=True)
        recorder.transfer(buffer, peer, start, recorder.now())

    def _compute(
        self,
        op: tuple[Any, ...],
        state: _StepState,
        params: Mapping[int, Leaves],
        inputs: Sequence[Leaves],
        targets: Sequence[Leaves],
        recorder: Recorder | None,
    ) -> None:
        code, action, prog, m, read_slots, write_slots, skip = op
        s = prog.stage
        reads = [self._get(state, r) for r in read_slots]
        start = recorder.now() if recorder is not None else 0.0
        try:
            if code == _F:
                x = reads[0] if reads else inputs[m]
                if prog.last:
                    _, residuals, state.loss = prog.forward(params[s], x, targets[m], state.loss)
                    outputs: tuple[Any, ...] = (residuals,)
                else:
                    y, residuals, _ = prog.forward(params[s], x, (), None)
                    outputs = (residuals, y)
            elif code == _W:
                state.grads[s] = prog.backward_weight(reads[0], state.grads[s])
                outputs = ()
            else:
                ct = reads[1] if len(reads) > 1 else ()
                if code == _B:
                    input_cts, state.grads[s] = prog.backward(reads[0], ct, state.grads[s])
                    outputs = (input_cts,)
                else:
                    outputs = prog.backward_input(reads[0], ct)
            if recorder is not None:
                jax.block_until_ready((outputs, state.grads[s], state.loss))
        except ExecutionError:
            raise
        except Exception as err:  # anything a compiled stage raises, named by where it ran
            raise stage_failure(s, self.program.device, f"running {action}", err) from err
        for slot, value in zip(write_slots, outputs[skip:], strict=False):
            state.put(slot, value, self._held[slot])
        if recorder is not None:
            recorder.compute(action, start, recorder.now())


_EMPTY = object()  # a slot that holds no value


class _StepState:
    """One step's mutable state on one device: buffer slots, accumulators, the running loss."""

    __slots__ = ("values", "grads", "loss", "held", "peak")

    def __init__(self, num_slots: int, grads: dict[int, Leaves], loss: Any) -> None:
        self.values: list[Any] = [_EMPTY] * num_slots
        self.grads = grads
        self.loss = loss
        self.held: dict[tuple[int, int], int] = {}
        self.peak = 0

    def put(self, slot: int, value: Any, held: tuple[int, int] | None) -> None:
        self.values[slot] = value
        if held is not None:
            self.held[held] = self.held.get(held, 0) + 1
            self.peak = max(self.peak, len(self.held))

    def drop(self, slot: int, held: tuple[int, int] | None) -> None:
        self.values[slot] = _EMPTY
        if held is not None:
            count = self.held[held] - 1
            if count:
                self.held[held] = count
            else:
                del self.held[held]
