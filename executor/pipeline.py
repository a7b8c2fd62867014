"""The public face of the executor: a model, a loss and a schedule, run as a pipeline.

::

    sched = pipedsl.load("schedules/1f1b.sched", pp=4, microbatches=8)
    pipe = Pipeline([f0, f1, f2, f3], loss=loss_fn, schedule=sched)      # explicit stages
    pipe = Pipeline.from_function(model_fn, loss=loss_fn, schedule=sched)  # stage_boundary markers
    pipe = Pipeline(stages, loss=loss_fn, schedule=sched, options=RunOptions(dp=2, zero=1))  # 2 x 1 meshes
    loss, grads = pipe.value_and_grad(params, (inputs, targets))
    params, opt_state, loss = pipe.train_step(params, opt_state, (inputs, targets), optimizer=opt)
    params = pipe.gather(params)                                            # numpy, on the driver

Both backends return the same types: the loss is a scalar array (on the local backend not
waited for: a step returns once it is dispatched), the gradients come back to the driver as
numpy; parameters and optimizer state stay on the pipeline devices after an optimizer
step (or :meth:`Pipeline.init`), as :class:`~pipedsl.executor.backend.Resident` handles to
pass to the next step, and :meth:`Pipeline.gather` fetches them. One driver
(:mod:`pipedsl.executor.driver`) runs the steps of either backend.

The global batch is split along axis 0 into the schedule's microbatches. The loss and
the gradients are the mean over microbatches, so with a loss that averages over its
examples they equal ``jax.value_and_grad`` of the unsplit model on the whole batch.

Stages are traced and compiled on the first step for a given set of shapes (every
error about the model, the batch or a stage is raised then, before anything runs) and
reused afterwards.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedsl import library
from pipedsl.executor.backend import Backend, Resident, StepResult
from pipedsl.executor.compilation_cache import enable_compilation_cache
from pipedsl.executor.driver import Driver, shapes_of
from pipedsl.executor.errors import ExecutionError, NonFiniteStep
from pipedsl.executor.functions import check_functions
from pipedsl.executor.local.backend import LocalBackend
from pipedsl.executor.ray.backend import RayRunner
from pipedsl.executor.ray.cluster import DeviceSlot, RayConfig, RayWorld
from pipedsl.executor.stages.mesh import DATA
from pipedsl.executor.stages.stage_program import StageProgram
from pipedsl.ir import Schedule
from pipedsl.policy import Policy
from pipedsl.program import Program, lower
from pipedsl.run_options import RunOptions
from pipedsl.stage_costs import UNIFORM, CostSource
from pipedsl.synthesize import synthesize

__all__ = ["Pipeline", "StepResult"]


@dataclass(frozen=True, slots=True)
class _Batch:
    """The batch's input and target leaves, checked to split into ``count``
    microbatches (each over ``dp`` data-parallel devices), and one microbatch's shapes
    as pytrees for tracing."""

    inputs: list[Any]
    targets: list[Any]
    count: int
    example_inputs: Any
    example_targets: Any


class Pipeline:
    """A model run by a pipeline schedule, every pipeline device an SPMD mesh.

    Args:
      stages: one function ``f_s(params_s, x) -> y`` per stage of the schedule; the last
        stage's output goes to ``loss``.
      loss: ``loss(y, targets) -> scalar``; it should average over the microbatch's
        examples (the pipeline averages over microbatches).
      schedule: the schedule to run (validated and lowered here), or a library name or
        ``.sched`` path, loaded with its default parameters. A schedule with one
        device (``pp = 1``, e.g. ``1f1b``) runs the SPMD baselines: one stage over the
        whole mesh, gradients accumulated over microbatches (``1f1b`` keeps one
        microbatch's activations at a time, ``gpipe`` every microbatch's). A policy
        (``zb_auto``, or a :class:`~pipedsl.policy.Policy`) is synthesised here
        (:func:`pipedsl.synthesize.synthesize`) against ``costs``.
      options: how it runs (:class:`~pipedsl.run_options.RunOptions`, checked when made):
        every pipeline device a ``dp x cp x tp`` mesh with ZeRO stage ``zero``, each stage's
        ``recompute`` mode (what the model passes through
        :func:`~pipedsl.executor.stages.stage_options.selective` is the ``"selective"`` part),
        ``precision``, ``sequence_parallel`` (what the model passes through
        :func:`~pipedsl.executor.stages.stage_options.sequence_sharded`), ``fuse`` and
        ``recv_timeout``; the defaults run one JAX device per pipeline device in fp32.
        ``dp`` splits every microbatch (its size must divide by ``dp``) over the mesh axis
        ``"data"``, and XLA reduces the gradients inside the stage programs.
      backend: ``"local"`` (every pipeline device a mesh of JAX devices of this process),
        ``"ray"`` (one ``jax.distributed`` world of Ray processes, a stage mesh possibly
        spanning several; a :class:`~pipedsl.executor.ray.cluster.RayConfig` sets its
        options; see :mod:`pipedsl.executor.ray.backend`), or a started
        :class:`~pipedsl.executor.ray.cluster.RayWorld` to run on (and leave running when
        this pipeline closes).
      devices: for the local backend, the JAX devices of every pipeline device in order,
        ``dp x cp x tp`` each (default: the first ones JAX reports).
      param_specs: a pytree with the structure of the parameters (or a prefix of it)
        whose leaves are ``jax.sharding.PartitionSpec`` over the axis ``"tensor"`` (None:
        replicated); see :mod:`pipedsl.executor.models` for the built-in transformer's.
      costs: for a policy schedule, the costs its order is synthesised against (the
        simulator's ``CostModel``, or :class:`~pipedsl.stage_costs.StageCosts`); None: the
        uniform default, with a warning that says so. Refused for a schedule with an order.

    Attributes:
      schedule: the schedule it runs (a policy's synthesised order); program: it lowered.
      options: the :class:`~pipedsl.run_options.RunOptions` it runs with.
    """

    def __init__(
        self,
        stages: Sequence[Callable[[Any, Any], Any]],
        *,
        loss: Callable[[Any, Any], Any],
        schedule: Schedule | Policy | str | os.PathLike[str],
        options: RunOptions = RunOptions(),
        backend: str | RayConfig | RayWorld = "local",
        devices: Sequence[jax.Device] | None = None,
        param_specs: Any = None,
        costs: CostSource | None = None,
    ) -> None:
        schedule = _schedule_argument(schedule, costs)
        if not isinstance(stages, Iterable) or isinstance(stages, str):
            raise ExecutionError(
                f"stages must be a list of stage functions, one per stage; got {type(stages).__name__}"
            )
        stages = tuple(stages)
        if len(stages) != schedule.num_stages:
            raise ExecutionError(
                f"the model has {len(stages)} stages but schedule {schedule.name!r} has "
                f"{schedule.num_stages}; give one stage function per schedule stage"
            )
        self._setup(stages, None, loss, schedule, options, backend, devices, param_specs)

    @classmethod
    def from_function(
        cls,
        model_fn: Callable[[Any, Any], Any],
        *,
        loss: Callable[[Any, Any], Any],
        schedule: Schedule | Policy | str | os.PathLike[str],
        options: RunOptions = RunOptions(),
        backend: str | RayConfig | RayWorld = "local",
        devices: Sequence[jax.Device] | None = None,
        param_specs: Any = None,
        costs: CostSource | None = None,
    ) -> Pipeline:
        """A pipeline for ``model_fn(params, x) -> y`` split at its ``stage_boundary``
        markers (see :mod:`pipedsl.executor.stages.split`); ``params`` is then the pytree
        ``model_fn`` takes (and ``param_specs`` mirrors it). Other arguments as for
        :class:`Pipeline`."""
        pipe = cls.__new__(cls)
        pipe._setup(None, model_fn, loss, _schedule_argument(schedule, costs), options, backend, devices, param_specs)
        return pipe

    def _setup(
        self,
        stages: tuple[Callable[[Any, Any], Any], ...] | None,
        model_fn: Callable[[Any, Any], Any] | None,
        loss: Callable[[Any, Any], Any],
        schedule: Schedule,
        options: RunOptions,
        backend: str | RayConfig | RayWorld,
        devices: Sequence[jax.Device] | None,
        param_specs: Any,
    ) -> None:
        if not isinstance(options, RunOptions):
            raise ExecutionError(
                f"options must be a pipedsl.RunOptions, such as RunOptions(dp=2, zero=1); got {type(options).__name__}"
            )
        check_functions(loss=loss, stages=stages, model_fn=model_fn)
        enable_compilation_cache()
        self.schedule = schedule
        self.program: Program = lower(schedule)
        self._last_batch: tuple[Any, _Batch] | None = None
        self._stages = stages
        self.options = options
        self.backend: LocalBackend | RayRunner
        if backend == "ray" or isinstance(backend, (RayConfig, RayWorld)):
            self.backend = RayRunner.start(
                self.program,
                backend,
                stages=stages,
                model_fn=model_fn,
                loss=loss,
                options=options,
                param_specs=param_specs,
            )
            # A pipeline dropped without close() still ends (or leaves) its world when
            # collected (at exit, Ray's own shutdown stops the processes).
            release = weakref.finalize(self, self.backend.close)
            release.atexit = False  # type: ignore[misc]  # a documented attribute typeshed lacks
        elif backend == "local":
            self.backend = LocalBackend(
                self.program,
                stages=stages,
                model_fn=model_fn,
                loss=loss,
                options=options,
                devices=devices,
                param_specs=param_specs,
            )
        else:
            raise ExecutionError(
                f"unknown backend {backend!r}; available: 'local', 'ray' (or a RayConfig, or a started RayWorld)"
            )
        hosts: Backend = self.backend
        self.driver = Driver(self.program, hosts)

    # -- public steps -------------------------------------------------------------

    def value_and_grad(self, params: Any, batch: tuple[Any, Any]) -> tuple[Any, Any]:
        """(mean loss, a scalar array as :meth:`train_step` returns it; gradients as numpy,
        in the structure of ``params``) of one step over ``batch = (inputs, targets)``. ``params`` are arrays or a
        :class:`~pipedsl.executor.backend.Resident` handle this pipeline returned."""
        result = self.step(params, batch)
        return result.loss, result.grads

    def train_step(
        self,
        params: Any,
        opt_state: tuple[Any, ...] | None,
        batch: tuple[Any, Any],
        *,
        optimizer: optax.GradientTransformation,
        check_finite: bool = False,
        skip_nonfinite: bool = False,
    ) -> tuple[Resident, Resident, Any]:
        """One optimizer step: (handle to the new params, handle to the new optimizer
        state, mean loss: a scalar array, not waited for: on the local backend a device
        array, on Ray a :class:`~pipedsl.executor.ray.remote_loss.RemoteLoss` that the last
        stage's process keeps until it is read).

        The parameters and optimizer state stay on the pipeline devices: pass the handles
        back to the next step (nothing moves) and fetch the values with :meth:`gather`.
        ``params`` may also be arrays (shipped once); ``opt_state`` is None on the first
        step (it is then initialised), then the handle this method returned (or a
        gathered state). Each stage's update runs on its own mesh over
        the leaves it owns, so ``optimizer`` must treat leaves independently (as sgd,
        momentum, adam and adamw do); pass the same optimizer object every step.

        With ``skip_nonfinite`` (local backend), where the loss or any gradient is not
        finite the devices keep their parameters and optimizer state, decided on the
        devices without reading anything on the host: the handles returned then hold the
        values that went in. With ``check_finite``, a NaN or infinite loss raises
        ExecutionError; it waits for the loss, and on the local backend it skips that
        step's update as ``skip_nonfinite`` does (on Ray the update is applied: keep the
        parameters that went in).
        """
        if not isinstance(optimizer, optax.GradientTransformation):
            raise ExecutionError(
                f"train_step: optimizer must be an optax.GradientTransformation such as optax.adam(1e-3),"
                f" got {type(optimizer).__name__}; value_and_grad gives the gradients without an update"
            )
        local = isinstance(self.backend, LocalBackend)
        skip = skip_nonfinite or (check_finite and local)
        result = self.step(params, batch, optimizer=optimizer, opt_state=opt_state, skip_nonfinite=skip)
        if result.params is None or result.opt_state is None:
            raise ExecutionError("train_step: the backend returned no state for an optimizer step")
        if check_finite and not math.isfinite(float(result.loss)):
            kept = (
                "the step's update was skipped: the error's params and opt_state handles hold what went in"
                if local
                else "the step's update is applied: keep the parameters that went in"
            )
            raise NonFiniteStep(
                f"train_step: the loss is {float(result.loss)} (check_finite=True); {kept}; look for the"
                " stage that overflowed (pipedsl run names it)",
                params=result.params,
                opt_state=result.opt_state,
            )
        return result.params, result.opt_state, result.loss

    def step(
        self,
        params: Any,
        batch: tuple[Any, Any],
        *,
        optimizer: optax.GradientTransformation | None = None,
        opt_state: tuple[Any, ...] | None = None,
        record: bool = False,
        skip_nonfinite: bool = False,
    ) -> StepResult:
        """Run one step and return everything it produced (see :class:`StepResult`).

        With ``optimizer`` the gradients are applied (not where the loss or a gradient is
        not finite, with ``skip_nonfinite``: see :meth:`train_step`); with ``record`` every
        action and transfer is timed into ``StepResult.timeline`` (slower: each device
        waits for each action to finish).
        """
        cut = self._split_batch(batch)
        return self.driver.step(
            self._param_tree(params),
            cut.inputs,
            cut.targets,
            cut.example_inputs,
            cut.example_targets,
            optimizer=optimizer,
            opt_state=opt_state,
            record=record,
            skip_nonfinite=skip_nonfinite,
        )

    def block_until_ready(self) -> None:
        """Wait until the steps dispatched so far are done, their updates included: a
        training step returns as soon as it is dispatched (on the local backend, once it is
        queued; on Ray, once every process of the world has dispatched its share), so time a
        step, or a loop of them, up to this call."""
        self.backend.wait()

    def gather(self, value: Any) -> Any:
        """``value`` on the driver as numpy arrays in plain pytrees, however it is
        sharded: a :class:`~pipedsl.executor.backend.Resident` handle (the parameters in
        the structure the model takes, the optimizer state as a tuple of per-stage
        states) is fetched from the pipeline devices; arrays are copied to the host.
        """
        return self.driver.gather(value)

    def init(self, init: Callable[..., Any], *args: Any, batch: tuple[Any, Any]) -> Resident:
        """The parameters made as ``init(*args)`` (a function returning the parameters'
        pytree, e.g. of a PRNG key) where they live, as a handle to pass to the steps:
        jitted on the local backend, on Ray inside the world, jitted over each stage mesh
        so that every process computes only its own shards. ``batch`` is one batch of the
        shapes the steps take, for the stages to be compiled first."""
        tree = self._param_tree(jax.eval_shape(init, *args))
        cut = self._split_batch(batch)
        return self.driver.init(init, args, tree, (cut.example_inputs, cut.example_targets))

    def save(self, path: str, *, step: int) -> str:
        """Save the parameters and optimizer state where they are, as ``path/step-<step>``:
        one orbax checkpoint per pipeline device, on Ray written by the processes of its mesh,
        each its own shards (:mod:`pipedsl.executor.sharded_checkpoint`); returns that
        directory. Resume with :meth:`restore`, on this plan or another of the same model."""
        return str(self.backend.save(path, step=step))

    def restore(
        self,
        path: str,
        *,
        like_params: Any,
        batch: tuple[Any, Any],
        optimizer: optax.GradientTransformation | None = None,
    ) -> tuple[Resident, Resident | None, int]:
        """Read the latest step :meth:`save` wrote under ``path`` back onto the pipeline
        devices (on Ray, each process its own shards): (params handle, optimizer state
        handle, or None without ``optimizer``, the step). ``like_params`` gives the
        parameters' structure and shapes (arrays or ``jax.ShapeDtypeStruct``), ``batch`` one
        batch of the steps' shapes. The plan that saved it may differ from this one
        (schedule, placement, mesh, ZeRO stage, processes): each array is read into this
        plan's sharding. A checkpoint of another model, or optimizer state of another
        optimizer, is refused, naming what differs."""
        cut = self._split_batch(batch)
        tree = self._param_tree(shapes_of(like_params))
        example = (cut.example_inputs, cut.example_targets)
        step = self.backend.restore(path, tree, example, optimizer=optimizer)
        params, opt_state = self.driver.adopt(tree, example, states=optimizer is not None)
        return params, opt_state, step

    @property
    def one_program(self) -> bool:
        """Whether an unrecorded step runs as one program (the local backend, where every
        pipeline device has the same devices and ``options.fuse`` is not ``"off"``); a
        recorded step (``record=True``) always dispatches each action apart, to time it."""
        return isinstance(self.backend, LocalBackend) and self.backend.fuse != "off"

    @property
    def ticked(self) -> bool:
        """Whether an unrecorded step runs as one SPMD program over the pipeline devices,
        tick by tick (each pipeline device a JAX device of its own and ``options.ticks``, on
        Ray every process dispatching the same program on its shards; or, locally, all on one
        with ``options.fuse == "ticks"``: :mod:`pipedsl.executor.local.ticked`); known once a
        step (or :meth:`init`) installed the stages. A recorded step dispatches each action apart."""
        return self.backend.ticked

    def placement(self) -> tuple[tuple[DeviceSlot, ...], ...]:
        """Per pipeline device, its stage mesh's devices (``dp x cp x tp``, row-major) as
        (node id, process id, device id): on Ray the Ray node, the process's rank in the
        world and the global JAX device id; locally node ``"local"``, process 0."""
        if isinstance(self.backend, RayRunner):
            return self.backend.placement()
        assert isinstance(self.backend, LocalBackend)
        return tuple(tuple(DeviceSlot("local", 0, dev.id) for dev in m.devices.flat) for m in self.backend.meshes)

    def close(self) -> None:
        """Release what the backend holds for this pipeline (on Ray: its world)."""
        self.backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compile(self, params: Any, batch: tuple[Any, Any]) -> tuple[StageProgram, ...]:
        """The compiled stage programs for these shapes on the local backend (built on
        the first step anyway; exposed for inspection and benchmarks)."""
        if not isinstance(self.backend, LocalBackend):
            raise ExecutionError(
                "compile() shows the local backend's programs; the Ray world's processes compile their own"
            )
        cut = self._split_batch(batch)
        return self.backend.compiled(self._param_tree(params), cut.example_inputs, cut.example_targets).programs

    # -- internals ------------------------------------------------------------------

    def _param_tree(self, params: Any) -> Any:
        return list(params) if self._stages is not None and isinstance(params, (list, tuple)) else params

    def _split_batch(self, batch: tuple[Any, Any]) -> _Batch:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ExecutionError("the batch must be a pair (inputs, targets) of arrays or pytrees of arrays")
        inputs, targets = batch
        x_leaves, x_tree = jax.tree_util.tree_flatten(inputs)
        t_leaves, t_tree = jax.tree_util.tree_flatten(targets)
        # A batch of the shapes of the last one reuses its checks and its examples (the
        # same objects, so that the driver sees at once that nothing is to be compiled).
        signature = (x_tree, t_tree, *[(np.shape(v), _dtype(v)) for v in x_leaves + t_leaves])
        last = self._last_batch
        if last is not None and last[0] == signature:
            return _Batch(x_leaves, t_leaves, last[1].count, last[1].example_inputs, last[1].example_targets)
        cut = self._checked_batch(inputs, targets, x_leaves, t_leaves)
        self._last_batch = (signature, cut)
        return cut

    def _checked_batch(self, inputs: Any, targets: Any, x_leaves: list[Any], t_leaves: list[Any]) -> _Batch:
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
        dp = self.options.dp
        if per % dp:
            raise ExecutionError(
                f"a microbatch of {per} examples ({size} / {count} microbatches) does not split over "
                f"dp={dp} devices of the mesh axis {DATA!r}; use a batch size that is a multiple of "
                f"{count * dp} (microbatches x dp)"
            )

        # The stages are traced at what one device of "data" computes on: its share of
        # a microbatch (see pipedsl.executor.stages.shards).
        share = per // dp

        def example(tree: Any) -> Any:
            return jax.tree_util.tree_map(
                lambda leaf: jax.ShapeDtypeStruct((share, *np.shape(leaf)[1:]), jnp.result_type(leaf)), tree
            )

        return _Batch(x_leaves, t_leaves, count, example(inputs), example(targets))


def _dtype(leaf: Any) -> Any:
    """``leaf``'s dtype, read cheaply where it has one (arrays), else as JAX would take it."""
    dtype = getattr(leaf, "dtype", None)
    return dtype if dtype is not None else jnp.result_type(leaf)


def _schedule_argument(schedule: Any, costs: CostSource | None) -> Schedule:
    """``schedule`` as :class:`Pipeline` takes it: a Schedule, or a library name or path
    loaded with its defaults; a policy synthesised against ``costs`` (the uniform default,
    said in a warning, when None); anything else refused, naming the argument."""
    if isinstance(schedule, (str, os.PathLike)):
        schedule = library.load(schedule)
    if isinstance(schedule, Policy):
        if costs is not None and not callable(getattr(costs, "resolve", None)):
            raise ExecutionError(
                f"costs must be a cost model (pipedsl.simulator.CostModel) or pipedsl.StageCosts;"
                f" got {type(costs).__name__}"
            )
        if costs is None:
            warnings.warn(
                f"schedule: {schedule.name} is a policy, synthesised against the default uniform costs ({UNIFORM});"
                " pass costs= (a pipedsl.simulator.CostModel) to synthesise it against yours",
                stacklevel=3,
            )
        return synthesize(schedule, costs)
    if not isinstance(schedule, Schedule):
        raise ExecutionError(
            f"schedule must be a Schedule (pipedsl.load(...)), a Policy, a library name such as '1f1b' or a"
            f" .sched path; got {type(schedule).__name__}"
        )
    if costs is not None:
        raise ExecutionError(
            f"costs: schedule {schedule.name!r} has its order already; costs shape only a policy's order"
            " (such as 'zb_auto'): leave costs out"
        )
    return schedule
