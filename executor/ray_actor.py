"""The Ray backend's device actor: one pipeline device, its stages and its state.

A :class:`DeviceActor` lives in its own Ray worker process (threaded: several method
calls run at once) and holds, for every pipeline that uses it:

- the stages it owns, traced and compiled here from the model the driver shipped once
  (compiled stages are cached per model, so pipelines of one model reuse them);
- a :class:`~pipedsl.executor.interpreter.DeviceRuntime` for its lowered program;
- the parameter leaves its stages use and the optimizer state of the leaves it owns,
  resident across steps.

One driver call, :meth:`DeviceActor.run_step`, runs a whole step on the device: the
program, then the sum of shared parameters' gradients on their owner, then (when
training) a barrier, the optimizer update and the hand-out of updated shared
parameters. Everything between devices travels actor to actor through a
:class:`RayTransport` (the driver sees none of it): a send is a ``deliver`` call on the
peer actor, which runs in another of the peer's threads and wakes the receive waiting in
its :class:`Mailbox`. The barrier makes an optimizer step all or nothing: no device
updates its parameters unless every device finished its program, so a step that fails
leaves the resident state as it was and can be retried.

Values travel as numpy arrays through Ray's object store (a copy to host and back);
a device-to-device path on GPUs would be another :class:`~pipedsl.executor.transport.Transport`.

``ray`` is imported inside the methods that need it: this module is also imported by
the driver before it connects (see :mod:`pipedsl.executor.ray_cluster`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax

from pipedsl.executor.errors import ExecutionError, PeerFailed, stage_failure
from pipedsl.executor.interpreter import DeviceRuntime, optimizer_update, split_leading
from pipedsl.executor.split import marked_model
from pipedsl.executor.stages import StagedModel, StageProgram, compile_stage, explicit_model
from pipedsl.executor.timing import Recorder
from pipedsl.program import Buffer, DeviceProgram
from pipedsl.timeline import Event

__all__ = ["ModelSpec", "Update", "StepReport", "Failure", "Mailbox", "RayTransport", "DeviceActor", "trace_model"]

Leaves = tuple[Any, ...]
# Compiled models kept per actor (least recently used dropped beyond this many).
_PLAN_CACHE_SIZE = 16


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything an actor needs to trace and compile its stages (shipped once).

    ``stages`` (explicit stage functions) or ``model_fn`` (marked) is set; ``params`` is
    the parameters' pytree of ``jax.ShapeDtypeStruct``; ``inputs``/``targets`` one
    microbatch, likewise.
    """

    stages: tuple[Any, ...] | None
    model_fn: Any
    loss: Any
    params: Any
    inputs: Any
    targets: Any
    num_microbatches: int
    placement: tuple[int, ...]
    remat: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class Update:
    """The optimizer step that follows a step's program.

    ``optimizer`` is sent the first time an actor meets ``optimizer_id`` (then None);
    ``init`` starts the optimizer state afresh.
    """

    optimizer_id: int
    optimizer: optax.GradientTransformation | None
    init: bool


