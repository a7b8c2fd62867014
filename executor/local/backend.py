"""The local backend: every pipeline device is a mesh of JAX devices of this process.

Pipeline device d runs on a ``dp x cp x tp`` mesh (:mod:`pipedsl.executor.stages.mesh`) of the
first ``pp x dp x cp x tp`` devices JAX reports (CPU devices come from
``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set before JAX is imported;
GPUs are found as they are) or of a list given explicitly. With ``dp = tp = 1`` an
explicit list may name one JAX device several times: the pipeline then runs correctly
but its devices share that device's compute, and an unrecorded step runs as one program
of the whole schedule (:mod:`pipedsl.executor.local.fused`), as nothing in it waits for
another device.

Each pipeline device is a :class:`~pipedsl.executor.runtime.worker.Worker`, hosted in this
process for :class:`~pipedsl.executor.driver.Driver`. JAX dispatches work
asynchronously, so the workers' steps only queue work and the JAX devices execute it
concurrently: one thread runs every device's step, switching where one waits for a value
not sent yet (:mod:`pipedsl.executor.runtime.scheduler`), and returns once the step is
dispatched, its results device arrays that nothing has waited for. A recorded step
runs the same way, each action waited for where the device yields it. A failure on one
device stops every other device at once, and the step raises the original error.
Parameters and optimizer state live in the workers between steps.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedsl.executor.backend import DeviceReport
from pipedsl.executor.errors import ExecutionError, summary
from pipedsl.executor.local.exchange import LocalExchange, resharder
from pipedsl.executor.local.fused import FusedStep, shared_devices
from pipedsl.executor.local.ticked import TickedStep, program_failure, ticks_apply
from pipedsl.executor.runtime.scheduler import Steps, run_watched
from pipedsl.executor.runtime.timing import Recorder
from pipedsl.executor.runtime.worker import Update, Worker, WorkerStep, compile_device
from pipedsl.executor.sharded_checkpoint import (
    device_part,
    finish_version,
    latest_readable,
    new_version,
    plan_record,
    restore_device,
    save_device,
)
from pipedsl.executor.stages.mesh import build_meshes, leaf_specs
from pipedsl.executor.stages.model import StagedModel
from pipedsl.executor.stages.split import staged_model
from pipedsl.executor.stages.stage_options import StageOptions
from pipedsl.executor.stages.stage_program import StageProgram
from pipedsl.program import Program
from pipedsl.run_options import Fuse, RunOptions

__all__ = ["LocalBackend", "CompiledStages"]


@dataclass(frozen=True, slots=True)
class CompiledStages:
    """A model cut into stages and every stage compiled for its device's mesh."""

    model: StagedModel
    programs: tuple[StageProgram, ...]


# Compiled stages, shared by every pipeline of the same model (the same stage functions
# or model_fn, loss, shapes, microbatch count, stage options, meshes and shardings):
# comparing schedules of one model compiles its stages once per mesh. Least recently
# used entries are dropped beyond this many; a backend keeps its own (``_held``), so that
# more pipelines than this, stepped in turns, never compile again.
_CACHE_SIZE = 16
_COMPILED: OrderedDict[Any, CompiledStages] = OrderedDict()


