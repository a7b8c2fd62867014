"""The interpreter of one device's lowered program.

A :class:`DeviceRuntime` runs a :class:`pipedsl.program.DeviceProgram` for one step:
it owns the device's buffers by name (:class:`pipedsl.program.Buffer`), dispatches each
task (:mod:`pipedsl.tasks`: a run of consecutive computes with nothing sent or received
between them) as one program, a task of one compute as the stage's own compiled program
(:class:`pipedsl.executor.stages.stage_program.StageProgram`), a longer one as one jitted
program of its computes, compiled once for every task of the same computes on other
microbatches; it hands each ``Send`` to a :class:`pipedsl.executor.runtime.transport.Transport`
and asks for each ``Recv`` by yielding a :class:`~pipedsl.executor.runtime.scheduler.Receive`
(so that one thread may run the programs of several devices, switching where one has to
wait: :mod:`pipedsl.executor.runtime.scheduler`), drops each buffer at its ``Free`` (its
last use), and accumulates every local stage's parameter gradients over the microbatches.
A recorded step dispatches every compute apart, to time it. It knows nothing of how
devices are connected: the :class:`pipedsl.executor.runtime.worker.Worker` of either
backend runs it.

The runtime also keeps the numbers tests and users check: the most (stage,
microbatch) pairs whose residuals were held at once, and any buffer still held at the
end of the step (there should be none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax

from pipedsl.executor.errors import ExecutionError, stage_failure
from pipedsl.executor.runtime.scheduler import Computed, Receive, Steps
from pipedsl.executor.runtime.timing import Recorder
from pipedsl.executor.runtime.transport import Transport
from pipedsl.executor.stages.stage_program import StageProgram
from pipedsl.ir import Kind
from pipedsl.program import Buffer, BufferKind, Compute, DeviceProgram, Free, Instruction, Recv, Send
from pipedsl.tasks import device_tasks
from pipedsl.timeline import Event

__all__ = ["DeviceStep", "DeviceRuntime"]

Leaves = tuple[Any, ...]
_HELD = (BufferKind.RESIDUAL, BufferKind.WEIGHT_RESIDUAL)


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

    __slots__ = (
        "program", "stages", "recv_timeout", "at", "_plain", "_tasks", "_buffers", "_held", "_num_held", "_last",
        "_fused",
    )  # fmt: skip

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
        # Every instruction on its own (a recorded step), and the same with each task of
        # several computes as one op (numbered by its first instruction).
        self._plain = tuple(self._compile(instr, slots) for instr in program.instructions)
        self._fused: dict[Any, Callable[..., Any]] = {}  # the jitted program of each task's computes, by their form
        tasks: list[tuple[int, _Op]] = []
        for start, stop in device_tasks(program):
            computes = [i for i in range(start, stop) if isinstance(program.instructions[i], Compute)]
            first, last = computes[0], computes[-1]
            tasks.extend((i, self._plain[i]) for i in range(start, first))
            if first == last:
                tasks.append((first, self._plain[first]))
            else:
                tasks.append((first, self._task(first, last + 1, slots)))
            tasks.extend((i, self._plain[i]) for i in range(last + 1, stop))
        self._tasks = tuple(tasks)

    def steps(
        self,
        transport: Transport,
        params: Mapping[int, Leaves],
        inputs: Sequence[Leaves],
        targets: Sequence[Leaves],
        *,
        recorder: Recorder | None = None,
        begin: tuple[Mapping[int, Leaves], Any] | None = None,
    ) -> Steps[DeviceStep]:
        """Run the program once, yielding a :class:`Receive` for each ``Recv``.

        ``params`` holds each local stage's parameter leaves (placed on its mesh);
        ``inputs[m]`` / ``targets[m]`` are microbatch m's input and target leaves, needed
        only where stage 0 / the last stage lives (pass ``()`` elsewhere). ``begin`` is
        (every local stage's zero gradient accumulator, the last stage's zero running loss
        or None), made already; None makes them here. With a ``recorder``, every action and
        transfer is waited for and recorded (an action's wait is yielded as a
        :class:`Computed`).

        On failure the error names the device, the stage and the action; the transport
        is told first, so that no other device keeps waiting for this one.
        """
        last = self._last
        state = _StepState(self, transport, params, inputs, targets, recorder)
        if begin is None:
            state.grads = {s: prog.zero_grads() for s, prog in self.stages.items()}
            state.loss = None if last is None else last.zero_loss()
        else:
            state.grads = dict(begin[0])
            state.loss = begin[1]
        ops = enumerate(self._plain) if recorder is not None else self._tasks
        try:
            for at, op in ops:
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

    @property
    def last_stage(self) -> StageProgram | None:
        """The last stage's program where this device holds it, else None."""
        return self._last

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

    def _task(self, start: int, stop: int, slots: Mapping[Buffer, int]) -> _Run:
        """The computes of instructions ``start:stop`` (with the frees between them) as one op
        that dispatches one program: its inputs are the buffers the computes read that none
        of them wrote, its outputs the buffers they write that outlive the task. The program
        is traced from the computes' own calls (:data:`_CALLS`) over buffers numbered in the
        task, so tasks of the same computes on other microbatches share it."""
        instructions = self.program.instructions[start:stop]
        local: dict[int, int] = {}  # slot -> its number in the task
        inputs: list[int] = []  # slots read before any compute of the task writes them
        forms: list[tuple[Any, ...]] = []  # per compute: (kind, stage, its F's number, reads, writes)
        effects: list[tuple[bool, tuple[tuple[int, int | None], ...]]] = []  # in order: (compute?, (slot, pair))
        batch: list[int] = []  # per F of the task, its microbatch (for the batch's leaves)
        stages: dict[int, None] = {}
        for instr in instructions:
            if isinstance(instr, Free):
                slot = slots[instr.buffer]
                effects.append((False, ((slot, self._held[slot]),)))
                continue
            assert isinstance(instr, Compute)  # a task's computes have only frees between them
            reads = []
            for b in instr.reads:
                slot = slots[b]
                if slot not in local:
                    local[slot] = len(local)
                    inputs.append(slot)
                reads.append(local[slot])
            writes = []
            for b in instr.writes:
                slot = slots[b]
                local.setdefault(slot, len(local))
                writes.append(local[slot])
            action = instr.action
            number = None
            if action.kind is Kind.F:
                number = len(batch)
                batch.append(action.microbatch)
            stages[action.stage] = None
            forms.append((action.kind, action.stage, number, tuple(reads), tuple(writes)))
            effects.append((True, tuple((slots[b], self._held[slots[b]]) for b in instr.writes)))
        freed = {slot for compute, pairs in effects if not compute for slot, _ in pairs}
        written = [slot for compute, pairs in effects if compute for slot, _ in pairs]
        outputs = tuple(slot for slot in written if slot not in freed)
        accumulating = tuple(s for s in stages if any(f[1] == s and f[0] is not Kind.F for f in forms))
        losing = self._last is not None and any(f[0] is Kind.F and f[1] == self._last.stage for f in forms)
        key = (tuple(forms), tuple(local[slot] for slot in inputs), tuple(local[slot] for slot in outputs),
               accumulating, losing)  # fmt: skip
        fused = self._fused.get(key)
        if fused is None:
            fused = self._fused[key] = self._fuse(forms, len(local), key=key)
        param_stages = tuple(stages)
        first_stage = 0 in stages
        last_stage = self._last is not None and self._last.stage in stages
        outs_at = {slot: k for k, slot in enumerate(outputs)}
        device = self.program.device
        names = "+".join(str(instr.action) for instr in instructions if isinstance(instr, Compute))
        lead = next(instr.action.stage for instr in instructions if isinstance(instr, Compute))

        def run(state: _StepState) -> None:
            ins = tuple(state.read(slot) for slot in inputs)
            xs = tuple(state.inputs[m] for m in batch) if first_stage else ()
            ts = tuple(state.targets[m] for m in batch) if last_stage else ()
            params = tuple(state.params[s] for s in param_stages)
            grads = tuple(state.grads[s] for s in accumulating)
            try:
                outs, grads, loss = fused(params, grads, state.loss if losing else None, ins, xs, ts)
            except ExecutionError:
                raise
            except Exception as err:  # anything a compiled stage raises, named by where it ran
                raise stage_failure(lead, device, f"running {names}", err) from err
            for s, g in zip(accumulating, grads, strict=True):
                state.grads[s] = g
            if losing:
                state.loss = loss
            # Buffers written and freed inside the task hold a mark while they live, so
            # that the residuals held at once are counted as one compute at a time would.
            for compute, pairs in effects:
                for slot, pair in pairs:
                    if compute:
                        state.hold(slot, outs[outs_at[slot]] if slot in outs_at else _INSIDE, pair)
                    else:
                        state.values[slot] = _EMPTY
                        if pair is not None:
                            state.release(pair)

        return run

    def _fuse(self, forms: Sequence[tuple[Any, ...]], count: int, *, key: Any) -> Callable[..., Any]:
        """The jitted program of a task's computes (``forms``, over ``count`` buffers numbered
        in the task; ``key`` says which are given and which are returned): ``(params per
        stage, accumulators per accumulating stage, running loss, inputs, batch inputs per F,
        batch targets per F) -> (outputs, accumulators, loss)``; the accumulators and the loss
        are donated."""
        _, inputs, outputs, accumulating, losing = key
        calls = [_CALLS[kind](self.stages[stage], number, reads, writes, (None,) * len(writes))
                 for kind, stage, number, reads, writes in forms]  # fmt: skip
        stage_order = tuple(dict.fromkeys(form[1] for form in forms))

        def program(params: Any, grads: Any, loss: Any, ins: Any, xs: Any, ts: Any) -> Any:
            state = _Traced(count, dict(zip(stage_order, params, strict=True)), xs, ts)
            for k, value in zip(inputs, ins, strict=True):
                state.values[k] = value
            state.grads = dict(zip(accumulating, grads, strict=True))
            state.loss = loss
            for call in calls:
                call(state)
            return tuple(state.values[k] for k in outputs), tuple(state.grads[s] for s in accumulating), state.loss

        return jax.jit(program, donate_argnums=(1, 2) if losing else (1,))