@dataclass(frozen=True, slots=True)
class StepReport:
    """One device's step, as the driver gets it back.

    ``loss`` is the mean loss when the last stage is here (numpy scalar), else None;
    ``grads`` maps every flat leaf this device owns to its summed gradient (numpy),
    only when the driver asked for gradients.
    """

    loss: np.ndarray | None
    grads: Mapping[int, np.ndarray]
    peak_held: int
    leftover: tuple[Buffer, ...]
    events: tuple[Event, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """A device's step failed: the message, the stage to blame (if one is), whether it
    only gave up because another device failed, and whether it had already applied its
    optimizer update (the resident state is then no longer consistent)."""

    message: str
    stage: int | None
    device: int
    peer: bool
    updated: bool


class Mailbox:
    """Values and failures that arrive at one actor, by step.

    A step's values wait here until its receives take them; entries of earlier steps are
    dropped when a step begins (late deliveries of an aborted step). Keys are ``(source
    device, key)``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._step = -1
        self._mail: dict[tuple[int, int, Hashable], Any] = {}
        self._failed: dict[int, str] = {}

    def begin(self, step: int) -> None:
        with self._cond:
            self._step = step
            self._mail = {k: v for k, v in self._mail.items() if k[0] >= step}
            self._failed = {s: m for s, m in self._failed.items() if s >= step}

    def put(self, step: int, src: int, key: Hashable, value: Any) -> None:
        with self._cond:
            if step >= self._step:
                self._mail[(step, src, key)] = value
                self._cond.notify_all()

    def fail(self, step: int, message: str) -> None:
        with self._cond:
            self._failed.setdefault(step, message)
            self._cond.notify_all()

    def take(self, step: int, src: int, key: Hashable, *, me: int, what: str, timeout: float) -> Any:
        """The value ``key`` from device ``src``, waiting at most ``timeout`` seconds."""
        slot = (step, src, key)
        with self._cond:
            arrived = self._cond.wait_for(lambda: slot in self._mail or step in self._failed, timeout=timeout)
            if slot in self._mail:
                return self._mail.pop(slot)
            if not arrived:
                raise ExecutionError(
                    f"device {me} waited {timeout:g} s for {what} from device {src}, which never sent "
                    "it; raise recv_timeout if stages really take that long",
                    device=me,
                )
            raise PeerFailed(f"device {me} stopped waiting for {what} from device {src}: {self._failed[step]}", device=me)


class RayTransport:
    """Device ``device``'s end of the links for one step (implements
    :class:`~pipedsl.executor.transport.Transport`): sends are ``deliver`` calls on the
    peer actors, receives wait in this actor's :class:`Mailbox`.

    A send returns at once: a sender thread waits for the value to be computed, copies
    it to host memory and hands it to Ray, so the device goes on dispatching its next
    actions meanwhile. The thread keeps the order of sends; :meth:`finish` waits for it
    at the end of the program, and a value whose computation failed is reported as its
    stage's failure. Recorded sends (``wait=True``) stay synchronous, to be timed.
    """

    __slots__ = ("device", "step", "_mailbox", "_peers", "_timeout", "_aborted", "_queue", "_sender", "_error")

    def __init__(self, device: int, step: int, mailbox: Mailbox, peers: Sequence[Any], *, timeout: float) -> None:
        self.device = device
        self.step = step
        self._mailbox = mailbox
        self._peers = peers
        self._timeout = timeout
        self._aborted = False
        self._queue: queue.SimpleQueue[tuple[Buffer, Any, int] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._error: ExecutionError | None = None

    def send(self, buffer: Buffer, value: Any, dst: int, *, wait: bool = False) -> None:
        if self._error is not None:
            raise self._error
        if wait:
            self.post(buffer, value, dst, stage=buffer.stage, wait=True)
            return
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_queued, name=f"pipedsl-send-{self.device}", daemon=True)
            self._sender.start()
        self._queue.put((buffer, value, dst))

    def _send_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain: the step has failed
            buffer, value, dst = item
            try:
                self.post(buffer, value, dst, stage=buffer.stage)
            except ExecutionError as err:
                self._error = err
                self.abort(err)
            except Exception as err:  # anything else Ray raises while handing the value over
                self._error = ExecutionError(f"device {self.device} could not send {buffer}: {err}", device=self.device)
                self.abort(err)

    def finish(self, failure: ExecutionError | None = None) -> ExecutionError | None:
        """Wait for the queued sends (at most the receive timeout); return the step's
        failure: the sender's own, which caused any other, else ``failure``."""
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join(timeout=self._timeout)
            if self._sender.is_alive() and self._error is None:
                self._error = ExecutionError(
                    f"device {self.device}'s sends did not finish within {self._timeout:g} s", device=self.device
                )
            self._sender = None
        return self._error or failure

    def recv(self, buffer: Buffer, src: int, *, timeout: float) -> Any:
        if self._error is not None:
            raise self._error
        return self._mailbox.take(self.step, src, buffer, me=self.device, what=str(buffer), timeout=timeout)

    def abort(self, error: BaseException) -> None:
        if self._aborted:
            return
        self._aborted = True
        message = f"device {self.device} failed"
        self._mailbox.fail(self.step, message)
        for d, peer in enumerate(self._peers):
            if d != self.device:
                peer.abort.remote(self.step, self.device, message)

    def post(self, key: Hashable, value: Any, dst: int, *, stage: int | None, wait: bool = False) -> None:
        """Hand ``value`` (a pytree of arrays computed by ``stage``, or of no computation
        when None) to device ``dst`` as ``key`` from this thread; with ``wait``, return
        only once it has arrived."""
        # To host memory first: Ray moves numpy arrays without copying them again. This is
        # where an asynchronous computation's error surfaces, so it is blamed on its stage.
        host = value if stage is None else _materialize(value, stage, self.device, f"computing {key}")
        ref = self._peers[dst].deliver.remote(self.step, self.device, key, host)
        if wait:
            import ray

            ray.get(ref, timeout=self._timeout)

    def take(self, key: Hashable, src: int, *, what: str) -> Any:
        """Wait (at most the receive timeout) for ``key`` from device ``src``."""
        return self._mailbox.take(self.step, src, key, me=self.device, what=what, timeout=self._timeout)


