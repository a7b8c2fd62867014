"""The interpreter of one device's lowered program.

A :class:`DeviceRuntime` runs a :class:`pipedsl.program.DeviceProgram` for one step:
it owns the device's buffers by name (:class:`pipedsl.program.Buffer`), dispatches each
``Compute`` to the stage's compiled program (:class:`pipedsl.executor.stages.model.StageProgram`),
hands each ``Send`` to a :class:`pipedsl.executor.runtime.transport.Transport` and asks for each
``Recv`` by yielding a :class:`Receive` (so that one thread may run the programs of
several devices, switching where one has to wait: see :func:`drive`), drops each
buffer at its ``Free`` (its last use), and accumulates every local stage's parameter
gradients over the microbatches. It knows nothing of how devices are connected: the
:class:`pipedsl.executor.runtime.worker.Worker` of either backend runs it.

The runtime also keeps the numbers tests and users check: the most (stage,
microbatch) pairs whose residuals were held at once, and any buffer still held at the
end of the step (there should be none).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jax

from pipedsl.executor.errors import ExecutionError, stage_failure
from pipedsl.executor.runtime.timing import Recorder
from pipedsl.executor.runtime.transport import Transport
from pipedsl.executor.runtime.waits import finished
from pipedsl.executor.stages.stage_program import StageProgram
from pipedsl.ir import Kind
from pipedsl.program import Buffer, BufferKind, Compute, DeviceProgram, Instruction, Recv, Send
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


# A compiled instruction: a function of the step's state, or a receive (the request it
# yields, answered with the value for the slot it names, and the residual pair that slot
# holds, if any).
_Run = Callable[["_StepState"], None]
_Op = _Run | tuple[Receive, int, int | None]


class DeviceRuntime:
    """Runs ``program`` with the compiled ``stages`` it owns (each on its stage mesh).

    ``recv_timeout`` bounds every wait for another device, in seconds. The program is
    compiled once into a flat tuple of small functions over numbered buffer slots (and
    the receives it yields, made once), so that a step costs little more than the JAX
    dispatches it makes: no instruction is decoded and no Enum compared or hashed per step.
    """

    __slots__ = ("program", "stages", "recv_timeout", "at", "_ops", "_buffers", "_held", "_num_held", "_last")

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
        for instr in program.instructions:
            for buffer in _buffers_of(instr):
                slots.setdefault(buffer, len(slots))
        self._buffers = tuple(slots)
        # Per slot, the number of the (stage, microbatch) whose residuals it holds, else None.
        pairs: dict[tuple[int, int], int] = {}
        self._held = tuple(
            pairs.setdefault((b.stage, b.microbatch), len(pairs)) if b.kind in _HELD else None for b in self._buffers
        )
        self._num_held = len(pairs)
        self._ops = tuple(self._compile(instr, slots) for instr in program.instructions)

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
        ``recorder``, every action and transfer is waited for and recorded (an action's wait
        is yielded as a :class:`Computed`).

        On failure the error names the device, the stage and the action; the transport
        is told first, so that no other device keeps waiting for this one.
        """
        last = self._last
        state = _StepState(self, transport, params, inputs, targets, recorder)
        state.loss = None if last is None else last.zero_loss()
        try:
            for at, op in enumerate(self._ops):
                self.at = at
                if isinstance(op, tuple):
                    request, slot, counted = op
                    state.hold(slot, (yield request), counted)
                else:
                    op(state)
                    timed = state.timed
                    if timed is not None:  # recording: the action's outputs, waited for here
                        state.timed = None
                        timed[1]((yield Computed(timed[0])))
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

    def _missing(self, slot: int) -> ExecutionError:
        """The error of reading the buffer of ``slot`` while it holds no value."""
        buffer = self._buffers[slot]
        device = self.program.device
        return ExecutionError(
            f"device {device} needs {buffer}, which it does not hold (the program reads it "
            "before it is written or after it is freed)",
            stage=buffer.stage,
            device=device,
        )

    def _compile(self, instr: Instruction, slots: Mapping[Buffer, int]) -> _Op:
        if isinstance(instr, Compute):
            return self._compute(instr, slots)
        slot = slots[instr.buffer]
        if isinstance(instr, Recv):
            return (Receive(instr.buffer, instr.peer), slot, self._held[slot])
        if isinstance(instr, Send):
            return _send(instr.buffer, slot, instr.peer)
        return _free(slot, self._held[slot])

    def _compute(self, instr: Compute, slots: Mapping[Buffer, int]) -> _Run:
        """``instr`` as a function of the step's state: its stage program's call (one of
        :func:`_forward`, :func:`_backward`, :func:`_input`, :func:`_weight`), whose
        failure is raised as the stage's, timed and waited for when recording."""
        action = instr.action
        prog = self.stages[action.stage]
        reads = tuple(slots[b] for b in instr.reads)
        writes = tuple(slots[b] for b in instr.writes)
        held = tuple(self._held[w] for w in writes)
        make = _CALLS[action.kind]
        call = make(prog, action.microbatch, reads, writes, held)
        stage, device, what = action.stage, self.program.device, f"running {action}"

        def run(state: _StepState) -> None:
            recorder = state.recorder
            try:
                if recorder is None:
                    call(state)
                    return
                start = recorder.now()
                outputs = (call(state), state.grads[stage], state.loss)
            except ExecutionError:
                raise
            except Exception as err:  # anything a compiled stage raises, named by where it ran
                raise stage_failure(stage, device, what, err) from err

            def done(in_time: bool) -> None:
                # Yielded (not waited for here), so that one thread running several
                # devices goes on with the others meanwhile, as it does unrecorded.
                end = recorder.now()
                if not in_time:
                    raise ExecutionError(
                        f"device {device}: {action} did not finish within {state.runtime.recv_timeout:g} s "
                        "(recv_timeout)",
                        stage=stage,
                        device=device,
                    )
                try:
                    jax.block_until_ready(outputs)
                except Exception as err:  # a failed computation is reported where it is read
                    raise stage_failure(stage, device, what, err) from err
                recorder.compute(action, start, end)

            state.timed = (outputs, done)

        return run


