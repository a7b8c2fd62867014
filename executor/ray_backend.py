"""The Ray backend's driver side: one pipeline run by one ``jax.distributed`` world.

:class:`RayRunner` is what :class:`~pipedsl.executor.pipeline.Pipeline` delegates to with
``backend="ray"`` (or a :class:`~pipedsl.executor.ray_cluster.RayConfig`). It starts a
:class:`~pipedsl.executor.ray_cluster.RayWorld` of ``num_devices * dp * tp /
devices_per_process`` processes: pipeline device ``d``'s stage mesh is the devices of
processes ``d * P .. (d + 1) * P - 1`` (``P`` processes per mesh), ``dp`` rows across them
and ``tp`` inside each. The driver traces the model once (every error about the model is
raised before anything runs), ships it once (the processes trace it and compile their own
stages), and works out the order of every transfer
(:func:`pipedsl.rendezvous.exchange_order`). A step is then one ``run_step`` call per
process: the batch's leaves go to the processes of the first and last stages, and the
loss (and gradients, when asked) come back; values between stages are compiled
collectives inside the world and never pass through the driver or Ray's object store.

Parameters and optimizer state stay in the world. ``train_step`` returns :class:`Resident`
handles in place of them: passing a handle back moves nothing, passing plain arrays ships
them once (each process places its shards), :meth:`RayRunner.init` makes them in the world
(``Pipeline.init``), and :meth:`RayRunner.gather` brings a handle's values to the driver
as pytrees of numpy arrays. There is one resident copy, updated in place, so only the
latest handle is valid. ``value_and_grad`` returns the loss and gradients on the driver,
as numpy arrays.

``ray`` itself is never imported here (see :mod:`pipedsl.executor.ray_cluster`).
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedsl.executor.backend import StepResult
from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.mesh import MeshConfig, leaf_specs
from pipedsl.executor.optimizers import couples_through_global_norm
from pipedsl.executor.ray_actor import Failure, ModelSpec, StepReport, trace_model
from pipedsl.executor.ray_checkpoint import check_plan, finish_version, latest_version, new_version, plan_record
from pipedsl.executor.ray_cluster import DeviceSlot, RayConfig, RayWorld
from pipedsl.executor.ray_transport import assemble
from pipedsl.executor.stage_options import StageOptions
from pipedsl.executor.stages import StagedModel
from pipedsl.executor.timing import measured_timeline
from pipedsl.program import Program
from pipedsl.rendezvous import exchange_order

__all__ = ["Resident", "RayRunner", "world_shape"]

_NEXT_PIPELINE_ID = itertools.count()


@dataclass(frozen=True, slots=True)
class Resident:
    """Parameters (``kind="params"``) or optimizer state (``kind="opt_state"``) held by
    the world of Ray pipeline ``pipeline``, as of ``version``. Pass it back to the
    pipeline that returned it; ``pipeline.gather(handle)`` fetches the values."""

    kind: str
    pipeline: int
    version: int


@dataclass(frozen=True, slots=True)
class _Layout:
    model: StagedModel
    params: Any  # the parameters' pytree of jax.ShapeDtypeStruct
    spec: ModelSpec
    key: Any


def _avals(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v)), tree)


def world_shape(num_devices: int, mesh: MeshConfig, devices_per_process: int) -> int:
    """Processes per stage mesh for ``devices_per_process`` JAX devices each (module
    docstring); raises :class:`ExecutionError` for a layout that would split ``tp`` over
    processes or share a process between stage meshes."""
    if mesh.cp > 1:
        raise ExecutionError(
            f"context parallelism (cp={mesh.cp}) runs on the local backend only; the Ray world's stage meshes "
            "are dp x tp: use backend='local' or cp=1"
        )
    k = devices_per_process
    if mesh.size % k or k % mesh.tp:
        raise ExecutionError(
            f"a stage mesh of dp={mesh.dp} x tp={mesh.tp} does not split into processes of "
            f"devices_per_process={k}: data parallelism goes across processes and tensor parallelism stays "
            f"inside one, so devices_per_process must be a multiple of tp ({mesh.tp}) that divides "
            f"dp x tp ({mesh.size}); for example devices_per_process={mesh.tp}"
        )
    return mesh.size // k


class RayRunner:
    """Runs ``program`` on a Ray world for a model given as explicit ``stages`` or a
    marked ``model_fn`` (one of them), with ``loss``, per-stage ``stage_options`` (recompute, precision, sequence parallelism), every
    pipeline device a ``mesh.dp x mesh.tp`` mesh with the parameters placed by
    ``param_specs`` (see :mod:`pipedsl.executor.mesh`). ``recv_timeout`` bounds every wait
    inside a process, in seconds."""

    def __init__(
        self,
        program: Program,
        config: RayConfig,
        *,
        stages: tuple[Callable[[Any, Any], Any], ...] | None,
        model_fn: Callable[[Any, Any], Any] | None,
        loss: Callable[[Any, Any], Any],
        stage_options: tuple[StageOptions, ...],
        recv_timeout: float,
        mesh: MeshConfig,
        param_specs: Any,
    ) -> None:
        schedule = program.schedule
        self.program = program
        self.key = next(_NEXT_PIPELINE_ID)
        self._stages = stages
        self._model_fn = model_fn
        self._loss = loss
        self._options = stage_options
        self._recv_timeout = recv_timeout
        self._mesh = mesh
        self._specs = param_specs
        try:
            self._order = exchange_order(program)
        except ValueError as err:
            raise ExecutionError(f"schedule {schedule.name!r} cannot run: {err}") from None
        k = config.devices_per_process or mesh.tp
        self._per_mesh = world_shape(schedule.num_devices, mesh, k)
        self.world = RayWorld.start(schedule.num_devices * self._per_mesh, k, config, label=repr(schedule.name))
        self._installed: _Layout | None = None
        self._versions = {"params": 0, "opt_state": 0}
        self._optimizer: optax.GradientTransformation | None = None
        self._sent: tuple[Any, tuple[weakref.ref[Any], ...]] | None = None
        # Per process, the collective transfers it made in the last step.
        self.transfers: tuple[int, ...] = ()
        self._closed = False

    @classmethod
    def start(cls, program: Program, backend: str | RayConfig, **options: Any) -> RayRunner:
        """A runner on ``backend``: ``"ray"`` or a :class:`RayConfig`."""
        return cls(program, backend if isinstance(backend, RayConfig) else RayConfig(), **options)

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

    def _stage_of(self, rank: int) -> int | None:
        stages = self.program.schedule.stages_on(self.device_of(rank))
        return stages[0] if stages else None

    # -- the step ----------------------------------------------------------------------

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
        """One step (see :meth:`pipedsl.executor.pipeline.Pipeline.step`)."""
        self._check_open()
        if isinstance(params, Resident):
            self._check(params, "params")
            layout = self._installed
            assert layout is not None  # a handle exists only once installed
            self._check_shapes(layout, example_inputs, example_targets)
        else:
            layout = self._layout(_avals(params), example_inputs, example_targets)
            self._load_params(params, layout)
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
            if isinstance(opt_state, Resident):
                self._check(opt_state, "opt_state")
            elif opt_state is not None:
                self._load_states(opt_state, layout)
            update = opt_state is None
        reports = self._run(inputs, targets, update=update, record=record, return_grads=optimizer is None)
        return self._result(reports, layout, trained=optimizer is not None, record=record)

    def init(
        self, init: Callable[..., Any], args: tuple[Any, ...], example_params: Any, example: tuple[Any, Any]
    ) -> Resident:
        """Make the parameters in the world as ``init(*args)`` (each process its own
        shards); ``example_params`` gives their shapes (a pytree of
        ``jax.ShapeDtypeStruct``) and ``example`` one microbatch's inputs and targets."""
        self._check_open()
        self._layout(example_params, *example)
        self._call_all("init_params", ((init, tuple(args)), {}), what="making the parameters")
        self._sent = None
        self._versions["params"] += 1
        self._versions["opt_state"] += 1
        return self._handle("params")

    def _run(
        self, inputs: Sequence[Any], targets: Sequence[Any], *, update: bool | None, record: bool, return_grads: bool
    ) -> list[StepReport]:
        schedule = self.program.schedule
        first, last = schedule.placement[0], schedule.placement[-1]
        origin = time.time() if record else None
        host_inputs, host_targets = jax.device_get(list(inputs)), jax.device_get(list(targets))
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = []
        for r in range(self.world.num_processes):
            d = self.device_of(r)
            options = {"update": update, "origin": origin, "return_grads": return_grads}
            args.append(((host_inputs if d == first else [], host_targets if d == last else []), options))
        reports = self.world.call("run_step", args, what=f"a step of {schedule.name!r}", stage_of=self._stage_of)
        self._raise_failures(reports)
        self.transfers = tuple(r.moved for r in reports)
        return reports

    def _result(self, reports: Sequence[StepReport], layout: _Layout, *, trained: bool, record: bool) -> StepResult:
        schedule = self.program.schedule
        n = schedule.num_devices
        lead = [reports[self.ranks(d)[0]] for d in range(n)]
        timeline = None
        if record:
            timeline = measured_timeline([r.events for r in lead], name=schedule.name, num_devices=n)
        common: dict[str, Any] = {
            "loss": lead[schedule.placement[-1]].loss,
            "timeline": timeline,
            "peak_held": tuple(r.peak_held for r in lead),
            "leftover": tuple(r.leftover for r in lead),
        }
        if not trained:
            leaves: list[Any] = [None] * len(layout.model.param_avals)
            for d in range(n):
                parts = [reports[r].grads for r in self.ranks(d)]
                for i in parts[0]:
                    leaves[i] = assemble([p[i] for p in parts])
            grads = jax.tree_util.tree_unflatten(layout.model.param_treedef, leaves)
            return StepResult(grads=grads, params=None, opt_state=None, **common)
        self._sent = None
        self._versions["params"] += 1
        self._versions["opt_state"] += 1
        return StepResult(grads=None, params=self._handle("params"), opt_state=self._handle("opt_state"), **common)

    def gather(self, value: Any) -> Any:
        """The values behind a :class:`Resident` handle as a pytree of numpy arrays (the
        parameters in the structure the model takes; the optimizer state as a tuple of
        per-stage states); anything else is fetched to the driver as it is."""
        if not isinstance(value, Resident):
            return jax.device_get(value)
        self._check_open()
        self._check(value, value.kind)
        layout = self._installed
        assert layout is not None  # a handle exists only after a step
        params = value.kind == "params"
        parts = self._call_all(
            "gather", ((), {"params": params, "states": not params}), what=f"gathering the {value.kind}"
        )
        n = self.program.schedule.num_devices
        if params:
            leaves: list[Any] = [None] * len(layout.model.param_avals)
            for d in range(n):
                mine = [parts[r][0] for r in self.ranks(d)]
                for i in mine[0]:
                    leaves[i] = assemble([m[i] for m in mine])
            return jax.tree_util.tree_unflatten(layout.model.param_treedef, leaves)
        placement = self.program.schedule.placement
        states = []
        for s in range(len(placement)):
            mine = [parts[r][1][s] for r in self.ranks(placement[s])]
            states.append(assemble(mine))
        return tuple(states)

    # -- checkpoints ------------------------------------------------------------------

    def save(self, path: str | Path, *, step: int) -> Path:
        """Save the parameters and optimizer state the world holds as ``path/step-<step>``
        (see :mod:`pipedsl.executor.ray_checkpoint`): every process writes the shards it
        holds. Returns the version's directory."""
        self._check_open()
        layout = self._installed
        if layout is None:
            raise ExecutionError("nothing to save yet: the world holds parameters after a step or Pipeline.init")
        version = new_version(path, step)
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [
            ((str(version / f"device-{self.device_of(r)}"),), {}) for r in range(self.world.num_processes)
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
    ) -> tuple[Resident, Resident | None, int]:
        """Read the latest complete version under ``path`` back into the world: (params
        handle, optimizer state handle or None without ``optimizer``, its step). Refuses a
        checkpoint of another plan, saying what differs."""
        self._check_open()
        layout = self._layout(_avals(like_params), *example)
        step, version = latest_version(path)
        check_plan(version, self._plan(layout))
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [
            ((str(version / f"device-{self.device_of(r)}"), optimizer), {}) for r in range(self.world.num_processes)
        ]
        self._raise_failures(self.world.call("restore", args, what=f"restoring step {step}", stage_of=self._stage_of))
        self._sent = None
        if optimizer is not None:
            self._optimizer = optimizer
        self._versions["params"] += 1
        self._versions["opt_state"] += 1
        return self._handle("params"), (self._handle("opt_state") if optimizer is not None else None), step

    def _plan(self, layout: _Layout) -> dict[str, Any]:
        return plan_record(
            self.program.schedule,
            self._mesh,
            processes=self.world.num_processes,
            leaves=layout.model.param_avals,
            specs=layout.spec.specs,
        )

    def close(self) -> None:
        """End the world (its processes and their state)."""
        if self._closed:
            return
        self._closed = True
        self.world.close()

    # -- helpers ----------------------------------------------------------------------

    def _call_all(self, method: str, arg: tuple[tuple[Any, ...], dict[str, Any]], *, what: str) -> list[Any]:
        results = self.world.call(method, [arg] * self.world.num_processes, what=what, stage_of=self._stage_of)
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

    def _handle(self, kind: str) -> Resident:
        return Resident(kind, self.key, self._versions[kind])

    def _check(self, handle: Resident, kind: str) -> None:
        if handle.kind != kind:
            raise ExecutionError(f"a handle to {handle.kind} was passed where {kind} was expected")
        if handle.pipeline != self.key:
            raise ExecutionError(
                f"these {kind} are held by another Ray pipeline; gather them there and pass the arrays"
            )
        if handle.version != self._versions[kind]:
            raise ExecutionError(
                f"this {kind} handle is out of date (version {handle.version}; the world holds version "
                f"{self._versions[kind]}): the Ray backend keeps one copy, updated in place; gather a "
                "state when it is returned to keep it"
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

    def _check_shapes(self, layout: _Layout, example_inputs: Any, example_targets: Any) -> None:
        if self._key(layout.params, example_inputs, example_targets) != layout.key:
            raise ExecutionError(
                "this batch's shapes differ from those the world's stages were compiled for; a Ray pipeline "
                "runs one set of shapes (build another Pipeline for others)"
            )

    def _layout(self, params: Any, example_inputs: Any, example_targets: Any) -> _Layout:
        """The model traced for these shapes and installed in the world (once: a Ray
        pipeline compiles one set of shapes)."""
        key = self._key(params, example_inputs, example_targets)
        if self._installed is not None:
            if self._installed.key != key:
                self._check_shapes(self._installed, example_inputs, example_targets)
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
            stage_options=self._options,
            mesh=self._mesh,
            specs=specs,
        )
        model = trace_model(spec)  # here too: every error about the model is raised before anything runs
        layout = _Layout(model, params, spec, key)
        meshes = [tuple(i for r in self.ranks(d) for i in self.world.devices[r]) for d in range(schedule.num_devices)]
        shipped = self.world.put(spec)
        args = [
            (
                (shipped, self.program.devices[self.device_of(r)], meshes, self._order),
                {"recv_timeout": self._recv_timeout},
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
        self._installed = layout
        return layout

    def _load_params(self, params: Any, layout: _Layout) -> None:
        """Ship the parameters unless the world holds these very arrays already."""
        leaves = jax.tree_util.tree_leaves(params)
        sent = self._sent
        if (
            sent is not None
            and len(sent[1]) == len(leaves)
            and all(r() is x for r, x in zip(sent[1], leaves, strict=True))
        ):
            return
        host = jax.device_get(leaves)
        model = layout.model
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = []
        for r in range(self.world.num_processes):
            uses = sorted(
                {i for s in self.program.schedule.stages_on(self.device_of(r)) for i in model.stage_params[s]}
            )
            args.append((({i: host[i] for i in uses}, None), {}))
        self.world.call("load", args, what="sending the parameters", stage_of=self._stage_of)
        self._versions["params"] += 1
        if all(isinstance(x, jax.Array) for x in leaves):
            self._sent = (layout, tuple(weakref.ref(x) for x in leaves))

    def _load_states(self, opt_state: Any, layout: _Layout) -> None:
        num_stages = layout.model.num_stages
        if not isinstance(opt_state, tuple) or len(opt_state) != num_stages:
            raise ExecutionError(
                f"opt_state must be the tuple of {num_stages} per-stage states a previous "
                "train_step returned (gathered or as a handle), or None to start"
            )
        host = jax.device_get(opt_state)
        schedule = self.program.schedule
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [
            ((None, {s: host[s] for s in schedule.stages_on(self.device_of(r))}), {})
            for r in range(self.world.num_processes)
        ]
        self.world.call("load", args, what="sending the optimizer state", stage_of=self._stage_of)
        self._versions["opt_state"] += 1

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
