"""The Ray backend's device actor: a thin shell around one :class:`~pipedsl.executor.worker.Worker`.

A :class:`DeviceActor` lives in its own Ray worker process (threaded: several method
calls run at once) and owns a ``dp x tp`` mesh of that process's JAX devices (on CPU
the actor's own forced host device count, set through its runtime environment; on GPU
the ``dp x tp`` GPUs Ray gave it). For every pipeline that uses it, it holds one worker:
the stages it owns, traced and compiled here from the model the driver shipped once
(compiled stages are cached per model, so pipelines of one model reuse them), and the
resident parameters and optimizer state.

One driver call, :meth:`DeviceActor.run_step`, runs a whole step on the device through
the worker (program, shared-gradient sums, barrier, optimizer update, hand-out of
shared parameters; see :mod:`pipedsl.executor.worker`), with a
:class:`~pipedsl.executor.ray_transport.RayTransport` for everything between devices
(the driver sees none of it), and turns the outcome into a :class:`StepReport` or a
:class:`Failure`.

``ray`` is imported inside the methods that need it: this module is also imported by
the driver before it connects (see :mod:`pipedsl.executor.ray_cluster`).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from pipedsl.executor.devices import xla_device_flag
from pipedsl.executor.errors import ExecutionError, PeerFailed
from pipedsl.executor.interpreter import drive
from pipedsl.executor.mesh import MeshConfig, build_meshes
from pipedsl.executor.ray_links import Channel, Layout, Links, structs
from pipedsl.executor.ray_transport import Mailbox, RayTransport, from_wire
from pipedsl.executor.split import marked_model
from pipedsl.executor.stage_options import StageOptions
from pipedsl.executor.stage_program import StageProgram
from pipedsl.executor.stages import StagedModel, explicit_model
from pipedsl.executor.timing import Recorder
from pipedsl.executor.worker import Update, Worker, compile_device
from pipedsl.program import Buffer, DeviceProgram, Recv, Send
from pipedsl.timeline import Event

__all__ = ["ModelSpec", "RayUpdate", "StepReport", "Failure", "DeviceActor", "trace_model"]

# Compiled models kept per actor (least recently used dropped beyond this many).
_CACHE_SIZE = 16


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything an actor needs to trace and compile its stages (shipped once).

    ``stages`` (explicit stage functions) or ``model_fn`` (marked) is set; ``params`` is
    the parameters' pytree of ``jax.ShapeDtypeStruct``; ``inputs``/``targets`` one
    microbatch, likewise; ``mesh`` the SPMD shape of every device and ``specs`` every
    flat parameter leaf's ``PartitionSpec``.
    """

    stages: tuple[Any, ...] | None
    model_fn: Any
    loss: Any
    params: Any
    inputs: Any
    targets: Any
    num_microbatches: int
    placement: tuple[int, ...]
    remat: tuple[StageOptions, ...]
    mesh: MeshConfig
    specs: tuple[PartitionSpec, ...]


@dataclass(frozen=True, slots=True)
class RayUpdate:
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


@dataclass(frozen=True, slots=True)
class _TracedModel:
    """A model traced on this actor and the stages compiled for its mesh so far."""

    model: StagedModel
    programs: dict[int, StageProgram]