@dataclass(frozen=True, slots=True)
class _Plan:
    model: StagedModel
    programs: dict[int, StageProgram]


class _Hosted:
    """One pipeline's share of this device: its program, compiled stages and state."""

    __slots__ = ("program", "model", "runtime", "placement", "count", "num_devices", "leaves", "states")

    def __init__(
        self, program: DeviceProgram, model: StagedModel, runtime: DeviceRuntime, spec: ModelSpec, num_devices: int
    ) -> None:
        self.program = program
        self.model = model
        self.runtime = runtime
        self.placement = spec.placement
        self.count = spec.num_microbatches
        self.num_devices = num_devices
        self.leaves: dict[int, jax.Array] = {}
        self.states: dict[int, Any] = {}


class DeviceActor:
    """Pipeline device ``index`` (see the module docstring); created by
    :class:`pipedsl.executor.ray_cluster.RayDevices`, one per device."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.device = jax.local_devices()[0]
        self.mailbox = Mailbox()
        self.peers: tuple[Any, ...] = ()
        self._hosted: dict[int, _Hosted] = {}
        self._plans: OrderedDict[int, _Plan] = OrderedDict()
        self._optimizers: dict[int, optax.GradientTransformation] = {}

    # -- set-up ----------------------------------------------------------------------

    def where(self) -> tuple[str, str, int, str]:
        """(Ray node id, node IP address, process id, JAX device) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid(), str(self.device)

    def clock(self) -> float:
        """This process's wall clock, in seconds."""
        return time.time()

    def connect(self, peers: Sequence[Any]) -> None:
        """The handles of every device's actor, by device."""
        self.peers = tuple(peers)

    def install(
        self,
        key: int,
        program: DeviceProgram,
        model_id: int,
        spec: ModelSpec,
        *,
        num_devices: int,
        recv_timeout: float,
    ) -> Failure | None:
        """Host pipeline ``key`` (its device program; the pipeline runs on devices
        ``0..num_devices-1``) with model ``model_id``: trace the model and compile this
        device's stages, unless an earlier install did. Keeps the pipeline's resident
        state."""
        try:
            plan = self._plan(model_id, spec, program.stages)
            runtime = DeviceRuntime(program, plan.programs, device=self.device, recv_timeout=recv_timeout)
        except ExecutionError as err:
            return Failure(str(err), err.stage, self.index, peer=False, updated=False)
        hosted = _Hosted(program, plan.model, runtime, spec, num_devices)
        old = self._hosted.get(key)
        if old is not None:
            hosted.leaves, hosted.states = old.leaves, old.states
        self._hosted[key] = hosted
        return None

    def load(self, key: int, leaves: Mapping[int, Any] | None, states: Mapping[int, Any] | None) -> None:
        """Replace pipeline ``key``'s parameter leaves (by flat index) and optimizer
        states (by stage), each when given."""
        hosted = self._hosted[key]
        if leaves is not None:
            hosted.leaves = dict(jax.device_put(dict(leaves), self.device))
        if states is not None:
            hosted.states = dict(jax.device_put(dict(states), self.device))

    def gather(self, key: int, *, params: bool, states: bool) -> tuple[dict[int, Any], dict[int, Any]]:
        """Pipeline ``key``'s owned parameter leaves and its stages' optimizer states, as
        numpy (each only when asked for)."""
        hosted = self._hosted[key]
        owner, local = hosted.model.owner, hosted.program.stages
        mine = {i: v for i, v in hosted.leaves.items() if owner[i] in local} if params else {}
        return jax.device_get(mine), (jax.device_get(dict(hosted.states)) if states else {})

    def release(self, key: int) -> None:
        """Forget pipeline ``key`` and its state."""
        self._hosted.pop(key, None)

    # -- the links ---------------------------------------------------------------------

    def deliver(self, step: int, src: int, key: Hashable, value: Any) -> None:
        """A value from device ``src`` for ``step`` (called by the sending peer)."""
        self.mailbox.put(step, src, key, jax.device_put(value, self.device))

    def abort(self, step: int, device: int | None, message: str) -> None:
        """``step`` failed elsewhere (device ``device``, or the driver when None)."""
        self.mailbox.fail(step, message)

    # -- the step ----------------------------------------------------------------------

    def run_step(
        self,
        key: int,
        step: int,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        update: Update | None,
        origin: float | None,
        return_grads: bool,
    ) -> StepReport | Failure:
        """Run pipeline ``key``'s program once (see the module docstring).

        ``inputs``/``targets`` are the whole batch's leaves where the first/last stage
        lives (else empty), cut into microbatches here; ``origin`` is the step's start on this actor's wall clock when
        the step is recorded, else None.
        """
        hosted = self._hosted[key]
        recv_timeout = hosted.runtime.recv_timeout
        transport = RayTransport(self.index, step, self.mailbox, self.peers, timeout=recv_timeout)
        self.mailbox.begin(step)
        if update is not None and update.optimizer is not None:
            self._optimizers[update.optimizer_id] = update.optimizer
        updated = False
        try:
            recorder = Recorder(self.index, origin, clock=time.time) if origin is not None else None
            model = hosted.model
            params = {s: tuple(hosted.leaves[i] for i in model.stage_params[s]) for s in hosted.program.stages}
            result = hosted.runtime.run_step(
                transport,
                params,
                self._microbatches(inputs, hosted.count),
                self._microbatches(targets, hosted.count),
                recorder=recorder,
            )
            failure = transport.finish()
            if failure is not None:
                raise failure
            for s, stage_grads in result.grads.items():
                _materialize(stage_grads, s, self.index, "accumulating its gradients", fetch=False)
            if result.loss is not None:
                _materialize(result.loss, hosted.model.num_stages - 1, self.index, "computing the loss", fetch=False)
            grads = self._sum_shared(hosted, result.grads, transport)
            if update is not None:
                self._barrier(transport, hosted.num_devices)
                updated = True
                self._update(hosted, update, grads, transport)
            return StepReport(
                loss=None if result.loss is None else np.asarray(result.loss),
                # An update consumed (donated) the gradients.
                grads=jax.device_get(grads) if return_grads and update is None else {},
                peak_held=result.peak_held,
                leftover=result.leftover,
                events=result.events,
            )
        except ExecutionError as err:
            # A send that failed in the background is what made the program stop.
            cause = transport.finish(err)
            assert cause is not None  # finish returns its argument when the sends were fine
            transport.abort(cause)
            return Failure(str(cause), cause.stage, self.index, peer=isinstance(cause, PeerFailed), updated=updated)
        except Exception as err:  # not ours: still reported as this device's failure
            transport.finish()
            transport.abort(err)
            message = f"device {self.index} failed: {type(err).__name__}: {err}"
            return Failure(message, None, self.index, peer=False, updated=updated)

    def _microbatches(self, leaves: Sequence[Any], count: int) -> list[Leaves]:
        parts = [split_leading(jax.device_put(leaf, self.device), count) for leaf in leaves]
        return [tuple(part[m] for part in parts) for m in range(count)] if parts else []

    def _sum_shared(self, hosted: _Hosted, stage_grads: Mapping[int, Leaves], transport: RayTransport) -> dict[int, Any]:
        """Per flat leaf this device owns, the sum of every using stage's gradient.

        Gradients of leaves owned elsewhere go to their owner; contributions are added
        in stage order, as the local backend does.
        """
        model, me = hosted.model, self.index
        placement = hosted.placement
        for s in hosted.program.stages:
            for g, i in zip(stage_grads[s], model.stage_params[s], strict=True):
                if placement[model.owner[i]] != me:
                    transport.post(("grad", s, i), g, placement[model.owner[i]], stage=s)
        total: dict[int, Any] = {}
        for s in range(model.num_stages):
            local = s in stage_grads
            for k, i in enumerate(model.stage_params[s]):
                if placement[model.owner[i]] != me:
                    continue
                g = stage_grads[s][k] if local else transport.take(("grad", s, i), placement[s], what=f"the gradient of leaf {i} from stage {s}")
                total[i] = g if i not in total else total[i] + g
        return total

    def _barrier(self, transport: RayTransport, num_devices: int) -> None:
        """Return once every device of the pipeline has finished its program (or raise)."""
        others = [d for d in range(num_devices) if d != self.index]
        for d in others:
            transport.post(("done",), (), d, stage=None)
        for d in others:
            transport.take(("done",), d, what="the end of its program")

    def _update(self, hosted: _Hosted, update: Update, grads: dict[int, Any], transport: RayTransport) -> None:
        """Apply the optimizer to every local stage's owned leaves, then hand updated
        shared leaves to the other devices that use them."""
        optimizer = self._optimizers[update.optimizer_id]
        apply = optimizer_update(optimizer)
        model, me = hosted.model, self.index
        if update.init:
            hosted.states = {}
        for s in hosted.program.stages:
            owned = model.owned(s)
            treedef = model.owned_treedefs[s]
            params_s = jax.tree_util.tree_unflatten(treedef, [hosted.leaves[i] for i in owned])
            state = hosted.states.get(s)
            if state is None:
                # Committed to this device like every later state, so that the update
                # compiled for the first step serves the others.
                state = jax.device_put(optimizer.init(params_s), self.device)
            grads_s = jax.tree_util.tree_unflatten(treedef, [grads[i] for i in owned])
            params_s, hosted.states[s] = apply(grads_s, state, params_s)
            for i, leaf in zip(owned, jax.tree_util.tree_leaves(params_s), strict=True):
                hosted.leaves[i] = leaf
        placement = hosted.placement
        for s in range(model.num_stages):
            for i in model.stage_params[s]:
                owner = placement[model.owner[i]]
                if owner == me and placement[s] != me:
                    transport.post(("param", s, i), hosted.leaves[i], placement[s], stage=model.owner[i])
        for s in hosted.program.stages:
            for i in model.stage_params[s]:
                owner = placement[model.owner[i]]
                if owner != me:
                    hosted.leaves[i] = transport.take(("param", s, i), owner, what=f"the updated leaf {i}")

    # -- compiling -------------------------------------------------------------------

    def _plan(self, model_id: int, spec: ModelSpec, stages: Sequence[int]) -> _Plan:
        plan = self._plans.get(model_id)
        if plan is None:
            plan = _Plan(trace_model(spec), {})
            self._plans[model_id] = plan
            if len(self._plans) > _PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        self._plans.move_to_end(model_id)
        for s in stages:
            if s not in plan.programs:
                plan.programs[s] = compile_stage(
                    plan.model,
                    s,
                    num_microbatches=spec.num_microbatches,
                    remat=spec.remat[s],
                    device=spec.placement[s],
                )
        return plan


def _materialize(value: Any, stage: int, device: int, what: str, *, fetch: bool = True) -> Any:
    """``value`` on the host (or, without ``fetch``, only computed); an error of the
    computation that produced it is raised as stage ``stage``'s failure."""
    try:
        return jax.device_get(value) if fetch else jax.block_until_ready(value)
    except Exception as err:  # XLA reports a failed computation where its result is read
        raise stage_failure(stage, device, what, err) from err


def trace_model(spec: ModelSpec) -> StagedModel:
    """The model of ``spec`` cut into stages (as the driver cuts it)."""
    if spec.stages is not None:
        return explicit_model(spec.stages, spec.loss, spec.params, spec.inputs, spec.targets, placement=spec.placement)
    return marked_model(
        spec.model_fn,
        spec.loss,
        spec.params,
        spec.inputs,
        spec.targets,
        num_stages=len(spec.placement),
        placement=spec.placement,
    )