def _buffers_of(instr: Instruction) -> tuple[Buffer, ...]:
    if isinstance(instr, Compute):
        return (*instr.reads, *instr.writes)
    return (instr.buffer,)


# The calls of each action kind: made once per instruction from its stage program, its
# microbatch and its slots (reads and writes in compute_io's order, and per write the
# residual pair it holds); each runs the stage program on the step's state, writes its
# outputs, and returns what they are (for a recorded step to wait for).
_Call = Callable[["_StepState"], Any]
_Slots = tuple[int, ...]
_Held = tuple[int | None, ...]


def _forward(prog: StageProgram, m: int, reads: _Slots, writes: _Slots, held: _Held) -> _Call:
    # F writes (residual, activation); on the last stage only the residual, and the
    # running loss instead of an activation.
    forward, s = prog.forward, prog.stage
    read = reads[0] if reads else None
    residual, counted = writes[0], held[0]
    if prog.last:

        def last(state: _StepState) -> Any:
            x = state.inputs[m] if read is None else state.read(read)
            _, residuals, state.loss = forward(state.params[s], x, state.targets[m], state.loss)
            state.hold(residual, residuals, counted)
            return residuals

        return last
    activation = writes[1] if len(writes) > 1 else None

    def run(state: _StepState) -> Any:
        x = state.inputs[m] if read is None else state.read(read)
        y, residuals, _ = forward(state.params[s], x, (), None)
        state.hold(residual, residuals, counted)
        if activation is not None:
            state.values[activation] = y
        return residuals, y

    return run


def _backward(prog: StageProgram, m: int, reads: _Slots, writes: _Slots, held: _Held) -> _Call:
    # B reads (residual, output gradient; none on the last stage) and writes the input
    # gradient (none on stage 0).
    backward, s = prog.backward, prog.stage
    residual, ct = reads[0], (reads[1] if len(reads) > 1 else None)
    out = writes[0] if writes else None

    def run(state: _StepState) -> Any:
        residuals = state.read(residual)
        cts = () if ct is None else state.read(ct)
        input_cts, state.grads[s] = backward(residuals, cts, state.grads[s])
        if out is not None:
            state.hold(out, input_cts, held[0])
        return input_cts

    return run


