"""The Ray backend's process actor: one process of a pipeline's ``jax.distributed`` world.

A :class:`WorldProcess` is a Ray actor in a process of its own, started with its JAX devices
set before JAX starts (on CPU ``devices_per_process`` forced host devices through
``XLA_FLAGS``; on GPU the GPUs Ray gave it). :meth:`WorldProcess.join` makes it one process of
the world (gloo collectives on CPU), after which every process sees every JAX device of the
world. Its devices belong to one pipeline device, whose stage mesh may span several
processes (``dp`` across them, ``tp`` inside each): the process runs that device's program
(:class:`~pipedsl.executor.runtime.worker.Worker`), SPMD with the other processes of the mesh, each
computing its own shards; transfers between pipeline devices are compiled collectives
(:mod:`pipedsl.executor.ray.transport`). Where the plan allows it (every pipeline device one
device of its own process), a step is instead the one program over the stage axis
(:class:`~pipedsl.executor.local.ticked.TickedStep`), which every process dispatches alike,
each bringing its own device's rows.

The driver is not in the world. It ships the model once (:meth:`WorldProcess.install`: the
process traces it and compiles its device's stages), then per step the batch's leaves to the
processes of the first and last stages (:meth:`WorldProcess.run_step`), and gets back a
:class:`StepReport` once the process has dispatched its share of the step: gradients only
when asked (as this process's shards), and the loss either in the report or kept where it
was computed, under the step's number, until the driver reads it
(:meth:`WorldProcess.loss`) or lets it go: a training step then copies nothing to the
host and returns without waiting for its computations.
Parameters and optimizer state are made and kept in the world: from the driver's arrays
(each process places its shards), or by an init function run in the world
(:meth:`WorldProcess.init_params`: each process computes only its own shards).
:meth:`WorldProcess.release` forgets the pipeline, so that the world can run another.

``ray`` is imported inside the methods that need it: the driver imports this module before
it connects.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from pipedsl.executor.compilation_cache import enable_compilation_cache
from pipedsl.executor.errors import ExecutionError, stage_failure
from pipedsl.executor.local.ticked import TickedStep, program_failure, ticks_apply
from pipedsl.executor.ray.cores import claim_cores
from pipedsl.executor.ray.step_channel import StepServer
from pipedsl.executor.ray.transport import (
    Hops,
    WorldTransport,
    addressable_pieces,
    signatures,
    worker_groups,
)
from pipedsl.executor.runtime.scheduler import run_steps
from pipedsl.executor.runtime.timing import Recorder
from pipedsl.executor.runtime.worker import Update, Worker, WorkerStep, compile_device
from pipedsl.executor.sharded_checkpoint import restore_device, save_device
from pipedsl.executor.stages.mesh import stage_mesh
from pipedsl.executor.stages.model import StagedModel
from pipedsl.executor.stages.split import staged_model
from pipedsl.executor.stages.stage_options import StageOptions
from pipedsl.executor.stages.stage_program import StageProgram
from pipedsl.ir import Schedule
from pipedsl.program import Buffer, DeviceProgram
from pipedsl.rendezvous import Exchange
from pipedsl.run_options import RunOptions
from pipedsl.timeline import Event

__all__ = ["ModelSpec", "StepReport", "Failure", "WorldProcess", "trace_model"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything a process needs to trace and compile its stages (shipped once).

    ``stages`` (explicit stage functions) or ``model_fn`` (marked) is set; ``params`` is
    the parameters' pytree of ``jax.ShapeDtypeStruct``; ``inputs``/``targets`` one
    microbatch's share, likewise; ``options`` the pipeline's (the SPMD shape of every
    pipeline device) and ``specs`` every flat parameter leaf's ``PartitionSpec``; ``schedule``
    the whole schedule (for the step as one program over the stage axis, which every
    process runs whole).
    """

    stages: tuple[Any, ...] | None
    model_fn: Any
    loss: Any
    params: Any
    inputs: Any
    targets: Any
    num_microbatches: int
    placement: tuple[int, ...]
    stage_options: tuple[StageOptions, ...]
    options: RunOptions
    specs: tuple[PartitionSpec, ...]
    schedule: Schedule


