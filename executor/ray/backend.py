"""The Ray backend's driver side: one pipeline run by one ``jax.distributed`` world.

:class:`RayRunner` is what :class:`~pipedsl.executor.pipeline.Pipeline` delegates to with
``backend="ray"`` (or a :class:`~pipedsl.executor.ray.cluster.RayConfig`). It starts a
:class:`~pipedsl.executor.ray.cluster.RayWorld` of ``num_devices * dp * tp /
devices_per_process`` processes: pipeline device ``d``'s stage mesh is the devices of
processes ``d * P .. (d + 1) * P - 1`` (``P`` processes per mesh), ``dp`` rows across them
and ``tp`` inside each. The driver traces the model once (every error about the model is
raised before anything runs), ships it once (the processes trace it and compile their own
stages), and works out the order of every transfer
(:func:`pipedsl.rendezvous.exchange_order`). A step is then one ``run_step`` call per
process, made on the driver's own connection to it (:meth:`RayWorld.step`): the batch's
leaves go to the processes of the first and last stages, and each process answers once it
has dispatched its share; values between stages are compiled collectives inside the world and
never pass through the driver or Ray's object store. Gradients, when asked, come back in the
answers (so such a step waits for them, and its loss comes with them); a training step's loss
stays on the last stage's process until it is read (:mod:`pipedsl.executor.ray.remote_loss`),
so the step returns without waiting for its computations and copies nothing to the host.
Where every pipeline device is one device of its own process and ``RunOptions.ticks`` asks
for it, each process's share of a step
is the one program over the stage axis (:mod:`pipedsl.executor.local.ticked`), the same on
every process: one dispatch per process per step, its transfers the program's permutes.

Parameters and optimizer state stay in the world, made there (``Pipeline.init``: each
process computes its own shards), read from a checkpoint each process writes, or shipped
once from the driver's arrays; :class:`~pipedsl.executor.driver.Driver` hands them out as
handles, as it does on the local backend, and fetches them on request (each process its
shards, put together here).

``ray`` itself is never imported here (see :mod:`pipedsl.executor.ray.cluster`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from pipedsl.executor.backend import DeviceReport
from pipedsl.executor.driver import shapes_of
from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.ray.actor import Failure, ModelSpec, trace_model
from pipedsl.executor.ray.cluster import DeviceSlot, RayConfig, RayWorld
from pipedsl.executor.ray.remote_loss import RemoteLoss
from pipedsl.executor.ray.transport import assemble
from pipedsl.executor.runtime.optimizers import couples_through_global_norm
from pipedsl.executor.sharded_checkpoint import (
    device_part,
    finish_version,
    latest_readable,
    new_version,
    plan_record,
)
from pipedsl.executor.stages.mesh import leaf_specs
from pipedsl.executor.stages.model import StagedModel
from pipedsl.executor.stages.stage_options import StageOptions
from pipedsl.program import Program
from pipedsl.rendezvous import exchange_groups
from pipedsl.run_options import RunOptions

__all__ = ["RayRunner", "world_shape"]


@dataclass(frozen=True, slots=True)
class _Layout:
    model: StagedModel
    params: Any  # the parameters' pytree of jax.ShapeDtypeStruct
    spec: ModelSpec
    key: Any


def world_shape(num_devices: int, options: RunOptions, devices_per_process: int) -> int:
    """Processes per stage mesh for ``devices_per_process`` JAX devices each (module
    docstring); raises :class:`ExecutionError` for a layout that would split ``tp`` over
    processes or share a process between stage meshes."""
    if options.cp > 1:
        raise ExecutionError(
            f"context parallelism (cp={options.cp}) runs on the local backend only; the Ray world's stage meshes "
            "are dp x tp: use backend='local' or cp=1"
        )
    if options.fsdp is not None:
        raise ExecutionError(
            f"shard groups (fsdp={options.fsdp} of dp={options.dp}) run on the local backend only; the Ray world's"
            " stage meshes are dp x tp: use backend='local', or fsdp=None (ZeRO over all of dp)"
        )
    k = devices_per_process
    if options.mesh_size % k or k % options.tp:
        raise ExecutionError(
            f"a stage mesh of dp={options.dp} x tp={options.tp} does not split into processes of "
            f"devices_per_process={k}: data parallelism goes across processes and tensor parallelism stays "
            f"inside one, so devices_per_process must be a multiple of tp ({options.tp}) that divides "
            f"dp x tp ({options.mesh_size}); for example devices_per_process={options.tp}"
        )
    return options.mesh_size // k


class RayRunner:
    """Hosts ``program``'s pipeline devices in a Ray world, for a model given as explicit
    ``stages`` or a marked ``model_fn`` (one of them), with ``loss``, run as ``options`` say
    (every stage's recompute mode, precision and sequence parallelism; every pipeline device an
    ``options.dp x options.tp`` mesh with the parameters placed by ``param_specs``, see
    :mod:`pipedsl.executor.stages.mesh`; ``options.recv_timeout`` bounding every wait inside a
    process, in seconds); implements :class:`pipedsl.executor.backend.Backend`. ``backend`` is the
    :class:`RayConfig` of a world it starts for itself (and ends when it closes), or a
    started :class:`RayWorld` it runs on until it closes."""

    def __init__(
        self,
        program: Program,
        backend: RayConfig | RayWorld,
        *,
        stages: tuple[Callable[[Any, Any], Any], ...] | None,
        model_fn: Callable[[Any, Any], Any] | None,
        loss: Callable[[Any, Any], Any],
        options: RunOptions,
        param_specs: Any,
    ) -> None:
        schedule = program.schedule
        self.program = program
        self._stages = stages
        self._model_fn = model_fn
        self._loss = loss
        self._options = options
        self._stage_options = StageOptions.per_stage(options, schedule.num_stages)
        self._specs = param_specs
        try:
            self._order = exchange_groups(program)
        except ValueError as err:
            raise ExecutionError(f"schedule {schedule.name!r} cannot run: {err}") from None
        self._owns_world = isinstance(backend, RayConfig)
        k = (
            (backend.devices_per_process or options.tp)
            if isinstance(backend, RayConfig)
            else backend.devices_per_process
        )
        self._per_mesh = world_shape(schedule.num_devices, options, k)
        needs = schedule.num_devices * self._per_mesh
        if isinstance(backend, RayConfig):
            self.world = RayWorld.start(needs, devices_per_process=k, config=backend, label=repr(schedule.name))
        else:
            what = f"this plan ({schedule.num_devices} pipeline devices, each a {options.dp} x {options.tp} mesh)"
            backend.attach(self, needs=needs, what=what)
            self.world = backend
        self._installed: _Layout | None = None
        self._ticked = False
        self._optimizer: optax.GradientTransformation | None = None
        # Per process, the transfers it took part in during the last step, and the
        # collectives that made them (several transfers may go as one).
        self.transfers: tuple[int, ...] = ()
        self.collectives: tuple[int, ...] = ()
        self._closed = False
        self._steps_run = 0
        # Kept losses nobody will read, for their process to forget with the next step.
        self._unread: list[int] = []
        # Kept losses the caller may still read, fetched when the pipeline closes.
        self._held_losses: weakref.WeakValueDictionary[int, RemoteLoss] = weakref.WeakValueDictionary()

    @classmethod
    def start(cls, program: Program, backend: str | RayConfig | RayWorld, **options: Any) -> RayRunner:
        """A runner on ``backend``: ``"ray"``, a :class:`RayConfig` or a started :class:`RayWorld`."""
        return cls(program, RayConfig() if isinstance(backend, str) else backend, **options)

    # -- where things are ----------------------------------------------------------------

    def device_of(self, rank: int) -> int:
        """The pipeline device process ``rank`` runs."""
        return rank // self._per_mesh

    def ranks(self, device: int) -> range:
        """The processes of pipeline device ``device``'s mesh."""
        return range(device * self._per_mesh, (device + 1) * self._per_mesh)

    def placement(self) -> tuple[tuple[DeviceSlot, ...], ...]:
        """Per pipeline device, its mesh's devices (``dp x tp`` in row-major order) as
        (node id, process rank, global JAX device id)."""
        world = self.world
        return tuple(
            tuple(DeviceSlot(world.nodes[r].node_id, r, i) for r in self.ranks(d) for i in world.devices[r])
            for d in range(self.program.schedule.num_devices)
        )

    @property
    def ticked(self) -> bool:
        """Whether an unrecorded step runs as one SPMD program over the pipeline devices,
        every process dispatching the same program on its shards
        (:mod:`pipedsl.executor.local.ticked`); known once the stages are installed."""
        return self._ticked

    def _stage_of(self, rank: int) -> int | None:
        stages = self.program.schedule.stages_on(self.device_of(rank))
        return stages[0] if stages else None

    # -- the step ----------------------------------------------------------------------

    def install(self, params: Any, example_inputs: Any, example_targets: Any) -> tuple[StagedModel, bool]:
        """The model traced for these shapes and installed in the world (once: a Ray
        pipeline compiles one set of shapes); fresh the first time."""
        self._check_open()
        fresh = self._installed is None
        return self._layout(params, example_inputs, example_targets).model, fresh

    def load(self, leaves: Sequence[Any] | None, states: Sequence[Any] | None) -> None:
        """Ship parameter leaves and optimizer states; each process places its shards."""
        self._check_open()
        layout = self._installed
        assert layout is not None  # the driver installs first
        schedule = self.program.schedule
        host_leaves = None if leaves is None else jax.device_get(list(leaves))
        host_states = None if states is None else jax.device_get(tuple(states))
        model = layout.model
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = []
        for r in range(self.world.num_processes):
            stages = schedule.stages_on(self.device_of(r))
            mine = None
            if host_leaves is not None:
                mine = {i: host_leaves[i] for i in sorted({i for s in stages for i in model.stage_params[s]})}
            theirs = None if host_states is None else {s: host_states[s] for s in stages}
            args.append(((mine, theirs), {}))
        what = "sending the parameters" if leaves is not None else "sending the optimizer state"
        self._raise_failures(self.world.call("load", args, what=what, stage_of=self._stage_of))

    def make(self, init: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Make the parameters in the world as ``init(*args)`` (each process its own shards)."""
        self._check_open()
        self._call_all("init_params", ((init, tuple(args)), {}), what="making the parameters")

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
        """One step: a ``run_step`` call per process (the module docstring)."""
        self._check_open()
        if skip_nonfinite:
            raise ExecutionError(
                "skip_nonfinite: the Ray backend updates each pipeline device on its own and cannot skip a "
                "non-finite step's update on every device; gather the parameters before the step to keep them"
            )
        update = None
        if optimizer is not None:
            if optimizer is not self._optimizer:
                if self.program.schedule.num_devices > 1 and couples_through_global_norm(optimizer):
                    raise ExecutionError(
                        "this optimizer combines every parameter's gradient through the global norm "
                        "(optax.clip_by_global_norm); the Ray backend updates each pipeline device on its own, "
                        "so it is refused there: use backend='local', or clip each leaf (optax.clip)"
                    )
                self._call_all("optimizer", ((optimizer,), {}), what="sending the optimizer")
                self._optimizer = optimizer
            update = fresh_state
        schedule = self.program.schedule
        first, last = schedule.placement[0], schedule.placement[-1]
        origin = time.time() if record else None
        host_inputs, host_targets = jax.device_get(list(inputs)), jax.device_get(list(targets))
        # A step that ships gradients back, or is recorded, waits for its computations
        # anyway: its loss comes in the report. A training step's is kept where it is.
        kept = not keep_grads and not record
        step = self._steps_run
        self._steps_run += 1
        reporter = self.ranks(last)[0]
        unread, self._unread = self._unread, []
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = []
        for r in range(self.world.num_processes):
            d = self.device_of(r)
            options: dict[str, Any] = {"update": update, "origin": origin, "return_grads": keep_grads}
            if r == reporter:
                options |= {"loss": "keep" if kept else "report", "number": step, "forget": unread}
            else:
                options["loss"] = "drop"
            args.append(((host_inputs if d == first else [], host_targets if d == last else []), options))
        reports = self.world.step(args, what=f"a step of {schedule.name!r}", stage_of=self._stage_of, stop_at=_failed)
        self._raise_failures(reports)
        self.transfers = tuple(r.moved for r in reports)
        self.collectives = tuple(r.collectives for r in reports)
        out = []
        for d in range(schedule.num_devices):
            mine = [reports[r] for r in self.ranks(d)]
            lead = mine[0]
            grads = {i: assemble([m.grads[i] for m in mine]) for i in lead.grads}
            loss: Any = lead.loss
            if d == last and kept:
                loss = self._held_losses[step] = RemoteLoss(self, step)
            out.append(DeviceReport(loss, grads, lead.peak_held, lead.leftover, lead.events))
        return tuple(out)

    def fetch_loss(self, step: int) -> np.ndarray:
        """Step ``step``'s kept loss (:class:`~pipedsl.executor.ray.remote_loss.RemoteLoss`),
        waited for on its process and copied here."""
        self._check_open()
        reporter = self.ranks(self.program.schedule.placement[-1])[0]
        answer = self._ask(reporter, "loss", step, what=f"reading the loss of step {step}")
        assert isinstance(answer, np.ndarray)  # or a Failure, raised by _ask
        return answer

    def loss_ready(self, step: int) -> bool:
        """Whether step ``step``'s kept loss is computed; waits for nothing."""
        self._check_open()
        reporter = self.ranks(self.program.schedule.placement[-1])[0]
        return bool(self._ask(reporter, "loss_ready", step, what=f"asking after the loss of step {step}"))

    def forget_loss(self, step: int) -> None:
        """Step ``step``'s kept loss will not be read: its process drops it with the next step."""
        self._unread.append(step)

    def wait(self) -> None:
        """Return once every process has computed what it was given (the steps dispatched
        so far, their updates included), raising a failed computation's error."""
        self._check_open()
        none: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [((), {})] * self.world.num_processes
        answers = self.world.step(
            none, what="waiting for the steps dispatched", stage_of=self._stage_of, stop_at=_failed, method="wait"
        )
        self._raise_failures(answers)

    def _ask(self, rank: int, method: str, step: int, *, what: str) -> Any:
        """``method(step)`` on process ``rank``'s step connection, after the calls made there before."""
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [None] * self.world.num_processes
        args[rank] = ((step,), {})
        answer = self.world.step(args, what=what, stage_of=self._stage_of, method=method)[rank]
        self._raise_failures([answer])
        return answer

    def fetch(self, *, params: bool) -> tuple[dict[int, np.ndarray], dict[int, Any]]:
        """The owned parameter leaves (with ``params``) or the optimizer states, put
        together from every process's shards."""
        self._check_open()
        parts = self._call_all(
            "gather",
            ((), {"params": params, "states": not params}),
            what="gathering the " + ("parameters" if params else "optimizer state"),
        )
        leaves: dict[int, np.ndarray] = {}
        states: dict[int, Any] = {}
        for d in range(self.program.schedule.num_devices):
            mine = [parts[r] for r in self.ranks(d)]
            for i in mine[0][0]:
                leaves[i] = assemble([m[0][i] for m in mine])
            for s in mine[0][1]:
                states[s] = assemble([m[1][s] for m in mine])
        return leaves, states

    # -- checkpoints ------------------------------------------------------------------

    def save(self, path: str | Path, *, step: int) -> Path:
        """Save the parameters and optimizer state the world holds as ``path/step-<step>``
        (see :mod:`pipedsl.executor.sharded_checkpoint`): every process writes the shards it
        holds. Returns the version's directory."""
        self._check_open()
        layout = self._installed
        if layout is None:
            raise ExecutionError("nothing to save yet: the world holds parameters after a step or Pipeline.init")
        version = new_version(path, step)
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [
            ((device_part(version, self.device_of(r)),), {}) for r in range(self.world.num_processes)
        ]
        self._raise_failures(self.world.call("save", args, what=f"saving step {step}", stage_of=self._stage_of))
        finish_version(version, step, self._plan(layout))
        return version

    def restore(
        self,
        path: str | Path,
        like_params: Any,
        example: tuple[Any, Any],
        *,
        optimizer: optax.GradientTransformation | None,
    ) -> int:
        """Read the latest complete version under ``path`` back into the world (the
        optimizer state only with ``optimizer``) and return its step. Any plan of the same
        model reads it; another model's is refused, saying what differs."""
        self._check_open()
        layout = self._layout(shapes_of(like_params), *example)
        step, version, placement = latest_readable(path, self._plan(layout))
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [
            ((str(version), placement, optimizer), {})
        ] * self.world.num_processes
        self._raise_failures(self.world.call("restore", args, what=f"restoring step {step}", stage_of=self._stage_of))
        if optimizer is not None:
            self._optimizer = optimizer
        return step

    def _plan(self, layout: _Layout) -> dict[str, Any]:
        return plan_record(
            self.program.schedule,
            self._options,
            processes=self.world.num_processes,
            model=layout.model,
            specs=layout.spec.specs,
        )

    def close(self) -> None:
        """End the world (its processes and their state), or, on a world it was given, have
        the processes forget this pipeline."""
        if self._closed:
            return
        for loss in list(self._held_losses.values()):
            loss.settle()
        self._closed = True
        if self._owns_world:
            self.world.close()
        else:
            self.world.detach(self, stage_of=self._stage_of)

    # -- helpers ----------------------------------------------------------------------

    def _call_all(self, method: str, arg: tuple[tuple[Any, ...], dict[str, Any]], *, what: str) -> list[Any]:
        results = self.world.call(
            method, [arg] * self.world.num_processes, what=what, stage_of=self._stage_of, stop_at=_failed
        )
        self._raise_failures(results)
        return results

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutionError("this Ray pipeline is closed; build a new one")
        if self.world.closed:
            raise ExecutionError(
                "this Ray pipeline's world has been torn down (a process was lost, or it was closed); "
                "build a new Pipeline and restore the last checkpoint"
            )

    def _key(self, params: Any, example_inputs: Any, example_targets: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        batch = (example_inputs, example_targets)
        return (
            treedef,
            tuple((tuple(v.shape), str(v.dtype)) for v in leaves),
            jax.tree_util.tree_structure(batch),
            tuple((tuple(s.shape), str(s.dtype)) for s in jax.tree_util.tree_leaves(batch)),
        )

    def _layout(self, params: Any, example_inputs: Any, example_targets: Any) -> _Layout:
        """The model traced for these shapes and installed in the world (once: a Ray
        pipeline compiles one set of shapes)."""
        key = self._key(params, example_inputs, example_targets)
        if self._installed is not None:
            if self._installed.key != key:
                raise ExecutionError(
                    "these parameters' or this batch's shapes differ from those the world's stages were compiled "
                    "for; a Ray pipeline runs one set of shapes (build another Pipeline for others)"
                )
            return self._installed
        schedule = self.program.schedule
        specs = leaf_specs(self._specs, params)
        spec = ModelSpec(
            stages=self._stages,
            model_fn=self._model_fn,
            loss=self._loss,
            params=params,
            inputs=example_inputs,
            targets=example_targets,
            num_microbatches=schedule.num_microbatches,
            placement=schedule.placement,
            stage_options=self._stage_options,
            options=self._options,
            specs=specs,
            schedule=schedule,
        )
        model = trace_model(spec)  # here too: every error about the model is raised before anything runs
        layout = _Layout(model, params, spec, key)
        meshes = [tuple(i for r in self.ranks(d) for i in self.world.devices[r]) for d in range(schedule.num_devices)]
        shipped = self.world.put(spec)
        args = [
            (
                (shipped, self.program.devices[self.device_of(r)], meshes, self._order),
                {"recv_timeout": self._options.recv_timeout},
            )
            for r in range(self.world.num_processes)
        ]
        try:
            results = self.world.call("install", args, what="compiling the stages", stage_of=self._stage_of)
        except ExecutionError as err:
            raise ExecutionError(
                f"{err}; if the processes could not unpickle the model, its code must be importable on "
                "every node (install it there, or pass RayConfig(runtime_env={'py_modules': [...]}))"
            ) from err
        self._raise_failures(results)
        if len(set(results)) != 1:
            self.world.close()
            raise ExecutionError(
                "the world's processes disagree on whether a step runs as one program over the pipeline devices "
                f"({results}); the pipeline's Ray world has been torn down"
            )
        self._ticked = bool(results[0])
        self._installed = layout
        return layout

    def _raise_failures(self, reports: Sequence[Any]) -> None:
        failures = [r for r in reports if isinstance(r, Failure)]
        if not failures:
            return
        blame = failures[0]
        # The failed process's partners may wait in a collective that never comes: the
        # world cannot take another step.
        self.world.close()
        raise ExecutionError(
            f"{blame.message}; the pipeline's Ray world has been torn down: build a new Pipeline",
            stage=blame.stage,
            device=blame.device,
        )


def _failed(result: Any) -> bool:
    return isinstance(result, Failure)