class LocalBackend:
    """Hosts a lowered :class:`Program`'s pipeline devices, one worker each, in this
    process (see the module docstring); implements :class:`pipedsl.executor.backend.Backend`.

    ``stages`` (explicit) or ``model_fn`` (marked) is the model; ``options`` how it runs (the
    SPMD shape of every pipeline device, each stage's options, ``recv_timeout`` bounding every
    wait for another device, in seconds); ``param_specs`` the parameters' ``PartitionSpec``
    pytree (None: replicated). Where every pipeline device has the same JAX devices as its
    mesh (as one pipeline device has), an unrecorded step runs as ``options.fuse`` says
    (:data:`~pipedsl.run_options.Fuse`): one program, or each action apart; :attr:`fuse` is
    ``"off"`` where the devices differ.
    """

    def __init__(
        self,
        program: Program,
        *,
        stages: tuple[Callable[[Any, Any], Any], ...] | None,
        model_fn: Callable[[Any, Any], Any] | None,
        loss: Callable[[Any, Any], Any],
        options: RunOptions,
        param_specs: Any,
        devices: Sequence[jax.Device] | None = None,
    ) -> None:
        schedule = program.schedule
        self.program = program
        self.options = options
        self._stage_options = StageOptions.per_stage(options, schedule.num_stages)
        self.meshes = build_meshes(schedule.num_devices, options, devices=devices, what=f"schedule {schedule.name!r}")
        self.recv_timeout = options.recv_timeout
        # Kept: each caches its copies. Pipeline devices on the same JAX devices copy what
        # they send each other when their steps are dispatched apart, as devices of their own do.
        shared = shared_devices(self.meshes) and schedule.num_devices > 1
        self._movers = tuple(resharder(m, copy=shared, by_host=options.host_transfers) for m in self.meshes)
        self._stages = stages
        self._model_fn = model_fn
        self._loss = loss
        self._specs = param_specs
        self.workers: tuple[Worker, ...] = ()
        self._compiled: CompiledStages | None = None  # what the workers run
        self._held: tuple[Any, CompiledStages] | None = None  # (cache key, stages) of the last step
        self._kept_shapes: Any = None  # the parameters' tree and shapes the workers hold
        # The whole step as one program where pipeline devices share their JAX devices, one
        # pipeline device (pp = 1, the SPMD plans) included: nothing in it waits for another.
        self.fuse: Fuse = options.fuse if shared_devices(self.meshes) else "off"
        self._fused: FusedStep | None = None
        # The whole step as one SPMD program over the pipeline devices where each is a JAX
        # device of its own (options.ticks, and the plan allows it: ticked.ticks_apply).
        self._ticked: TickedStep | None = None

    # -- compiling -----------------------------------------------------------------

    def compiled(self, tree: Any, example_inputs: Any, example_targets: Any) -> CompiledStages:
        """The model traced and compiled for these shapes (cached, see ``_COMPILED``)."""
        schedule = self.program.schedule
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        specs = leaf_specs(self._specs, tree)
        batch = (example_inputs, example_targets)
        key = (
            self._stages if self._stages is not None else self._model_fn,
            self._loss,
            schedule.placement,
            schedule.num_microbatches,
            self._stage_options,
            treedef,
            tuple((np.shape(v), str(jnp.result_type(v))) for v in leaves),
            jax.tree_util.tree_structure(batch),
            tuple((s.shape, str(s.dtype)) for s in jax.tree_util.tree_leaves(batch)),
            tuple(tuple(m.devices.flat) for m in self.meshes),
            specs,
            # What the programs depend on of the rest: the meshes' shape and the ZeRO mode
            # (not fuse or recv_timeout, so that such pipelines share their programs).
            (
                self.options.dp,
                self.options.fsdp,
                self.options.cp,
                self.options.tp,
                self.options.zero,
                self.options.reduce_once,
            ),  # fmt: skip
        )
        if self._held is not None and self._held[0] == key:
            return self._held[1]
        found = _COMPILED.get(key)
        if found is not None:
            _COMPILED.move_to_end(key)
            self._held = (key, found)
            return found
        placement = schedule.placement
        model = staged_model(
            self._stages, self._model_fn, self._loss, tree, example_inputs, example_targets, placement=placement
        )
        programs: dict[int, StageProgram] = {}
        for d in range(schedule.num_devices):
            programs |= compile_device(
                model,
                schedule.stages_on(d),
                self.meshes[d],
                specs=specs,
                options=self.options,
                num_microbatches=schedule.num_microbatches,
                stage_options=self._stage_options,
                placement=placement,
            )
        found = CompiledStages(model, tuple(programs[s] for s in range(model.num_stages)))
        _COMPILED[key] = found
        if len(_COMPILED) > _CACHE_SIZE:
            _COMPILED.popitem(last=False)
        self._held = (key, found)
        return found

    def install(self, params: Any, example_inputs: Any, example_targets: Any) -> tuple[StagedModel, bool]:
        """The stages compiled for these shapes and a worker per device on them; the
        workers are rebuilt when the shapes change, keeping the parameters and optimizer
        state of the ones they replace (their placement depends on the meshes and the
        specs only), so they are fresh only on the first step or after a broken one."""
        compiled = self.compiled(params, example_inputs, example_targets)
        if compiled is self._compiled:
            return compiled.model, False
        self._settle()
        schedule = self.program.schedule
        programs = dict(enumerate(compiled.programs))
        before = self.workers
        self.workers = tuple(
            Worker(
                prog,
                compiled.model,
                programs,
                placement=schedule.placement,
                num_devices=schedule.num_devices,
                num_microbatches=schedule.num_microbatches,
                recv_timeout=self.recv_timeout,
            )
            for prog in self.program.devices
        )
        self._compiled = compiled
        first, last = schedule.placement[0], schedule.placement[-1]
        self._fused = (
            FusedStep(self.workers, schedule=self.program.schedule, first=first, last=last, mode=self.fuse)
            if self.fuse in ("loop", "unrolled")
            else None
        )
        serial = self.fuse == "ticks"
        self._ticked = (
            TickedStep(self.workers, self.meshes, schedule=schedule, stages=programs, serial=serial)
            if (serial or (self.options.ticks and self.fuse == "off"))
            and ticks_apply(compiled.model, programs, self.meshes, serial=serial)
            else None
        )
        kept = bool(before) and all(w.leaves for w in before) and self._kept_shapes == _leaf_shapes(params)
        if kept:
            for old, new in zip(before, self.workers, strict=True):
                new.load(old.leaves, old.states if old.states else None)
        self._kept_shapes = _leaf_shapes(params)
        return compiled.model, not kept

    @property
    def ticked(self) -> bool:
        """Whether an unrecorded step runs as one SPMD program over the pipeline devices
        (:mod:`pipedsl.executor.local.ticked`); known once the stages are installed."""
        return self._ticked is not None

    def _settle(self) -> None:
        """The parameters and optimizer state held by the one program of separate devices
        handed back to the workers, before anything else reads or replaces them."""
        if self._ticked is not None:
            self._ticked.settle()

    def load(self, leaves: Sequence[Any] | None, states: Sequence[Any] | None) -> None:
        self._settle()
        for worker in self.workers:
            worker.load(
                None if leaves is None else dict(enumerate(leaves)),
                None if states is None else {s: states[s] for s in worker.local},
            )

    def make(self, init: Callable[..., Any], args: tuple[Any, ...]) -> None:
        leaves = jax.tree_util.tree_leaves(jax.jit(init)(*args))
        self.load(leaves, None)

    def fetch(self, *, params: bool) -> tuple[dict[int, np.ndarray], dict[int, Any]]:
        self._settle()
        leaves: dict[int, Any] = {}
        states: dict[int, Any] = {}
        for worker in self.workers:
            mine, theirs = worker.gather(params=params, states=not params)
            leaves |= mine
            states |= theirs
        return leaves, states

    # -- checkpoints ------------------------------------------------------------------

    def save(self, path: str | Path, *, step: int) -> Path:
        """Save the devices' parameters and optimizer state as ``path/step-<step>``, one orbax
        checkpoint per pipeline device (:mod:`pipedsl.executor.sharded_checkpoint`). Returns
        the version's directory."""
        self._settle()
        if not self.workers or not all(w.leaves for w in self.workers):
            raise ExecutionError("nothing to save yet: the devices hold parameters after a step or Pipeline.init")
        version = new_version(path, step)
        for worker in self.workers:
            save_device(worker, device_part(version, worker.index), processes=[jax.process_index()])
        finish_version(version, step, self._plan())
        return version

    def restore(
        self,
        path: str | Path,
        like_params: Any,
        example: tuple[Any, Any],
        *,
        optimizer: optax.GradientTransformation | None,
    ) -> int:
        """Read the latest complete version under ``path`` back onto the devices (the
        optimizer state only with ``optimizer``) and return its step. Any plan of the same
        model reads it; another model's is refused, saying what differs."""
        self.install(like_params, *example)
        self._settle()
        step, version, placement = latest_readable(path, self._plan())
        for worker in self.workers:
            restore_device(worker, version, optimizer, processes=[jax.process_index()], placement=placement)
        return step

    def _plan(self) -> dict[str, Any]:
        assert self._compiled is not None  # installed before anything is saved or read
        model = self._compiled.model
        tree = jax.tree_util.tree_unflatten(model.param_treedef, list(model.param_avals))
        return plan_record(
            self.program.schedule, self.options, processes=1, model=model, specs=leaf_specs(self._specs, tree)
        )

    def wait(self) -> None:
        """Return once every parameter and optimizer state the workers hold is computed
        (the steps dispatched so far are done), raising a failed computation's error."""
        if self._ticked is not None and self._ticked.holds():
            self._ticked.wait()
            return
        jax.block_until_ready([(w.leaves, w.states) for w in self.workers])

    def close(self) -> None:
        """The workers' state is dropped with the backend; nothing else is held."""
        self.workers = ()
        self._compiled = None
        self._fused = None
        self._ticked = None
        self._held = None

    # -- the step ------------------------------------------------------------------

    def run(
        self,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        optimizer: optax.GradientTransformation | None,
        fresh_state: bool,
        record: bool,
        keep_grads: bool,
        skip_nonfinite: bool = False,
    ) -> tuple[DeviceReport, ...]:
        update = None if optimizer is None else Update(optimizer, init=fresh_state, skip_nonfinite=skip_nonfinite)
        if self._fused is not None and not record:
            return self._run_fused(self._fused, inputs, targets, update=update, keep_grads=keep_grads)
        if self._ticked is not None and not record:
            return self._run_ticked(self._ticked, inputs, targets, update=update, keep_grads=keep_grads)
        self._settle()
        return self._run_apart(inputs, targets, update=update, record=record, keep_grads=keep_grads)

    def _run_fused(
        self,
        fused: FusedStep,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        update: Update | None,
        keep_grads: bool,
    ) -> tuple[DeviceReport, ...]:
        """The step as one program. XLA reports a failure inside it as the program's: a step
        that donated nothing is dispatched again action by action, whose error names the
        failing stage and action."""
        for worker in self.workers:
            worker.applied = False
        try:
            return tuple(_report(r) for r in fused.run(inputs, targets, update=update, keep_grads=keep_grads))
        except ExecutionError:
            raise  # raised while a stage was traced: it names its stage already
        except Exception as error:
            failed = (
                "the step's one program (every device's work, one program as the pipeline devices share their JAX "
                f"devices) failed: {summary(error)}"
            )
            if update is None:
                self._run_apart(inputs, targets, update=None, record=False, keep_grads=keep_grads)
                raise ExecutionError(
                    f"{failed}; dispatched action by action, as RunOptions(fuse='off') runs it, the same step ran"
                ) from error
            intact = fused.intact()
            if not intact:
                self._broken()
            lost = "" if intact else "; its donated parameters and optimizer state are gone"
            raise ExecutionError(
                f"{failed}{lost}. RunOptions(fuse='off') runs the actions apart and names the one that fails"
            ) from error
        except BaseException:
            if not fused.intact():
                self._broken()
            raise

    def _run_ticked(
        self,
        ticked: TickedStep,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        update: Update | None,
        keep_grads: bool,
    ) -> tuple[DeviceReport, ...]:
        """The step as one SPMD program over the pipeline devices. A failure inside it is
        the program's: RunOptions(ticks=False) dispatches the tasks apart, whose error
        names the failing stage and action."""
        try:
            return tuple(_report(r) for r in ticked.run(inputs, targets, update=update, keep_grads=keep_grads))
        except ExecutionError:
            raise  # raised while a stage was traced: it names its stage already
        except Exception as error:
            message = program_failure(ticked, error)
            if not ticked.intact():
                self._broken()
            raise ExecutionError(message) from error
        except BaseException:
            if not ticked.intact():
                self._broken()
            raise

    def _run_apart(
        self,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        update: Update | None,
        record: bool,
        keep_grads: bool,
    ) -> tuple[DeviceReport, ...]:
        """The step with every action dispatched as a program of its own."""
        workers = self.workers
        schedule = self.program.schedule
        first, last = schedule.placement[0], schedule.placement[-1]
        exchange = LocalExchange(self._movers)
        origin = time.perf_counter()

        def steps(d: int) -> Steps[WorkerStep]:
            return workers[d].steps(
                exchange.endpoint(d),
                inputs if d == first else (),
                targets if d == last else (),
                update=update,
                recorder=Recorder(d, origin) if record else None,
                keep_grads=keep_grads,
            )

        for worker in workers:
            worker.applied = False  # a device stopped before its step starts keeps the last step's
        try:
            results, errors = run_watched(
                [steps(d) for d in range(len(workers))],
                exchange,
                timeout=self.recv_timeout,
                doing=lambda d: workers[d].doing(),
                progress=lambda: tuple(w.runtime.at for w in workers),
            )
        except BaseException:
            # Stalled or interrupted: the helper thread may still hold the workers, so
            # the next step gets new ones (and the driver's handles go out of date).
            self._broken()
            raise
        failed = [err for err in errors if err is not None]
        if failed:
            if any(w.applied for w in workers):
                # Some devices updated their state and others did not: start afresh.
                self._broken()
            # The first device to fail stopped the others.
            raise failed[0]
        return tuple(_report(r) for r in results)

    def _broken(self) -> None:
        self._compiled = None
        self._fused = None
        self._ticked = None
        self.workers = ()


def _report(step: WorkerStep) -> DeviceReport:
    return DeviceReport(
        # The loss stays a device array, read when the caller reads it: a step is
        # dispatched end to end without waiting for the devices.
        loss=step.loss,
        # Leaf by leaf: jax.device_get costs several times more per small array (jaxlib 0.10).
        grads={i: np.asarray(g) for i, g in step.grads.items()},
        peak_held=step.peak_held,
        leftover=step.leftover,
        events=step.events,
    )


def _leaf_shapes(params: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return treedef, tuple((tuple(v.shape), str(v.dtype)) for v in leaves)