@dataclass(frozen=True, slots=True)
class StepReport:
    """One process's step, as the driver gets it back.

    ``loss`` is the mean loss where the last stage is and the driver asked for it in the
    report (a numpy scalar), else None;
    ``grads`` maps every flat leaf this device owns to this process's shards of its
    summed gradient (:func:`~pipedsl.executor.ray.transport.addressable_pieces`), only
    when the driver asked; ``moved`` counts the transfers this process took part in,
    ``collectives`` the collectives that made them (in a step run as one program over the
    stage axis, its permutations: every process takes part in each).
    """

    loss: np.ndarray | None
    grads: Mapping[int, Any]
    peak_held: int
    leftover: tuple[Buffer, ...]
    events: tuple[Event, ...]
    moved: int
    collectives: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Failure:
    """A process's step failed: the message and the stage to blame (if one is)."""

    message: str
    stage: int | None
    device: int


class WorldProcess:
    """Process ``rank`` of a world of ``num_processes`` (see the module docstring)."""

    def __init__(self, rank: int, num_processes: int) -> None:
        self.rank = rank
        self.num_processes = num_processes
        self._steps: StepServer | None = None
        self.release()

    def release(self) -> None:
        """Forget the installed pipeline (its programs, parameters and optimizer state): the
        world can run another one."""
        self.worker: Worker | None = None
        self.device = -1
        self._hops: Hops | None = None
        self._groups: dict[bool, tuple[tuple[Exchange, ...], ...]] = {}
        self._signature: Callable[[Any], Any] | None = None
        self._optimizer: optax.GradientTransformation | None = None
        self._spec: ModelSpec | None = None
        self._meshes: tuple[Mesh, ...] = ()
        # The step as one program over the stage axis, where the plan allows it.
        self._ticked: TickedStep | None = None
        # The losses of steps the driver has not read yet, by step number (device arrays).
        self._losses: dict[int, Any] = {}

    # -- the world -------------------------------------------------------------------

    def coordinator(self, loopback: bool) -> str:
        """An address for the world's coordinator on this node: a free port on
        127.0.0.1 (``loopback``: a local instance pipedsl started) or on the node's IP."""
        host = _host(loopback)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"{host}:{port}"

    def serve_steps(self, key: bytes, loopback: bool) -> tuple[str, int]:
        """Serve the driver's step calls on a connection of their own, admitted with
        ``key`` (:mod:`pipedsl.executor.ray.step_channel`); its address, on 127.0.0.1
        (``loopback``) or on the node's IP."""
        self._steps = StepServer(_host(loopback), key, handle=self._step_request, failed=self._step_failed)
        return self._steps.address

    def _step_request(self, request: tuple[str, tuple[Any, ...], dict[str, Any]]) -> Any:
        method, args, kwargs = request
        if method not in _STEP_METHODS:
            return Failure(f"process {self.rank} has no step call {method!r}", None, self.device)
        return getattr(self, method)(*args, **kwargs)

    def _step_failed(self, err: BaseException) -> Failure:
        return Failure(f"device {self.device} failed: {type(err).__name__}: {err}", None, self.device)

    def join(self, address: str, *, timeout: float) -> tuple[str, str, int, tuple[int, ...]]:
        """Join the world at ``address``; (Ray node id, node IP, process id, the global
        ids of this process's JAX devices)."""
        import ray

        if os.environ.get("JAX_PLATFORMS", "") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        enable_compilation_cache()
        jax.distributed.initialize(
            address, num_processes=self.num_processes, process_id=self.rank, initialization_timeout=max(1, int(timeout))
        )
        ids = tuple(d.id for d in jax.local_devices())
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid(), ids

    def bind(self, cores: int) -> tuple[int, ...]:
        """Bind this process, every thread it has and will start, to ``cores`` cores of
        its node (:func:`~pipedsl.executor.ray.cores.claim_cores`); which ones."""
        return claim_cores(cores)

    # -- the pipeline -----------------------------------------------------------------

    def install(
        self,
        spec: ModelSpec,
        program: DeviceProgram,
        meshes: Sequence[Sequence[int]],
        groups: Sequence[Sequence[Exchange]],
        *,
        recv_timeout: float,
    ) -> Failure | bool:
        """Run pipeline device ``program.device``, whose stage mesh is (with every other
        device's) ``meshes[d]``: global JAX device ids, ``dp x cp x tp`` in row-major order.
        ``groups`` is the program's exchange order in groups of one collective each
        (:func:`pipedsl.rendezvous.exchange_groups`). Returns whether an unrecorded step
        runs as one program over the stage axis (:mod:`pipedsl.executor.local.ticked`):
        where ``spec.options.ticks`` asks for it and the plan allows it, every process
        traces every stage and runs the same program, each on the shards it holds; every
        process answers the same."""
        try:
            by_id = {d.id: d for d in jax.devices()}
            config = spec.options
            self._meshes = tuple(stage_mesh([by_id[i] for i in ids], config) for ids in meshes)
            mesh = self._meshes[program.device]
            model = trace_model(spec)
            programs = compile_device(
                model,
                program.stages,
                mesh,
                specs=spec.specs,
                options=config,
                num_microbatches=spec.num_microbatches,
                stage_options=spec.stage_options,
                placement=spec.placement,
            )
            self.worker = Worker(
                program,
                model,
                programs,
                placement=spec.placement,
                num_devices=len(meshes),
                num_microbatches=spec.num_microbatches,
                recv_timeout=recv_timeout,
                barrier=False,
            )
            self._ticked = self._one_program(spec, model, programs, self.worker)
        except ExecutionError as err:
            return Failure(str(err), err.stage, program.device)
        self.device = program.device
        self._spec = spec
        self._hops = Hops(self._meshes)
        self._signature = signatures(model, mesh, spec.specs, zero=config.zero)
        program_groups = tuple(tuple(g) for g in groups)
        self._groups = {u: program_groups + worker_groups(model, spec.placement, update=u) for u in (False, True)}
        return self._ticked is not None

    def _one_program(
        self, spec: ModelSpec, model: StagedModel, mine: dict[int, StageProgram], worker: Worker
    ) -> TickedStep | None:
        """The step as one program over the stage axis, where the options ask for it and the
        plan allows it: every stage traced, this device's compiled already and the others'
        on their devices' meshes (traced only: this process never dispatches them)."""
        meshes = self._meshes
        if not spec.options.ticks or max(m.devices.size for m in meshes) != 1:
            return None
        programs = dict(mine)
        for d, mesh in enumerate(meshes):
            if d != worker.index:
                programs |= compile_device(
                    model,
                    spec.schedule.stages_on(d),
                    mesh,
                    specs=spec.specs,
                    options=spec.options,
                    num_microbatches=spec.num_microbatches,
                    stage_options=spec.stage_options,
                    placement=spec.placement,
                )
        if not ticks_apply(model, programs, meshes):
            return None
        return TickedStep((worker,), meshes, schedule=spec.schedule, stages=programs)

    def load(self, leaves: Mapping[int, Any] | None, states: Mapping[int, Any] | None) -> None:
        """Replace the parameter leaves (host arrays, by flat index) and the optimizer
        states (by local stage), each when given; each process places its own shards."""
        worker = self._settled()
        worker.load(leaves, states)

    def init_params(self, init: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Make the parameter leaves this device's stages use as ``init(*args)`` (a pytree
        with the parameters' structure), jitted over this device's mesh with each leaf's
        sharding as its output's: each process computes only its own shards."""
        worker = self._settled()
        kept = worker.kept()
        indices = sorted(kept)

        def pick(*a: Any) -> tuple[Any, ...]:
            leaves = jax.tree_util.tree_leaves(init(*a))
            return tuple(leaves[i] for i in indices)

        made = jax.jit(pick, out_shardings=tuple(kept[i] for i in indices))(*args)
        worker.load(dict(zip(indices, made, strict=True)), None)

    def gather(self, *, params: bool, states: bool) -> tuple[dict[int, Any], dict[int, Any]]:
        """This process's shards of the owned parameter leaves and of the local stages'
        optimizer states (each only when asked for)."""
        worker = self._settled()
        mine = {i: worker.leaves[i] for i in worker.owned} if params else {}
        return addressable_pieces(mine), (addressable_pieces(dict(worker.states)) if states else {})

    def save(self, path: str) -> Failure | None:
        """Write this device's parameter leaves and optimizer states as the orbax checkpoint
        ``path``, with the other processes of its mesh, each the shards it holds
        (:func:`~pipedsl.executor.sharded_checkpoint.save_device`)."""
        worker = self._settled()
        try:
            save_device(worker, path, processes=self._mesh_processes())
        except ExecutionError as err:
            return Failure(str(err), None, self.device)
        return None

    def restore(
        self, version: str, placement: Sequence[int], optimizer: optax.GradientTransformation | None
    ) -> Failure | None:
        """Read this device's state back from the saved ``version`` (saved with ``placement``,
        :func:`~pipedsl.executor.sharded_checkpoint.restore_device`); the optimizer state only
        with ``optimizer``."""
        worker = self._settled()
        try:
            restore_device(worker, Path(version), optimizer, processes=self._mesh_processes(), placement=placement)
        except ExecutionError as err:
            return Failure(str(err), None, self.device)
        if optimizer is not None:
            self._optimizer = optimizer
        return None

    def _mesh_processes(self) -> list[int]:
        """The processes of this device's mesh, in increasing order."""
        return sorted({d.process_index for d in self._meshes[self.device].devices.flat})

    def optimizer(self, optimizer: optax.GradientTransformation) -> None:
        """The optimizer of the following training steps."""
        self._optimizer = optimizer

    # -- the step ----------------------------------------------------------------------

    def run_step(
        self,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        update: bool | None,
        origin: float | None,
        return_grads: bool,
        loss: Literal["report", "keep", "drop"] = "report",
        number: int = 0,
        forget: Sequence[int] = (),
    ) -> StepReport | Failure:
        """Run this process's share of one step (see the module docstring).

        ``inputs``/``targets`` are the whole batch's leaves where the first/last stage
        lives (else empty); ``update`` is None for no optimizer step, else whether to
        start the optimizer state afresh; ``origin`` is the step's start on this
        process's wall clock when the step is recorded, else None. Where the last stage
        is, ``loss`` says what becomes of the loss: copied into the report, kept as step
        ``number``'s for :meth:`loss` to read (nothing is waited for or copied to the host),
        or dropped; ``forget`` are kept losses the driver no longer wants.
        """
        self._installed()
        assert self._hops is not None and self._signature is not None  # set by install
        start = time.perf_counter()
        for old in forget:
            self._losses.pop(old, None)
        step = None
        if update is not None:
            assert self._optimizer is not None  # sent before the first training step
            step = Update(self._optimizer, init=update)
        if self._ticked is not None and origin is None:
            return self._run_ticked(self._ticked, inputs, targets, step, return_grads, loss, number, start)
        worker = self._settled()
        transport = WorldTransport(self.device, self._groups[update is not None], self._hops, self._signature)
        try:
            steps = worker.steps(
                transport,
                inputs,
                targets,
                update=step,
                recorder=Recorder(self.device, origin, clock=time.time) if origin is not None else None,
                keep_grads=return_grads,
            )
            (result,), (failed,) = run_steps([steps], transport, timeout=worker.runtime.recv_timeout)
            if failed is not None:
                raise failed
            transport.finish()
            return self._report(result, return_grads, loss, number, transport.moved, transport.collectives, start)
        except ExecutionError as err:
            return Failure(str(err), err.stage, self.device)
        except Exception as err:  # not ours: still reported as this device's failure
            return Failure(f"device {self.device} failed: {type(err).__name__}: {err}", None, self.device)

    def _run_ticked(
        self,
        ticked: TickedStep,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        update: Update | None,
        return_grads: bool,
        loss: Literal["report", "keep", "drop"],
        number: int,
        start: float,
    ) -> StepReport | Failure:
        """This process's dispatch of the step as one program over the stage axis (every
        process dispatches the same program); as :meth:`run_step` reports it."""
        try:
            (result,) = ticked.run(inputs, targets, update=update, keep_grads=return_grads)
            moved = ticked.transfers_of(self.device)
            return self._report(result, return_grads, loss, number, moved, ticked.permutations, start)
        except ExecutionError as err:
            return Failure(str(err), err.stage, self.device)
        except Exception as err:  # the program's: it names no stage
            return Failure(f"device {self.device}: {program_failure(ticked, err)}", None, self.device)

    def _report(
        self,
        result: WorkerStep,
        return_grads: bool,
        loss: Literal["report", "keep", "drop"],
        number: int,
        moved: int,
        collectives: int,
        start: float,
    ) -> StepReport:
        """A step's ``result`` as :meth:`run_step` reports it: this process's shards of the
        gradients where asked, the loss read (``"report"``) or kept for :meth:`loss`
        (``"keep"``), the transfers and collectives it took part in, the seconds since
        ``start``."""
        grads = addressable_pieces(dict(result.grads)) if return_grads else {}
        value = None
        if result.loss is not None and loss == "report":
            value = np.asarray(result.loss.addressable_data(0))
        elif result.loss is not None and loss == "keep":
            self._losses[number] = result.loss
        return StepReport(
            loss=value,
            grads=grads,
            peak_held=result.peak_held,
            leftover=result.leftover,
            events=result.events,
            moved=moved,
            collectives=collectives,
            seconds=time.perf_counter() - start,
        )

    def loss(self, step: int) -> np.ndarray | Failure:
        """Step ``step``'s kept loss as a numpy scalar, waited for and then forgotten; a
        computation that failed is reported as the last stage's failure."""
        kept = self._losses.pop(step, None)
        if kept is None:
            return Failure(f"device {self.device} keeps no loss of step {step}", None, self.device)
        last = len(self._installed().placement) - 1
        try:
            return np.asarray(kept.addressable_data(0))
        except Exception as err:  # a failed computation is reported where its result is read
            failure = stage_failure(last, self.device, "computing the loss", err)
            return Failure(str(failure), last, self.device)

    def loss_ready(self, step: int) -> bool:
        """Whether step ``step``'s kept loss is computed (or has failed); nothing waits."""
        kept = self._losses.get(step)
        return kept is None or kept.is_ready()

    def wait(self) -> Failure | None:
        """Return once everything this process dispatched is computed: its parameters,
        optimizer state and kept losses; a failed computation is reported as its device's."""
        worker = self._installed()
        try:
            if self._ticked is not None and self._ticked.holds():
                self._ticked.wait()
            jax.block_until_ready((worker.leaves, worker.states, self._losses))
        except Exception as err:  # a failed computation is reported where its result is read
            return Failure(f"device {self.device} failed: {type(err).__name__}: {err}", None, self.device)
        return None

    def doing(self) -> str:
        """What this process's step is doing, in words; answered in another of the
        actor's threads while the step runs."""
        worker = self.worker
        return "idle" if worker is None else worker.doing()

    def layout(self) -> tuple[int, tuple[int, ...]]:
        """(pipeline device, global ids of its mesh's devices that this process holds)."""
        mesh = self._meshes[self.device]
        return self.device, tuple(d.id for d in mesh.devices.flat if d.process_index == jax.process_index())

    def _settled(self) -> Worker:
        """The worker, holding its parameters and optimizer state (handed back by the one
        program over the stage axis where it held them)."""
        worker = self._installed()
        if self._ticked is not None:
            self._ticked.settle()
        return worker

    def _installed(self) -> Worker:
        if self.worker is None:
            raise ExecutionError(f"process {self.rank} runs no pipeline device yet")
        return self.worker


# What the driver may call on a process's step connection (the rest are Ray calls).
_STEP_METHODS = frozenset({"run_step", "loss", "loss_ready", "wait"})


def _host(loopback: bool) -> str:
    """This node's address for the world's sockets: 127.0.0.1 on a local instance pipedsl
    started (``loopback``), else the node's IP."""
    import ray

    return "127.0.0.1" if loopback else ray.util.get_node_ip_address()


def trace_model(spec: ModelSpec) -> StagedModel:
    """The model of ``spec`` cut into stages (as the driver cuts it)."""
    return staged_model(
        spec.stages, spec.model_fn, spec.loss, spec.params, spec.inputs, spec.targets, placement=spec.placement
    )