def _buffers_of(instr: Instruction) -> tuple[Buffer, ...]:
    if isinstance(instr, Compute):
        return (*instr.reads, *instr.writes)
    return (instr.buffer,)


class _State(Protocol):
    """What the calls of :data:`_CALLS` read and write: a step's state (:class:`_StepState`),
    or a task's while its program is traced (:class:`_Traced`)."""

    values: list[Any]
    params: Mapping[int, Leaves]
    inputs: Sequence[Any]
    targets: Sequence[Any]
    grads: dict[int, Any]
    loss: Any

    def read(self, slot: int) -> Any: ...

    def hold(self, slot: int, value: Any, counted: int | None) -> None: ...


# The calls of each action kind: made once per instruction from its stage program, its
# microbatch and its slots (reads and writes in compute_io's order, and per write the
# residual pair it holds); each runs the stage program on the step's state, writes its
# outputs, and returns what they are (for a recorded step to wait for).
_Call = Callable[[_State], Any]
_Slots = tuple[int, ...]
_Held = tuple[int | None, ...]


def _forward(prog: StageProgram, m: int, reads: _Slots, writes: _Slots, held: _Held) -> _Call:
    # F writes (residual, activation); on the last stage only the residual, and the
    # running loss instead of an activation.
    forward, s = prog.forward, prog.stage
    read = reads[0] if reads else None
    residual, counted = writes[0], held[0]
    if prog.last:

        def last(state: _State) -> Any:
            x = state.inputs[m] if read is None else state.read(read)
            _, residuals, state.loss = forward(state.params[s], x, state.targets[m], state.loss)
            state.hold(residual, residuals, counted)
            return residuals

        return last
    activation = writes[1] if len(writes) > 1 else None

    def run(state: _State) -> Any:
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

    def run(state: _State) -> Any:
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

    def run(state: _State) -> Any:
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

    def run(state: _State) -> Any:
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
_INSIDE = object()  # a slot whose value lives inside a task's program only


class _Traced:
    """A task's buffers, parameters and accumulators while its program is traced: what the
    computes' calls (:data:`_CALLS`) read and write, with nothing counted."""

    __slots__ = ("values", "params", "inputs", "targets", "grads", "loss")

    def __init__(self, count: int, params: Mapping[int, Leaves], inputs: Sequence[Any], targets: Sequence[Any]) -> None:
        self.values: list[Any] = [None] * count
        self.params = params
        self.inputs = inputs
        self.targets = targets
        self.grads: dict[int, Any] = {}
        self.loss: Any = None

    def read(self, slot: int) -> Any:
        return self.values[slot]

    def hold(self, slot: int, value: Any, counted: int | None) -> None:
        self.values[slot] = value


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
        self.grads: dict[int, Leaves] = {}
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