class DeviceActor:
    """Pipeline device ``index`` (see the module docstring); created by
    :class:`pipedsl.executor.ray_cluster.RayDevices`, one per device."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.links: Links | None = None
        self.mailbox = Mailbox({})
        self.peers: tuple[Any, ...] = ()
        self.mesh: Mesh | None = None
        self._hosted: dict[int, Worker] = {}
        # Per hosted pipeline: its model id, the (key, receiver) of its program's sends and
        # the (key, sender) of its receives, in program order.
        self._models: dict[int, int] = {}
        self._planned: dict[int, tuple[tuple[Buffer, int], ...]] = {}
        self._expected: dict[int, tuple[tuple[Buffer, int], ...]] = {}
        self._traced: OrderedDict[int, _TracedModel] = OrderedDict()
        self._optimizers: dict[int, optax.GradientTransformation] = {}
        self._stepping: Worker | None = None  # the worker of the step running now

    # -- set-up ----------------------------------------------------------------------

    def where(self) -> tuple[str, str, int, str]:
        """(Ray node id, node IP address, process id, first JAX device) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid(), str(jax.local_devices()[0])

    def clock(self) -> float:
        """This process's wall clock, in seconds."""
        return time.time()

    def serve(self) -> str:
        """Start this actor's transfer server on its node's address; return the address."""
        import ray

        self.links = Links(ray.util.get_node_ip_address())
        self.mailbox = Mailbox(self.links.learned)
        return self.links.address

    def connect(self, peers: Sequence[Any], addresses: Sequence[str]) -> None:
        """The handles of every device's actor and their transfer servers' addresses, by device."""
        assert self.links is not None  # served before the group connects
        self.peers = tuple(peers)
        self.links.meet(tuple(addresses))

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
        device's stages for its mesh, unless an earlier install did. Keeps the
        pipeline's resident state."""
        try:
            mesh = self._mesh(spec.mesh)
            traced = self._compiled(model_id, spec, program.stages, mesh)
            worker = Worker(
                program,
                traced.model,
                traced.programs,
                placement=spec.placement,
                num_devices=num_devices,
                num_microbatches=spec.num_microbatches,
                recv_timeout=recv_timeout,
            )
        except ExecutionError as err:
            return Failure(str(err), err.stage, self.index, peer=False, updated=False)
        old = self._hosted.get(key)
        if old is not None:
            worker.leaves, worker.states = old.leaves, old.states
        self._hosted[key] = worker
        self._models[key] = model_id
        self._planned[key] = tuple((i.buffer, i.peer) for i in program.instructions if isinstance(i, Send))
        self._expected[key] = tuple((i.buffer, i.peer) for i in program.instructions if isinstance(i, Recv))
        return None

    def load(self, key: int, leaves: Mapping[int, Any] | None, states: Mapping[int, Any] | None) -> None:
        """Replace pipeline ``key``'s parameter leaves (by flat index) and optimizer
        states (by stage), each when given."""
        self._hosted[key].load(leaves, states)

    def gather(self, key: int, *, params: bool, states: bool) -> tuple[dict[int, Any], dict[int, Any]]:
        """Pipeline ``key``'s owned parameter leaves and its stages' optimizer states, as
        numpy (each only when asked for)."""
        return self._hosted[key].gather(params=params, states=states)

    def release(self, key: int) -> None:
        """Forget pipeline ``key`` and its state."""
        self._hosted.pop(key, None)
        self._models.pop(key, None)
        self._planned.pop(key, None)
        self._expected.pop(key, None)

    # -- the links ---------------------------------------------------------------------

    def deliver(
        self, step: int, src: int, key: Hashable, value: Any, *, learn: tuple[Channel, Layout | None] | None = None
    ) -> None:
        """A value from device ``src`` for ``step`` (called by the sending peer); with
        ``learn``, the layout of the later values of its channel, which come by transfer
        (see :mod:`pipedsl.executor.ray_links`)."""
        mesh = self.mesh
        assert mesh is not None  # a pipeline is installed before any step
        known = None if learn is None else (learn[0], None if learn[1] is None else structs(learn[1], mesh))
        self.mailbox.put(step, src, key, from_wire(value, mesh), learn=known)

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
        params: Mapping[int, Any] | None,
        update: RayUpdate | None,
        origin: float | None,
        return_grads: bool,
    ) -> StepReport | Failure:
        """Run pipeline ``key``'s step on this device (see the module docstring).

        ``inputs``/``targets`` are the whole batch's leaves where the first/last stage
        lives (else empty); ``params``, when given, replace the parameter leaves (by flat
        index) before the step; ``origin`` is the step's start on this actor's wall clock
        when the step is recorded, else None.
        """
        worker = self._hosted[key]
        transport = self._transport(key, step, recording=origin is not None, timeout=worker.runtime.recv_timeout)
        self.mailbox.begin(step)
        worker.applied = False
        self._stepping = worker
        try:
            if params is not None:
                worker.load(params, None)
            steps = worker.steps(
                transport,
                inputs,
                targets,
                update=self._update(update),
                recorder=Recorder(self.index, origin, clock=time.time) if origin is not None else None,
                keep_grads=return_grads,
            )
            result = drive(steps, transport, timeout=worker.runtime.recv_timeout)
            failure = transport.finish()
            if failure is not None:
                raise failure
            return StepReport(
                loss=None if result.loss is None else np.asarray(result.loss),
                grads=jax.device_get(dict(result.grads)),
                peak_held=result.peak_held,
                leftover=result.leftover,
                events=result.events,
            )
        except ExecutionError as err:
            # A send that failed in the background is what made the program stop.
            cause = transport.finish(err)
            assert cause is not None  # finish returns its argument when the sends were fine
            transport.abort(cause)
            peer = isinstance(cause, PeerFailed)
            return Failure(str(cause), cause.stage, self.index, peer=peer, updated=worker.applied)
        except Exception as err:  # not ours: still reported as this device's failure
            transport.finish()
            transport.abort(err)
            message = f"device {self.index} failed: {type(err).__name__}: {err}"
            return Failure(message, None, self.index, peer=False, updated=worker.applied)
        finally:
            self._stepping = None

    def _update(self, update: RayUpdate | None) -> Update | None:
        """The step's update, its optimizer kept here when this is the first to bring it."""
        if update is None:
            return None
        if update.optimizer is not None:
            self._optimizers[update.optimizer_id] = update.optimizer
        return Update(self._optimizers[update.optimizer_id], init=update.init)

    def doing(self) -> str:
        """What this device's step is doing, in words ("idle" between steps); answered
        in another of the actor's threads while the step runs."""
        worker = self._stepping
        return "idle" if worker is None else worker.doing()

    def _transport(self, key: int, step: int, *, recording: bool, timeout: float) -> RayTransport:
        """Pipeline ``key``'s links for ``step``."""
        assert self.links is not None and self.mesh is not None  # served and installed before a step
        return RayTransport(
            self.index,
            step,
            self.mailbox,
            self.peers,
            self.links,
            mesh=self.mesh,
            pipeline=(key, self._models[key]),
            planned=self._planned[key],
            expected=self._expected[key],
            recording=recording,
            timeout=timeout,
        )

    # -- compiling -------------------------------------------------------------------

    def _mesh(self, config: MeshConfig) -> Mesh:
        """This actor's mesh of ``config.dp x config.tp`` JAX devices (made once)."""
        if self.mesh is None or self.mesh.devices.shape != (config.dp, config.tp):
            devices = jax.local_devices()
            if len(devices) < config.size:
                raise ExecutionError(
                    f"device {self.index}'s actor has {len(devices)} JAX device(s) but dp={config.dp} x "
                    f"tp={config.tp} needs {config.size}; start the device group with that many JAX "
                    f"devices per actor (on CPU its XLA_FLAGS={xla_device_flag(config.size)})",
                    device=self.index,
                )
            self.mesh = build_meshes(1, config, devices=devices[: config.size], what=f"device {self.index}")[0]
        return self.mesh

    def _compiled(self, model_id: int, spec: ModelSpec, stages: Sequence[int], mesh: Mesh) -> _TracedModel:
        traced = self._traced.get(model_id)
        if traced is None:
            traced = _TracedModel(trace_model(spec), {})
            self._traced[model_id] = traced
            if len(self._traced) > _CACHE_SIZE:
                self._traced.popitem(last=False)
        self._traced.move_to_end(model_id)
        missing = [s for s in stages if s not in traced.programs]
        traced.programs.update(
            compile_device(
                traced.model,
                missing,
                mesh,
                specs=spec.specs,
                zero=spec.mesh.zero,
                num_microbatches=spec.num_microbatches,
                remat=spec.remat,
                placement=spec.placement,
            )
        )
        return traced


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
