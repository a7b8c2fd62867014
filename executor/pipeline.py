"""The public face of the executor: a model, a loss and a schedule, run as a pipeline.

::

    sched = pipedsl.load("schedules/1f1b.sched", pp=4, microbatches=8)
    pipe = Pipeline([f0, f1, f2, f3], loss=loss_fn, schedule=sched)      # explicit stages
    pipe = Pipeline.from_function(model_fn, loss=loss_fn, schedule=sched)  # stage_boundary markers
    loss, grads = pipe.value_and_grad(params, (inputs, targets))
    params, opt_state, loss = pipe.train_step(params, opt_state, (inputs, targets), optimizer=opt)

The global batch is split along axis 0 into the schedule's microbatches. The loss and
the gradients are the mean over microbatches, so with a loss that averages over its
examples they equal ``jax.value_and_grad`` of the unsplit model on the whole batch.

Stages are traced and compiled on the first step for a given set of shapes (every
error about the model, the batch or a stage is raised then, before anything runs) and
reused afterwards.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedsl.executor.backend import Backend
from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.interpreter import optimizer_update, split_leading
from pipedsl.executor.local import LocalBackend
from pipedsl.executor.ray_backend import RayRunner
from pipedsl.executor.ray_cluster import RayConfig, RayDevices
from pipedsl.executor.split import marked_model
from pipedsl.executor.stages import StagedModel, StageProgram, compile_stage, explicit_model
from pipedsl.ir import Schedule
from pipedsl.program import Buffer, Program
from pipedsl.timeline import Timeline

__all__ = ["Pipeline", "StepResult"]


@dataclass(frozen=True, slots=True)
class StepResult:
    """Everything one step produced.

    Attributes:
      loss: the mean loss over microbatches (a scalar array on the last stage's device).
      grads: gradients with the structure of ``params`` (each leaf on the device of the
        stage that owns it); None after an optimizer step, which consumes them.
      params: the updated parameters after an optimizer step, else None.
      opt_state: the optimizer state after an optimizer step (a tuple, one optax state
        per stage, over the leaves that stage owns), else None.
      timeline: the measured timeline when the step was recorded, else None.
      peak_held: per device, the most (stage, microbatch) pairs whose residuals it held
        at once (equals the schedule's peak in-flight count).
      leftover: per device, buffers still held after the step (always empty).
    """

    loss: jax.Array
    grads: Any
    params: Any
    opt_state: tuple[Any, ...] | None
    timeline: Timeline | None
    peak_held: tuple[int, ...]
    leftover: tuple[tuple[Buffer, ...], ...]


@dataclass(frozen=True, slots=True)
class _Plan:
    model: StagedModel
    programs: tuple[StageProgram, ...]


# Compiled stages, shared by every pipeline of the same model (the same stage functions
# or model_fn, loss, shapes, microbatch count and remat flags): comparing schedules of
# one model compiles its stages once (per JAX device they run on). Least recently used
# plans are dropped beyond this many.
_PLAN_CACHE_SIZE = 16
_PLANS: OrderedDict[Any, _Plan] = OrderedDict()


@dataclass(frozen=True, slots=True)
class _Batch:
    """The batch's input and target leaves, checked to split into ``count``
    microbatches, and one microbatch's shapes as pytrees for tracing."""

    inputs: list[Any]
    targets: list[Any]
    count: int
    example_inputs: Any
    example_targets: Any


class Pipeline:
    """A model run by a pipeline schedule.

    Args:
      stages: one function ``f_s(params_s, x) -> y`` per stage of the schedule; the last
        stage's output goes to ``loss``.
      loss: ``loss(y, targets) -> scalar``; it should average over the microbatch's
        examples (the pipeline averages over microbatches).
      schedule: the schedule to run (validated and lowered here).
      backend: ``"local"`` (one JAX device per pipeline device in this process), ``"ray"``
        (one Ray actor per pipeline device; a :class:`~pipedsl.executor.ray_cluster.RayConfig`
        sets its options, a :class:`~pipedsl.executor.ray_cluster.RayDevices` shares
        started actors; see :mod:`pipedsl.executor.ray_backend`) or a
        :class:`pipedsl.executor.backend.Backend`.
      remat: recompute each stage's forward during its backward instead of keeping its
        intermediates: one flag for all stages or one per stage.
      devices: for the local backend, the JAX device of each pipeline device (default:
        the first ones JAX reports).
      recv_timeout: seconds any device waits for another before giving up.
    """

    def __init__(
        self,
        stages: Sequence[Callable[[Any, Any], Any]],
        *,
        loss: Callable[[Any, Any], Any],
        schedule: Schedule,
        backend: str | Backend | RayConfig | RayDevices = "local",
        remat: bool | Sequence[bool] = False,
        devices: Sequence[jax.Device] | None = None,
        recv_timeout: float = 300.0,
    ) -> None:
        stages = tuple(stages)
        if len(stages) != schedule.num_stages:
            raise ExecutionError(
                f"the model has {len(stages)} stages but schedule {schedule.name!r} has "
                f"{schedule.num_stages}; give one stage function per schedule stage"
            )
        self._setup(stages, None, loss, schedule, backend, remat, devices, recv_timeout)

    @classmethod
    def from_function(
        cls,
        model_fn: Callable[[Any, Any], Any],
        *,
        loss: Callable[[Any, Any], Any],
        schedule: Schedule,
        backend: str | Backend | RayConfig | RayDevices = "local",
        remat: bool | Sequence[bool] = False,
        devices: Sequence[jax.Device] | None = None,
        recv_timeout: float = 300.0,
    ) -> Pipeline:
        """A pipeline for ``model_fn(params, x) -> y`` split at its ``stage_boundary``
        markers (see :mod:`pipedsl.executor.split`); ``params`` is then the pytree
        ``model_fn`` takes. Other arguments as for :class:`Pipeline`."""
        pipe = cls.__new__(cls)
        pipe._setup(None, model_fn, loss, schedule, backend, remat, devices, recv_timeout)
        return pipe

    def _setup(
        self,
        stages: tuple[Callable[[Any, Any], Any], ...] | None,
        model_fn: Callable[[Any, Any], Any] | None,
        loss: Callable[[Any, Any], Any],
        schedule: Schedule,
        backend: str | Backend | RayConfig | RayDevices,
        remat: bool | Sequence[bool],
        devices: Sequence[jax.Device] | None,
        recv_timeout: float,
    ) -> None:
        self.schedule = schedule
        self.program: Program = schedule.lower()
        self._stages = stages
        self._model_fn = model_fn
        self._loss = loss
        if isinstance(remat, bool):
            self._remat = (remat,) * schedule.num_stages
        else:
            self._remat = tuple(bool(r) for r in remat)
            if len(self._remat) != schedule.num_stages:
                raise ExecutionError(f"remat has {len(self._remat)} flags; the schedule has {schedule.num_stages} stages")
        self._ray: RayRunner | None = None
        if backend == "ray" or isinstance(backend, (RayConfig, RayDevices)):
            # Parameters live in the actors, so the runner takes over whole steps.
            self._ray = RayRunner.start(
                self.program,
                backend,  # type: ignore[arg-type]
                stages=stages,
                model_fn=model_fn,
                loss=loss,
                remat=self._remat,
                recv_timeout=recv_timeout,
            )
            # A pipeline dropped without close() still releases its actors when collected
            # (at exit, Ray's own shutdown stops them).
            release = weakref.finalize(self, self._ray.close)
            release.atexit = False  # type: ignore[misc]  # a documented attribute typeshed lacks
        elif isinstance(backend, str):
            if backend != "local":
                raise ExecutionError(f"unknown backend {backend!r}; available: 'local', 'ray'")
            self.backend: Backend = LocalBackend(self.program, devices=devices, recv_timeout=recv_timeout)
        else:
            self.backend = backend

    # -- public steps -------------------------------------------------------------

    def value_and_grad(self, params: Any, batch: tuple[Any, Any]) -> tuple[jax.Array, Any]:
        """(mean loss, gradients) of one step over ``batch = (inputs, targets)``."""
        result = self.step(params, batch)
        return result.loss, result.grads

    def train_step(
        self,
        params: Any,
        opt_state: tuple[Any, ...] | None,
        batch: tuple[Any, Any],
        *,
        optimizer: optax.GradientTransformation,
    ) -> tuple[Any, tuple[Any, ...], jax.Array]:
        """One optimizer step: (new params, new optimizer state, mean loss).

        ``opt_state`` is None on the first step (it is then initialised) and the state
        this method returned afterwards. Each stage's update runs on its own device
        over the leaves it owns, so ``optimizer`` must treat leaves independently (as
        sgd, momentum, adam and adamw do); pass the same optimizer object every step.
        """
        result = self.step(params, batch, optimizer=optimizer, opt_state=opt_state)
        assert result.opt_state is not None  # set by every optimizer step
        return result.params, result.opt_state, result.loss

    def step(
        self,
        params: Any,
        batch: tuple[Any, Any],
        *,
        optimizer: optax.GradientTransformation | None = None,
        opt_state: tuple[Any, ...] | None = None,
        record: bool = False,
    ) -> StepResult:
        """Run one step and return everything it produced (see :class:`StepResult`).

        With ``optimizer`` the gradients are applied; with ``record`` every action and
        transfer is timed into ``StepResult.timeline`` (slower: each device waits for
        each action to finish).
        """
        cut = self._split_batch(batch)
        if self._ray is not None:
            return self._ray.step(
                params,
                cut.inputs,
                cut.targets,
                cut.example_inputs,
                cut.example_targets,
                optimizer=optimizer,
                opt_state=opt_state,
                record=record,
            )
        plan = self._plan(params, cut)
        model = plan.model
        placement = self.schedule.placement
        leaves = jax.tree_util.tree_leaves(self._param_tree(params))
        stage_params = {
            s: self.backend.place(tuple(leaves[i] for i in idx), placement[s]) for s, idx in enumerate(model.stage_params)
        }
        inputs = self._microbatches(cut.inputs, cut.count, placement[0])
        targets = self._microbatches(cut.targets, cut.count, placement[-1])
        run = self.backend.run_step(dict(enumerate(plan.programs)), stage_params, inputs, targets, record=record)
        stage_grads = {s: g for dev in run.devices for s, g in dev.grads.items()}
        leaf_grads = self._sum_shared(model, stage_grads)
        loss = run.devices[placement[-1]].loss
        common = dict(
            loss=loss,
            timeline=run.timeline,
            peak_held=tuple(d.peak_held for d in run.devices),
            leftover=tuple(d.leftover for d in run.devices),
        )
        if optimizer is None:
            grads = jax.tree_util.tree_unflatten(model.param_treedef, leaf_grads)
            return StepResult(grads=grads, params=None, opt_state=None, **common)
        new_leaves, new_state = self._update(model, optimizer, opt_state, leaf_grads, stage_params, leaves)
        new_params = jax.tree_util.tree_unflatten(model.param_treedef, new_leaves)
        return StepResult(grads=None, params=new_params, opt_state=new_state, **common)

    def gather(self, value: Any) -> Any:
        """``value`` (parameters, optimizer state, gradients) on the driver as numpy arrays.

        On Ray, ``train_step`` returns handles to the state its actors hold
        (:class:`pipedsl.executor.ray_backend.Resident`); this fetches them.
        """
        return self._ray.gather(value) if self._ray is not None else jax.device_get(value)

    def close(self) -> None:
        """Release what the backend holds for this pipeline (on Ray: the actors' state,
        and the actors themselves unless they were shared); the local backend holds nothing."""
        if self._ray is not None:
            self._ray.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compile(self, params: Any, batch: tuple[Any, Any]) -> tuple[StageProgram, ...]:
        """The compiled stage programs for these shapes (built on the first step anyway;
        exposed for inspection and benchmarks)."""
        return self._plan(params, self._split_batch(batch)).programs

    # -- internals ------------------------------------------------------------------

    def _param_tree(self, params: Any) -> Any:
        return list(params) if self._stages is not None and isinstance(params, (list, tuple)) else params

    def _split_batch(self, batch: tuple[Any, Any]) -> _Batch:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ExecutionError("the batch must be a pair (inputs, targets) of arrays or pytrees of arrays")
        inputs, targets = batch
        x_leaves = jax.tree_util.tree_leaves(inputs)
        t_leaves = jax.tree_util.tree_leaves(targets)
        shapes = [np.shape(leaf) for leaf in x_leaves + t_leaves]
        if not shapes or any(len(s) == 0 for s in shapes):
            raise ExecutionError("every leaf of the batch needs a leading batch axis (axis 0)")
        sizes = sorted({s[0] for s in shapes})
        if len(sizes) != 1:
            raise ExecutionError(f"the batch's leaves disagree on the batch size (axis 0): {sizes}")
        size, count = sizes[0], self.schedule.num_microbatches
        if size % count:
            raise ExecutionError(
                f"a batch of {size} examples does not split into {count} equal microbatches; "
                f"use a batch size that is a multiple of {count}"
            )
        per = size // count

        def example(tree: Any) -> Any:
            return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct((per, *np.shape(leaf)[1:]), jnp.result_type(leaf)), tree)

        return _Batch(x_leaves, t_leaves, count, example(inputs), example(targets))

    def _microbatches(self, leaves: list[Any], count: int, device: int) -> list[tuple[Any, ...]]:
        """Per microbatch, its slice of every leaf, on pipeline device ``device``."""
        parts = [self.backend.call(device, split_leading, self.backend.place(leaf, device), count) for leaf in leaves]
        return [tuple(part[m] for part in parts) for m in range(count)]

    def _plan(self, params: Any, batch: _Batch) -> _Plan:
        tree = self._param_tree(params)
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        key = (
            self._stages if self._stages is not None else self._model_fn,
            self._loss,
            self.schedule.num_stages,
            self.schedule.num_microbatches,
            self._remat,
            treedef,
            tuple((np.shape(v), str(jnp.result_type(v))) for v in leaves),
            jax.tree_util.tree_structure((batch.example_inputs, batch.example_targets)),
            tuple((s.shape, str(s.dtype)) for s in jax.tree_util.tree_leaves((batch.example_inputs, batch.example_targets))),
        )
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
        placement = self.schedule.placement
        if self._stages is not None:
            model = explicit_model(
                self._stages, self._loss, tree, batch.example_inputs, batch.example_targets, placement=placement
            )
        else:
            assert self._model_fn is not None  # set by from_function
            model = marked_model(
                self._model_fn,
                self._loss,
                tree,
                batch.example_inputs,
                batch.example_targets,
                num_stages=self.schedule.num_stages,
                placement=placement,
            )
        programs = tuple(
            compile_stage(
                model,
                s,
                num_microbatches=self.schedule.num_microbatches,
                remat=self._remat[s],
                device=placement[s],
            )
            for s in range(model.num_stages)
        )
        plan = _Plan(model, programs)
        _PLANS[key] = plan
        if len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
        return plan

    def _sum_shared(self, model: StagedModel, stage_grads: dict[int, tuple[Any, ...]]) -> list[Any]:
        """Per flat leaf, the sum of every using stage's gradient, on the owner's device."""
        placement = self.schedule.placement
        total: list[Any] = [None] * len(model.param_avals)
        for s, idx in enumerate(model.stage_params):
            for g, i in zip(stage_grads[s], idx, strict=True):
                if total[i] is None:
                    total[i] = g
                else:
                    total[i] = total[i] + self.backend.place(g, placement[model.owner[i]])
        return total

    def _update(
        self,
        model: StagedModel,
        optimizer: optax.GradientTransformation,
        opt_state: tuple[Any, ...] | None,
        leaf_grads: list[Any],
        stage_params: dict[int, tuple[Any, ...]],
        leaves: list[Any],
    ) -> tuple[list[Any], tuple[Any, ...]]:
        placement = self.schedule.placement
        if opt_state is not None and (not isinstance(opt_state, tuple) or len(opt_state) != model.num_stages):
            raise ExecutionError(
                f"opt_state must be the tuple of {model.num_stages} per-stage states a previous "
                "train_step returned, or None to start"
            )
        update = optimizer_update(optimizer)
        new_leaves = list(leaves)
        states = []
        for s in range(model.num_stages):
            owned = model.owned(s)
            position = {i: k for k, i in enumerate(model.stage_params[s])}
            treedef = model.owned_treedefs[s]
            params_s = jax.tree_util.tree_unflatten(treedef, [stage_params[s][position[i]] for i in owned])
            # Placing the state commits every leaf to the stage's device (optax creates
            # some, such as step counts, on the default device), so the update compiled
            # for the first step serves every later one.
            state = self.backend.call(placement[s], optimizer.init, params_s) if opt_state is None else opt_state[s]
            state = self.backend.place(state, placement[s])
            grads_s = jax.tree_util.tree_unflatten(treedef, [leaf_grads[i] for i in owned])
            params_s, state = self.backend.call(placement[s], update, grads_s, state, params_s)
            for i, leaf in zip(owned, jax.tree_util.tree_leaves(params_s), strict=True):
                new_leaves[i] = leaf
            states.append(state)
        return new_leaves, tuple(states)