def _input(prog: StageProgram, m: int, reads: _Slots, writes: _Slots, held: _Held) -> _Call:
    # I reads what B reads and writes the input gradient (none on stage 0), then the
    # weight residual W reads.
    backward_input = prog.backward_input
    residual, ct = reads[0], (reads[1] if len(reads) > 1 else None)
    out = writes[0] if len(writes) > 1 else None
    handed, counted = writes[-1], held[-1]

    def run(state: _StepState) -> Any:
        residuals = state.read(residual)
        cts = () if ct is None else state.read(ct)
        input_cts, handoff = backward_input(residuals, cts)
        if out is not None:
            state.hold(out, input_cts, held[0])
        state.hold(handed, handoff, counted)
        return input_cts, handoff

    return run


def _weight(prog: StageProgram, m: int, reads: _Slots, writes: _Slots, held: _Held) -> _Call:
    backward_weight, s = prog.backward_weight, prog.stage
    handed = reads[0]

    def run(state: _StepState) -> Any:
        state.grads[s] = backward_weight(state.read(handed), state.grads[s])
        return ()

    return run


_CALLS = {Kind.F: _forward, Kind.B: _backward, Kind.I: _input, Kind.W: _weight}


def _send(buffer: Buffer, slot: int, peer: int) -> _Run:
    stage = buffer.stage

    def run(state: _StepState) -> None:
        value = state.read(slot)
        recorder = state.recorder
        if recorder is None:
            state.transport.send(buffer, value, peer, stage=stage)
            return
        start = recorder.now()
        state.transport.send(buffer, value, peer, stage=stage, wait=True)
        recorder.transfer(buffer, peer, start, recorder.now())

    return run


def _free(slot: int, counted: int | None) -> _Run:
    def run(state: _StepState) -> None:
        values = state.values
        if values[slot] is _EMPTY:  # freeing a buffer that is not held is the program's error
            raise state.runtime._missing(slot)
        values[slot] = _EMPTY
        if counted is not None:
            state.release(counted)

    return run


_EMPTY = object()  # a slot that holds no value


class _StepState:
    """One step's state on one device: what it runs on (parameters, microbatches, the
    transport, the recorder), its buffer slots, accumulators and running loss, and how
    many (stage, microbatch) pairs hold residuals (per pair, how many of its slots)."""

    __slots__ = (
        "runtime", "transport", "params", "inputs", "targets", "recorder",
        "values", "grads", "loss", "counts", "live", "peak", "timed",
    )  # fmt: skip

    def __init__(
        self,
        runtime: DeviceRuntime,
        transport: Transport,
        params: Mapping[int, Leaves],
        inputs: Sequence[Leaves],
        targets: Sequence[Leaves],
        recorder: Recorder | None,
    ) -> None:
        self.runtime = runtime
        self.transport = transport
        self.params = params
        self.inputs = inputs
        self.targets = targets
        self.recorder = recorder
        self.values: list[Any] = [_EMPTY] * len(runtime._buffers)
        self.grads = {s: prog.zero_grads() for s, prog in runtime.stages.items()}
        self.loss: Any = None
        self.counts = [0] * runtime._num_held
        self.live = 0
        self.peak = 0
        # A recorded action's outputs and what to do once they are computed (or not in
        # time): set by the action, taken by DeviceRuntime.steps, which yields the wait.
        self.timed: tuple[Any, Callable[[bool], None]] | None = None

    def read(self, slot: int) -> Any:
        value = self.values[slot]
        if value is _EMPTY:
            raise self.runtime._missing(slot)
        return value

    def hold(self, slot: int, value: Any, counted: int | None) -> None:
        """Write ``slot``; ``counted`` is the residual pair it holds, if any."""
        self.values[slot] = value
        if counted is not None:
            count = self.counts[counted]
            self.counts[counted] = count + 1
            if not count:
                self.live += 1
                self.peak = max(self.peak, self.live)

    def release(self, counted: int) -> None:
        count = self.counts[counted] - 1
        self.counts[counted] = count
        if not count:
            self.live -= 1
