"""The local backend: every pipeline device is a mesh of JAX devices of this process.

Pipeline device d runs on a ``dp x tp`` mesh (:mod:`pipedsl.executor.mesh`) of the
first ``pp x dp x tp`` devices JAX reports (CPU devices come from
``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set before JAX is imported;
GPUs are found as they are) or of a list given explicitly. With ``dp = tp = 1`` an
explicit list may name one JAX device several times: the pipeline then runs correctly
but its devices share that device's compute.

Each pipeline device is a :class:`~pipedsl.executor.worker.Worker`. JAX dispatches work
asynchronously, so the workers' steps only queue work and the JAX devices execute it
concurrently: one thread runs every device's step, switching where one waits for a value
not sent yet (:mod:`pipedsl.executor.cooperative`). A recorded step waits for each
action's result where it runs, so there each device runs on a thread of its own (the
first on the calling thread) and blocks only on that or on a receive (with a timeout).
Either way a failure on one device stops every other device at once, and the step
raises the original error.

Parameters and optimizer state live in the workers between steps; a step returns them
as the arrays the workers hold, and passing those same arrays back moves nothing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedsl.executor.backend import StepResult
from pipedsl.executor.cooperative import Outcome, run_together
from pipedsl.executor.errors import ExecutionError, PeerFailed
from pipedsl.executor.interpreter import Steps, drive
from pipedsl.executor.mesh import MeshConfig, build_meshes, leaf_specs
from pipedsl.executor.split import marked_model
from pipedsl.executor.stage_options import StageOptions
from pipedsl.executor.stage_program import StageProgram
from pipedsl.executor.stages import StagedModel, explicit_model
from pipedsl.executor.timing import Recorder, measured_timeline
from pipedsl.executor.transport import LocalExchange, resharder
from pipedsl.executor.worker import Update, Worker, WorkerStep, compile_device
from pipedsl.program import Program

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
    """Runs a lowered :class:`Program` with one worker per pipeline device (see the
    module docstring); implements :class:`pipedsl.executor.backend.Backend`.

    ``stages`` (explicit) or ``model_fn`` (marked) is the model; ``mesh`` the SPMD shape
    of every pipeline device; ``param_specs`` the parameters' ``PartitionSpec`` pytree
    (None: replicated). ``recv_timeout`` bounds every wait for another device, in seconds.
    """

    def __init__(
        self,
        program: Program,
        *,
        stages: tuple[Callable[[Any, Any], Any], ...] | None,
        model_fn: Callable[[Any, Any], Any] | None,
        loss: Callable[[Any, Any], Any],
        stage_options: tuple[StageOptions, ...],
        mesh: MeshConfig,
        param_specs: Any,
        devices: Sequence[jax.Device] | None = None,
        recv_timeout: float = 300.0,
    ) -> None:
        schedule = program.schedule
        self.program = program
        self.config = mesh
        self.meshes = build_meshes(schedule.num_devices, mesh, devices=devices, what=f"schedule {schedule.name!r}")
        self.recv_timeout = recv_timeout
        self._movers = tuple(resharder(m) for m in self.meshes)  # kept: each caches its copies
        self._stages = stages
        self._model_fn = model_fn
        self._loss = loss
        self._options = stage_options
        self._specs = param_specs
        self._workers: tuple[Worker, ...] = ()
        self._compiled: CompiledStages | None = None
        self._held: tuple[Any, CompiledStages] | None = None  # (cache key, stages) of the last step
        self._returned: list[Any] | None = None  # the parameter leaves the last step returned

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
            self._options,
            treedef,
            tuple((np.shape(v), str(jnp.result_type(v))) for v in leaves),
            jax.tree_util.tree_structure(batch),
            tuple((s.shape, str(s.dtype)) for s in jax.tree_util.tree_leaves(batch)),
            tuple(tuple(m.devices.flat) for m in self.meshes),
            specs,
            self.config,
        )
        if self._held is not None and self._held[0] == key:
            return self._held[1]
        found = _COMPILED.get(key)
        if found is not None:
            _COMPILED.move_to_end(key)
            self._held = (key, found)
            return found
        placement = schedule.placement
        if self._stages is not None:
            model = explicit_model(self._stages, self._loss, tree, example_inputs, example_targets, placement=placement)
        else:
            assert self._model_fn is not None  # one of the two forms is always given
            model = marked_model(
                self._model_fn,
                self._loss,
                tree,
                example_inputs,
                example_targets,
                num_stages=schedule.num_stages,
                placement=placement,
            )
        programs: dict[int, StageProgram] = {}
        for d in range(schedule.num_devices):
            programs |= compile_device(
                model,
                schedule.stages_on(d),
                self.meshes[d],
                specs=specs,
                zero=self.config.zero,
                reduce_once=self.config.reduce_once,
                num_microbatches=schedule.num_microbatches,
                stage_options=self._options,
                placement=placement,
            )
        found = CompiledStages(model, tuple(programs[s] for s in range(model.num_stages)))
        _COMPILED[key] = found
        if len(_COMPILED) > _CACHE_SIZE:
            _COMPILED.popitem(last=False)
        self._held = (key, found)
        return found

    def _workers_for(self, compiled: CompiledStages) -> tuple[Worker, ...]:
        if compiled is not self._compiled:
            schedule = self.program.schedule
            programs = dict(enumerate(compiled.programs))
            self._workers = tuple(
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
            self._returned = None
        return self._workers

    # -- the step ------------------------------------------------------------------

    def step(
        self,
        params: Any,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        example_inputs: Any,
        example_targets: Any,
        *,
        optimizer: optax.GradientTransformation | None,
        opt_state: Any,
        record: bool,
    ) -> StepResult:
        compiled = self.compiled(params, example_inputs, example_targets)
        workers = self._workers_for(compiled)
        model = compiled.model
        leaves = jax.tree_util.tree_leaves(params)
        returned = self._returned
        if (
            returned is None
            or len(returned) != len(leaves)
            or any(a is not b for a, b in zip(leaves, returned, strict=True))
        ):
            for worker in workers:
                worker.load(leaves_by_index(leaves), None)
        update = None
        if optimizer is not None:
            self._load_states(workers, opt_state, model.num_stages)
            update = Update(optimizer, init=opt_state is None)
        runs = self._run(workers, inputs, targets, update=update, record=record)
        schedule = self.program.schedule
        common: dict[str, Any] = {
            "loss": runs[schedule.placement[-1]].loss,
            "timeline": None,
            "peak_held": tuple(r.peak_held for r in runs),
            "leftover": tuple(r.leftover for r in runs),
        }
        if record:
            common["timeline"] = measured_timeline(
                [r.events for r in runs], name=schedule.name, num_devices=schedule.num_devices
            )
        if optimizer is None:
            grads = [None] * len(leaves)
            for run in runs:
                for i, g in run.grads.items():
                    grads[i] = g
            return StepResult(
                grads=jax.tree_util.tree_unflatten(model.param_treedef, grads), params=None, opt_state=None, **common
            )
        new_leaves = list(leaves)
        for worker in workers:
            for i in worker.owned:
                new_leaves[i] = worker.leaves[i]
        self._returned = new_leaves
        placement = schedule.placement
        states = tuple(workers[placement[s]].states[s] for s in range(model.num_stages))
        new_params = jax.tree_util.tree_unflatten(model.param_treedef, new_leaves)
        return StepResult(grads=None, params=new_params, opt_state=states, **common)

    def gather(self, value: Any) -> Any:
        return jax.device_get(value)

    def close(self) -> None:
        """The workers' state is dropped with the backend; nothing else is held."""
        self._workers = ()
        self._compiled = None
        self._held = None

    def _load_states(self, workers: Sequence[Worker], opt_state: Any, num_stages: int) -> None:
        if opt_state is None:
            return
        if not isinstance(opt_state, tuple) or len(opt_state) != num_stages:
            raise ExecutionError(
                f"opt_state must be the tuple of {num_stages} per-stage states a previous "
                "train_step returned, or None to start"
            )
        for worker in workers:
            if any(worker.states.get(s) is not opt_state[s] for s in worker.local):
                worker.load(None, {s: opt_state[s] for s in worker.local})

    def _run(
        self,
        workers: Sequence[Worker],
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        update: Update | None,
        record: bool,
    ) -> tuple[WorkerStep, ...]:
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
                keep_grads=update is None,
            )

        try:
            if record:
                # Recording waits for every action where it runs: a thread per device
                # keeps the devices' actions overlapping as they do unrecorded.
                results, errors = self._on_threads(workers, steps, exchange)
            else:
                results, errors = run_together(
                    [steps(d) for d in range(len(workers))],
                    exchange,
                    timeout=self.recv_timeout,
                    doing=lambda d: workers[d].doing(),
                    progress=lambda: tuple(w.runtime.at for w in workers),
                )
        except BaseException:
            # Stalled or interrupted: a thread may still hold the workers, so the next
            # step gets new ones.
            self._returned = None
            self._compiled = None
            raise
        failed = [err for err in errors if err is not None]
        if failed:
            if any(w.applied for w in workers):
                # Some devices updated their state and others did not: start afresh.
                self._returned = None
            # Devices that gave up because of another's failure only echo it.
            raise next((err for err in failed if not isinstance(err, PeerFailed)), failed[0])
        return tuple(r for r in results if r is not None)

    def _on_threads(
        self, workers: Sequence[Worker], steps: Callable[[int], Steps[WorkerStep]], exchange: LocalExchange
    ) -> Outcome:
        """Run device d's ``steps(d)`` on a thread of its own (device 0 on this one)."""
        results: list[Any] = [None] * len(workers)
        errors: list[BaseException | None] = [None] * len(workers)

        def work(d: int) -> None:
            try:
                results[d] = drive(steps(d), exchange.endpoint(d), timeout=self.recv_timeout)
            except BaseException as err:  # reported to the caller by _run
                errors[d] = err
                exchange.fail(d)

        threads = [
            threading.Thread(target=work, args=(d,), name=f"pipedsl-device-{d}", daemon=True)
            for d in range(1, len(workers))
        ]
        for thread in threads:
            thread.start()
        work(0)
        stalled = self._join(workers, threads, errors)
        if stalled is not None:
            raise stalled
        return results, errors

    def _join(
        self,
        workers: Sequence[Worker],
        threads: Sequence[threading.Thread],
        errors: Sequence[BaseException | None],
    ) -> ExecutionError | None:
        """Wait for the device threads (device d runs on ``threads[d - 1]``) at most
        ``recv_timeout`` seconds after device 0 is done or failed: every device that
        waits for another gives up within that time, so a thread still running then is
        stalled. Return the error naming the first such device, else None."""
        deadline = time.monotonic() + self.recv_timeout
        for d, thread in enumerate(threads, start=1):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                gave_up = next((err for err in errors if err is not None), None)
                cause = f"; meanwhile: {gave_up}" if gave_up is not None else ""
                return ExecutionError(
                    f"device {d} is stalled: still {workers[d].doing()} {self.recv_timeout:g} s after the "
                    f"other devices stopped (recv_timeout){cause}",
                    device=d,
                )
        return None


def leaves_by_index(leaves: Sequence[Any]) -> dict[int, Any]:
    """``{i: leaves[i]}``: flat parameter leaves as a worker loads them."""
    return dict(enumerate(leaves))
