"""The interpreter of one device's lowered program.

A :class:`DeviceRuntime` runs a :class:`pipedsl.program.DeviceProgram` for one step:
it owns the device's buffers by name (:class:`pipedsl.program.Buffer`), dispatches each
``Compute`` to the stage's compiled program (:class:`pipedsl.executor.stages.StageProgram`),
hands ``Send``/``Recv`` to a :class:`pipedsl.executor.transport.Transport`, drops each
buffer at its ``Free`` (its last use), and accumulates every local stage's parameter
gradients over the microbatches. It knows nothing of how devices are connected, so the
same runtime serves the local backend (one thread per device) and could live inside a
Ray actor.

The runtime also keeps the numbers tests and users check: the most (stage,
microbatch) pairs whose residuals were held at once, and any buffer still held at the
end of the step (there should be none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pipedsl.executor.errors import ExecutionError, stage_failure
from pipedsl.executor.stages import StageProgram
from pipedsl.executor.timing import Recorder
from pipedsl.executor.transport import Transport
from pipedsl.ir import Kind
from pipedsl.program import Buffer, BufferKind, Compute, DeviceProgram, Free, Recv, Send
from pipedsl.timeline import Event

__all__ = ["DeviceStep", "DeviceRuntime", "optimizer_update", "split_leading"]

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


class DeviceRuntime:
    """Runs ``program`` on ``device`` with the compiled ``stages`` it owns.

    ``recv_timeout`` bounds every wait for another device, in seconds.
    """

    __slots__ = ("program", "stages", "device", "recv_timeout")

    def __init__(
        self,
        program: DeviceProgram,
        stages: Mapping[int, StageProgram],
        *,
        device: jax.Device,
        recv_timeout: float,
    ) -> None:
        missing = sorted(set(program.stages) - set(stages))
        if missing:
            raise ExecutionError(
                f"device {program.device} has no compiled program for stages {missing}", device=program.device
            )
        self.program = program
        self.stages = {s: stages[s] for s in program.stages}
        self.device = device
        self.recv_timeout = recv_timeout

    def run_step(
        self,
        transport: Transport,
        params: Mapping[int, Leaves],
        inputs: Sequence[Leaves],
        targets: Sequence[Leaves],
        *,
        recorder: Recorder | None = None,
    ) -> DeviceStep:
        """Run the program once.

        ``params`` holds each local stage's parameter leaves (on this device);
        ``inputs[m]`` / ``targets[m]`` are microbatch m's input and target leaves, needed
        only where stage 0 / the last stage lives (pass ``()`` elsewhere). With a
        ``recorder``, every action and transfer is waited for and recorded.

        On failure the error names the device, the stage and the action; the transport
        is told first, so that no other device keeps waiting for this one.
        """
        state = _StepState(
            {s: prog.zero_grads(self.device) for s, prog in self.stages.items()},
            jnp.zeros((), jnp.float32, device=self.device) if self._has_last else None,
        )
        try:
            for instr in self.program.instructions:
                if isinstance(instr, Compute):
                    self._compute(instr, state, params, inputs, targets, recorder)
                elif isinstance(instr, Send):
                    self._send(instr, state, transport, recorder)
                elif isinstance(instr, Recv):
                    state.put(instr.buffer, transport.recv(instr.buffer, instr.peer, timeout=self.recv_timeout))
                elif isinstance(instr, Free):
                    state.drop(instr.buffer, self.program.device)
        except BaseException as err:
            transport.abort(err)
            raise
        return DeviceStep(
            grads=state.grads,
            loss=state.loss,
            peak_held=state.peak,
            leftover=tuple(state.buffers),
            events=tuple(recorder.events) if recorder is not None else (),
        )

    @property
    def _has_last(self) -> bool:
        return any(prog.last for prog in self.stages.values())

    def _send(self, instr: Send, state: _StepState, transport: Transport, recorder: Recorder | None) -> None:
        value = state.get(instr.buffer, self.program.device)
        if recorder is None:
            transport.send(instr.buffer, value, instr.peer)
            return
        start = recorder.now()
        transport.send(instr.buffer, value, instr.peer, wait=True)
        recorder.transfer(instr.buffer, instr.peer, start, recorder.now())

    def _compute(
        self,
        instr: Compute,
        state: _StepState,
        params: Mapping[int, Leaves],
        inputs: Sequence[Leaves],
        targets: Sequence[Leaves],
        recorder: Recorder | None,
    ) -> None:
        action = instr.action
        s, m = action.stage, action.microbatch
        prog = self.stages[s]
        device = self.program.device
        reads = [state.get(b, device) for b in instr.reads]
        start = recorder.now() if recorder is not None else 0.0
        try:
            if action.kind is Kind.F:
                x = reads[0] if reads else inputs[m]
                t, running = (targets[m], state.loss) if prog.last else ((), None)
                y, residuals, loss = prog.forward(params[s], x, t, running)
                outputs: tuple[Any, ...] = (residuals, y)
                if prog.last:
                    state.loss = loss
            elif action.kind is Kind.W:
                state.grads[s] = prog.backward_weight(reads[0], state.grads[s])
                outputs = ()
            else:
                ct = reads[1] if len(reads) > 1 else ()
                if action.kind is Kind.B:
                    input_cts, state.grads[s] = prog.backward(reads[0], ct, state.grads[s])
                    outputs = (input_cts,)
                else:
                    input_cts, handoff = prog.backward_input(reads[0], ct)
                    outputs = (input_cts, handoff)
            if recorder is not None:
                jax.block_until_ready((outputs, state.grads[s], state.loss))
        except ExecutionError:
            raise
        except Exception as err:  # anything a compiled stage raises, named by where it ran
            raise stage_failure(s, device, f"running {action}", err) from err
        # compute_io's order: F writes (residual, activation); B/I write the input
        # gradient (not on stage 0), then I writes the weight residual.
        written = outputs[1:] if action.kind is Kind.I and len(instr.writes) == 1 else outputs[: len(instr.writes)]
        for buffer, value in zip(instr.writes, written, strict=True):
            state.put(buffer, value)
        if recorder is not None:
            recorder.compute(action, start, recorder.now())


class _StepState:
    """One step's mutable state on one device: buffers, accumulators, the running loss."""

    __slots__ = ("buffers", "grads", "loss", "held", "peak")

    def __init__(self, grads: dict[int, Leaves], loss: Any) -> None:
        self.buffers: dict[Buffer, Any] = {}
        self.grads = grads
        self.loss = loss
        self.held: Counter[tuple[int, int]] = Counter()
        self.peak = 0

    def put(self, buffer: Buffer, value: Any) -> None:
        self.buffers[buffer] = value
        if buffer.kind in _HELD:
            self.held[(buffer.stage, buffer.microbatch)] += 1
            self.peak = max(self.peak, len(self.held))

    def get(self, buffer: Buffer, device: int) -> Any:
        try:
            return self.buffers[buffer]
        except KeyError:
            raise ExecutionError(
                f"device {device} needs {buffer}, which it does not hold (the program reads it "
                "before it is written or after it is freed)",
                stage=buffer.stage,
                device=device,
            ) from None

    def drop(self, buffer: Buffer, device: int) -> None:
        self.get(buffer, device)
        del self.buffers[buffer]
        if buffer.kind in _HELD:
            pair = (buffer.stage, buffer.microbatch)
            self.held[pair] -= 1
            if not self.held[pair]:
                del self.held[pair]


def _split_leading(leaf: jax.Array, count: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.split(leaf, count))


split_leading = jax.jit(_split_leading, static_argnums=1)
"""``split_leading(leaf, count)``: ``leaf`` cut into ``count`` equal microbatches along
axis 0, in one dispatch where the leaf lives (instead of one per microbatch)."""


@lru_cache(maxsize=16)
def optimizer_update(optimizer: optax.GradientTransformation) -> Any:
    """A jitted ``(grads, opt_state, params) -> (params, opt_state)`` for ``optimizer``.

    It runs wherever its arguments live, so each stage is updated on its own device.
    Compiled once per optimizer object: pass the same object every step.
    """

    def update(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # The gradients are the step's own accumulators, so they may be updated in place;
    # the state and parameters belong to the caller.
    return jax.jit(update, donate_argnums=0)
