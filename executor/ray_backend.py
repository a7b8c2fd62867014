"""The Ray backend's driver side: one pipeline run by Ray actors, one per device.

:class:`RayRunner` is what :class:`~pipedsl.executor.pipeline.Pipeline` delegates to
with ``backend="ray"`` (or a :class:`~pipedsl.executor.ray_cluster.RayConfig`, or a
shared :class:`~pipedsl.executor.ray_cluster.RayDevices`). The driver traces the model
once, for its layout (which stage uses which parameter leaf, who owns it) and to raise
every error about the model before anything runs; it ships the model's code and
example shapes once (one object in Ray's object store, read by every actor), and each
actor traces and compiles its own stages. A step is then one ``run_step`` call per
actor (see :mod:`pipedsl.executor.ray_actor`): the driver sends the microbatches to the
first and last stages' actors and gets back the loss, per-device counts and, when asked,
gradients and recorded events.

Parameters and optimizer state stay in the actors. ``train_step`` returns
:class:`Resident` handles in place of them: passing a handle back moves nothing,
passing plain arrays ships them once (and they become the resident copy), and
:meth:`RayRunner.gather` brings a handle's values to the driver as ordinary pytrees of
numpy arrays. There is one resident copy, updated in place, so only the latest handle
is valid; gather what you want to keep (:mod:`pipedsl.executor.checkpoint` saves it).
``value_and_grad`` returns the loss and gradients on the driver, as numpy arrays.

Measured timelines: every actor records its events on its own wall clock relative to
the step's start, which the driver converts with the clock offset measured when the
actor started (:attr:`RayDevices.offsets`); on one machine the offsets are ~0, across
machines they remove the clocks' skew up to half a round trip. The step starts when
the driver sends it, so the first events include the dispatch latency.

``ray`` itself is never imported here (see :mod:`pipedsl.executor.ray_cluster`).
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedsl.executor.backend import StepResult
from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.mesh import MeshConfig, leaf_specs
from pipedsl.executor.ray_actor import Failure, ModelSpec, RayUpdate, StepReport, trace_model
from pipedsl.executor.ray_cluster import DeviceLost, RayConfig, RayDevices
from pipedsl.executor.stage_options import StageOptions
from pipedsl.executor.stages import StagedModel
from pipedsl.executor.timing import measured_timeline
from pipedsl.program import Program

__all__ = ["Resident", "RayRunner"]

# Model ids, shared by every runner of this process: actors cache compiled stages by
# id, so pipelines of the same model (same functions, shapes, microbatches, remat)
# reuse them. The keys hold the model's functions, so an id is never reused.
_MODEL_IDS: OrderedDict[Any, int] = OrderedDict()
_MODEL_ID_CACHE = 64
_NEXT_MODEL_ID = itertools.count()
_NEXT_OPTIMIZER_ID = itertools.count()
_NEXT_PIPELINE_ID = itertools.count()


@dataclass(frozen=True, slots=True)
class Resident:
    """Parameters (``kind="params"``) or optimizer state (``kind="opt_state"``) held by
    the actors of Ray pipeline ``pipeline``, as of ``version``. Pass it back to the
    pipeline that returned it; ``pipeline.gather(handle)`` fetches the values."""

    kind: str
    pipeline: int
    version: int


@dataclass(frozen=True, slots=True)
class _Layout:
    model_id: int
    model: StagedModel
    params: Any  # the parameters' pytree of jax.ShapeDtypeStruct
    spec: ModelSpec


def _avals(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v)), tree)


def _same_avals(a: Any, b: Any) -> bool:
    a_leaves, a_def = jax.tree_util.tree_flatten(a)
    b_leaves, b_def = jax.tree_util.tree_flatten(b)
    same_tree: bool = a_def == b_def  # type: ignore[operator]  # PyTreeDef's stubs lack __eq__
    return same_tree and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a_leaves, b_leaves, strict=True))


def _identities(layout: _Layout, leaves: list[Any]) -> tuple[_Layout, tuple[weakref.ref[Any], ...]] | None:
    """What :meth:`RayRunner._holds` compares later parameter leaves with, or None when
    some leaf is not a JAX array (a numpy array may change in place)."""
    if not all(isinstance(x, jax.Array) for x in leaves):
        return None
    return layout, tuple(weakref.ref(x) for x in leaves)


class RayRunner:
    """Runs ``program`` on Ray actors for a model given as explicit ``stages`` or a
    marked ``model_fn`` (one of them), with ``loss`` and per-stage ``remat`` flags.

    ``devices`` are the actors (at least as many as the schedule has devices; device d
    runs on ``devices.actors[d]``); with ``owns_devices`` they are closed with the
    runner. ``recv_timeout`` bounds every wait inside an actor, in seconds. Every
    actor runs its device on a ``mesh.dp x mesh.tp`` mesh of its own JAX devices, with
    the parameters placed by ``param_specs`` (see :mod:`pipedsl.executor.mesh`).
    """

    def __init__(
        self,
        program: Program,
        devices: RayDevices,
        *,
        owns_devices: bool,
        stages: tuple[Callable[[Any, Any], Any], ...] | None,
        model_fn: Callable[[Any, Any], Any] | None,
        loss: Callable[[Any, Any], Any],
        remat: tuple[StageOptions, ...],
        recv_timeout: float,
        mesh: MeshConfig,
        param_specs: Any,
    ) -> None:
        schedule = program.schedule
        if devices.num_devices < schedule.num_devices:
            raise ExecutionError(
                f"schedule {schedule.name!r} needs {schedule.num_devices} devices; the Ray device "
                f"group has {devices.num_devices}"
            )
        self.program = program
        self.devices = devices
        self.key = next(_NEXT_PIPELINE_ID)
        self._owns_devices = owns_devices
        self._stages = stages
        self._model_fn = model_fn
        self._loss = loss
        self._remat = remat
        self._recv_timeout = recv_timeout
        self._mesh = mesh
        self._specs = param_specs
        self._layouts: dict[Any, _Layout] = {}
        self._installed: _Layout | None = None
        self._params: Any = None  # pytree of ShapeDtypeStruct of the resident parameters
        self._versions = {"params": 0, "opt_state": 0}
        self._optimizers: dict[int, tuple[int, optax.GradientTransformation]] = {}
        self._shipped: set[int] = set()
        # (layout, a weak reference per leaf) of the JAX arrays the actors hold as their
        # parameters, when they were given as such. Only a step changes what the actors
        # hold, and a step clears this until it has succeeded without an update.
        self._sent: tuple[_Layout, tuple[weakref.ref[Any], ...]] | None = None
        self._closed = False

    @classmethod
    def start(
        cls,
        program: Program,
        backend: str | RayConfig | RayDevices,
        **options: Any,
    ) -> RayRunner:
        """A runner on ``backend``: ``"ray"`` or a :class:`RayConfig` start devices of
        its own (closed with it); a :class:`RayDevices` is shared."""
        if isinstance(backend, RayDevices):
            return cls(program, backend, owns_devices=False, **options)
        config = backend if isinstance(backend, RayConfig) else RayConfig()
        mesh: MeshConfig = options["mesh"]
        devices = RayDevices.start(
            program.schedule.num_devices, config, jax_devices=mesh.size, label=repr(program.schedule.name)
        )
        try:
            return cls(program, devices, owns_devices=True, **options)
        except BaseException:
            devices.close()
            raise

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
        """One step over the batch's leaves ``inputs``/``targets``, of which
        ``example_inputs``/``example_targets`` give one microbatch's shapes (see
        :meth:`pipedsl.executor.pipeline.Pipeline.step`)."""
        self._check_open()
        # The given parameters' leaves, flattened once for every use below (None for the
        # resident handle).
        given = None if isinstance(params, Resident) else jax.tree_util.tree_leaves(self._param_tree(params))
        layout, loads = self._prepared(params, given, example_inputs, example_targets)
        update = self._prepare_update(optimizer, opt_state, layout) if optimizer is not None else None
        # What the actors hold is known again once the step succeeds: a step that loads or
        # updates may fail halfway.
        kept, self._sent = self._sent, None
        reports = self._run(inputs, targets, loads=loads, update=update, record=record, return_grads=optimizer is None)
        if optimizer is None:
            self._sent = kept if loads is None or given is None else _identities(layout, given)
        if update is not None:
            self._shipped.add(update.optimizer_id)
        return self._result(reports, layout, trained=optimizer is not None, record=record)

    def _prepared(
        self, params: Any, given: list[Any] | None, example_inputs: Any, example_targets: Any
    ) -> tuple[_Layout, list[Any] | None]:
        """The layout of these parameters and shapes, installed on the actors, and per
        device the leaves of ``given`` (the leaves of ``params``; None for the resident
        handle) it is to load with the step, or None when there is nothing to load."""
        if given is None:
            self._check(params, "params")
            tree = self._params
        else:
            tree = _avals(self._param_tree(params))
        layout = self._layout(tree, example_inputs, example_targets)
        if self._installed is not layout:
            self._install(layout)
        if given is None or self._holds(given, layout):
            return layout, None
        return layout, self._params_to_load(given, layout)

    def _holds(self, leaves: list[Any], layout: _Layout) -> bool:
        """Whether the actors hold these parameter leaves already: the very JAX arrays
        (immutable) the last successful step loaded, with no update since. The local
        backend moves such arrays to their devices only once too (:meth:`Worker.load`)."""
        sent = self._sent
        if sent is None or sent[0] is not layout:
            return False
        return len(leaves) == len(sent[1]) and all(ref() is leaf for ref, leaf in zip(sent[1], leaves, strict=True))

    def _run(
        self,
        inputs: Sequence[Any],
        targets: Sequence[Any],
        *,
        loads: list[Any] | None,
        update: RayUpdate | None,
        record: bool,
        return_grads: bool,
    ) -> list[StepReport]:
        """One ``run_step`` call per actor (the batch to the first and last stages'
        actors, and ``loads[d]``, parameters to load first, to device d); every device's
        report, failures raised."""
        schedule = self.program.schedule
        n = schedule.num_devices
        first, last = schedule.placement[0], schedule.placement[-1]
        step = self.devices.next_step()
        origin = time.time() if record else None
        host_inputs, host_targets = jax.device_get(list(inputs)), jax.device_get(list(targets))
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [None] * self.devices.num_devices
        for d in range(n):
            args[d] = (
                (self.key, step, host_inputs if d == first else [], host_targets if d == last else []),
                {
                    "params": None if loads is None else loads[d],
                    "update": update,
                    "origin": None if origin is None else origin + self.devices.offsets[d],
                    "return_grads": return_grads,
                },
            )
        reports = self.devices.call(
            "run_step", args, what=f"a step of {schedule.name!r}", step=step, stages=self._stages_on
        )[:n]
        self._raise_failures(reports)
        return reports

    def _result(self, reports: Sequence[StepReport], layout: _Layout, *, trained: bool, record: bool) -> StepResult:
        """The step's result from the devices' reports: gradients on the driver, or new
        handles to the resident parameters and optimizer state."""
        schedule = self.program.schedule
        timeline = None
        if record:
            timeline = measured_timeline([r.events for r in reports], name=schedule.name, num_devices=len(reports))
        common: dict[str, Any] = {
            "loss": reports[schedule.placement[-1]].loss,
            "timeline": timeline,
            "peak_held": tuple(r.peak_held for r in reports),
            "leftover": tuple(r.leftover for r in reports),
        }
        if not trained:
            leaves: list[Any] = [None] * len(layout.model.param_avals)
            for report in reports:
                for i, g in report.grads.items():
                    leaves[i] = g
            grads = jax.tree_util.tree_unflatten(layout.model.param_treedef, leaves)
            return StepResult(grads=grads, params=None, opt_state=None, **common)
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
        n = self.program.schedule.num_devices
        args = [((self.key,), {"params": params, "states": not params}) for _ in range(n)]
        parts = self.devices.call("gather", args, what=f"gathering the {value.kind}")
        if params:
            leaves: list[Any] = [None] * len(layout.model.param_avals)
            for owned, _ in parts:
                for i, v in owned.items():
                    leaves[i] = v
            return jax.tree_util.tree_unflatten(layout.model.param_treedef, leaves)
        placement = self.program.schedule.placement
        return tuple(parts[placement[s]][1][s] for s in range(len(placement)))

    def close(self) -> None:
        """Forget this pipeline's state in the actors; close the devices if they are its own."""
        if self._closed:
            return
        self._closed = True
        if self.devices.closed:
            return
        if self._owns_devices:
            self.devices.close()
            return
        n = self.program.schedule.num_devices
        self.devices.call("release", [((self.key,), {}) for _ in range(n)], what="releasing a pipeline")

    # -- helpers ----------------------------------------------------------------------

    def _stages_on(self, device: int) -> tuple[int, ...]:
        return self.program.schedule.stages_on(device)

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutionError("this Ray pipeline is closed; build a new one")
        if self.devices.closed:
            raise ExecutionError(
                "this Ray pipeline's devices are closed (a device was lost, or they were closed); "
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
                f"this {kind} handle is out of date (version {handle.version}; the actors hold version "
                f"{self._versions[kind]}): the Ray backend keeps one copy, updated in place; gather a "
                "state when it is returned to keep it"
            )

    def _param_tree(self, params: Any) -> Any:
        return list(params) if self._stages is not None and isinstance(params, (list, tuple)) else params

    def _layout(self, params: Any, example_inputs: Any, example_targets: Any) -> _Layout:
        schedule = self.program.schedule
        leaves, treedef = jax.tree_util.tree_flatten(params)
        batch = (example_inputs, example_targets)
        key = (
            self._stages if self._stages is not None else self._model_fn,
            self._loss,
            schedule.num_microbatches,
            schedule.placement,
            self._remat,
            self._mesh,
            leaf_specs(self._specs, params),
            treedef,
            tuple((v.shape, str(v.dtype)) for v in leaves),
            jax.tree_util.tree_structure(batch),
            tuple((s.shape, str(s.dtype)) for s in jax.tree_util.tree_leaves(batch)),
        )
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        spec = ModelSpec(
            stages=self._stages,
            model_fn=self._model_fn,
            loss=self._loss,
            params=params,
            inputs=example_inputs,
            targets=example_targets,
            num_microbatches=schedule.num_microbatches,
            placement=schedule.placement,
            remat=self._remat,
            mesh=self._mesh,
            specs=leaf_specs(self._specs, params),
        )
        # Traced here too: every error about the model is raised before anything runs.
        model = trace_model(spec)
        model_id = _MODEL_IDS.get(key)
        if model_id is None:
            model_id = next(_NEXT_MODEL_ID)
            _MODEL_IDS[key] = model_id
            if len(_MODEL_IDS) > _MODEL_ID_CACHE:
                _MODEL_IDS.popitem(last=False)
        layout = _Layout(model_id, model, params, spec)
        self._layouts[key] = layout
        return layout

    def _install(self, layout: _Layout) -> None:
        spec = self.devices.put(layout.spec)
        n = self.program.schedule.num_devices
        args = [
            (
                (self.key, self.program.devices[d], layout.model_id, spec),
                {"num_devices": n, "recv_timeout": self._recv_timeout},
            )
            for d in range(n)
        ]
        try:
            failures = self.devices.call("install", args, what="compiling the stages", stages=self._stages_on)
        except DeviceLost:
            raise
        except ExecutionError as err:
            if self.devices.closed:  # timed out: the message says why
                raise
            raise ExecutionError(
                f"{err}; if the actors could not unpickle the model, its code must be importable on "
                "every node (install it there, or pass RayConfig(runtime_env={'py_modules': [...]}))",
                device=err.device,
            ) from err
        self._raise_failures([f for f in failures if f is not None])
        self._installed = layout

    def _params_to_load(self, given: list[Any], layout: _Layout) -> list[dict[int, Any]]:
        """Per device, the parameter leaves of ``given`` its stages use, by flat index:
        sent with the step (one call per actor, not a load and then a step), they replace
        the resident parameters, so the resident handles move on a version."""
        leaves = jax.device_get(given)
        model = layout.model
        loads = []
        for d in range(self.program.schedule.num_devices):
            uses = sorted({i for s in self._stages_on(d) for i in model.stage_params[s]})
            loads.append({i: leaves[i] for i in uses})
        if self._params is not None and not _same_avals(self._params, layout.params):
            # Parameters of another shape: the resident optimizer state no longer fits.
            self._versions["opt_state"] += 1
        self._params = layout.params
        self._versions["params"] += 1
        return loads

    def _prepare_update(self, optimizer: optax.GradientTransformation, opt_state: Any, layout: _Layout) -> RayUpdate:
        entry = self._optimizers.get(id(optimizer))
        if entry is None or entry[1] is not optimizer:
            entry = (next(_NEXT_OPTIMIZER_ID), optimizer)
            self._optimizers[id(optimizer)] = entry
        optimizer_id = entry[0]
        init = opt_state is None
        if isinstance(opt_state, Resident):
            self._check(opt_state, "opt_state")
        elif opt_state is not None:
            self._load_states(opt_state, layout)
        return RayUpdate(optimizer_id, None if optimizer_id in self._shipped else optimizer, init)

    def _load_states(self, opt_state: Any, layout: _Layout) -> None:
        num_stages = layout.model.num_stages
        if not isinstance(opt_state, tuple) or len(opt_state) != num_stages:
            raise ExecutionError(
                f"opt_state must be the tuple of {num_stages} per-stage states a previous "
                "train_step returned (gathered or as a handle), or None to start"
            )
        host = jax.device_get(opt_state)
        args: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [
            ((self.key, None, {s: host[s] for s in self._stages_on(d)}), {})
            for d in range(self.program.schedule.num_devices)
        ]
        self.devices.call("load", args, what="sending the optimizer state")
        self._versions["opt_state"] += 1

    def _raise_failures(self, reports: Sequence[Any]) -> None:
        failures = [r for r in reports if isinstance(r, Failure)]
        if not failures:
            return
        if any(f.updated for f in failures):
            # Some devices applied their update and others did not: no handle is valid.
            self._versions["params"] += 1
            self._versions["opt_state"] += 1
        blame = next((f for f in failures if not f.peer), failures[0])
        raise ExecutionError(
            f"{blame.message} [device {blame.device} runs on {self.devices.nodes[blame.device]}]",
            stage=blame.stage,
            device=blame.device,
        )
