"""The driver of one pipeline, written once for every backend.

:class:`Driver` runs the step loop over a :class:`~pipedsl.executor.backend.Backend` (the
pipeline devices in this process, or the processes of a Ray world): per step it has the
stages compiled for the batch's shapes, ships the parameters and optimizer state only
where the devices do not hold them already, asks the devices for the step (a recorded
step is the same step with every action timed) and puts their reports together. It is
the one place that knows what the devices hold:

- parameters and optimizer state stay on the devices between steps and are handed out
  as :class:`~pipedsl.executor.backend.Resident` handles (one valid version of each);
- plain arrays passed as parameters are shipped once: passing the same JAX arrays again
  moves nothing (they are immutable; numpy arrays, which are not, are shipped each time);
- :meth:`Driver.gather` fetches a handle's values to the driver as numpy pytrees.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipedsl.executor.backend import Backend, DeviceReport, Resident, StepResult
from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.runtime.timing import measured_timeline
from pipedsl.executor.stages.model import StagedModel
from pipedsl.program import Program

__all__ = ["Driver", "shapes_of"]

_NEXT_PIPELINE_ID = itertools.count()


def shapes_of(tree: Any) -> Any:
    """``tree``'s leaves as ``jax.ShapeDtypeStruct`` (shape and dtype only)."""
    return jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v)), tree)


class Driver:
    """Runs ``program``'s steps on ``backend`` (see the module docstring)."""

    def __init__(self, program: Program, backend: Backend) -> None:
        self.program = program
        self.backend = backend
        self.key = next(_NEXT_PIPELINE_ID)
        self._versions = {"params": 0, "opt_state": 0}
        self._model: StagedModel | None = None
        self._shapes: Any = None  # the held parameters' shapes, for a step given a handle
        self._examples: tuple[Any, Any] = (None, None)  # the microbatch shapes installed last
        # The caller's JAX arrays the devices were last loaded from (weakly: the caller
        # owns them), so that passing them again ships nothing.
        self._sent: tuple[weakref.ref[Any], ...] | None = None

    # -- steps -------------------------------------------------------------------------

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
        skip_nonfinite: bool = False,
    ) -> StepResult:
        """One step (see :meth:`pipedsl.executor.pipeline.Pipeline.step`)."""
        held = isinstance(params, Resident)
        if held:
            self._check(params, "params")
        leaves = [] if held else jax.tree_util.tree_leaves(params)
        same = held or self._holds(leaves)
        model = self._install(self._shapes if same else shapes_of(params), example_inputs, example_targets)
        if held:
            self._check(params, "params")  # still valid unless the devices were rebuilt
        elif not (same and self._sent is not None):  # devices rebuilt by the install hold nothing
            self._ship(leaves)
        if optimizer is not None:
            if isinstance(opt_state, Resident):
                self._check(opt_state, "opt_state")
            elif opt_state is not None:
                if not isinstance(opt_state, tuple) or len(opt_state) != model.num_stages:
                    raise ExecutionError(
                        f"opt_state must be the tuple of {model.num_stages} per-stage states a previous "
                        "train_step returned (gathered or as a handle), or None to start"
                    )
                self.backend.load(None, opt_state)
                self._versions["opt_state"] += 1
        reports = self.backend.run(
            inputs,
            targets,
            optimizer=optimizer,
            fresh_state=opt_state is None,
            record=record,
            keep_grads=optimizer is None,
            skip_nonfinite=skip_nonfinite,
        )
        return self._result(reports, model, trained=optimizer is not None, record=record)

    def init(self, init: Callable[..., Any], args: tuple[Any, ...], shapes: Any, example: tuple[Any, Any]) -> Resident:
        """Make the parameters on the devices as ``init(*args)``; ``shapes`` gives their
        shapes (a pytree of ``jax.ShapeDtypeStruct``), ``example`` one microbatch's inputs
        and targets. Returns the handle."""
        self._install(shapes, *example)
        self.backend.make(init, tuple(args))
        self._sent = None
        self._versions["params"] += 1
        self._versions["opt_state"] += 1
        return self._handle("params")

    def adopt(self, shapes: Any, example: tuple[Any, Any], *, states: bool) -> tuple[Resident, Resident | None]:
        """Handles to parameters (of ``shapes``) and, with ``states``, optimizer state
        that the devices were given behind the driver's back (read from a checkpoint)."""
        self._install(shapes, *example)
        self._sent = None
        self._versions["params"] += 1
        self._versions["opt_state"] += 1
        return self._handle("params"), (self._handle("opt_state") if states else None)

    def gather(self, value: Any) -> Any:
        """The values behind a :class:`Resident` handle as a pytree of numpy arrays (the
        parameters in the structure the model takes; the optimizer state as a tuple of
        per-stage states); anything else is fetched to the driver as it is."""
        if not isinstance(value, Resident):
            return jax.device_get(value)
        self._check(value, value.kind)
        model = self._model
        assert model is not None  # a handle exists only once the devices hold something
        params = value.kind == "params"
        leaves, states = self.backend.fetch(params=params)
        if params:
            return jax.tree_util.tree_unflatten(model.param_treedef, [leaves[i] for i in range(len(model.param_avals))])
        return tuple(states[s] for s in range(model.num_stages))

    @property
    def model(self) -> StagedModel | None:
        """The model as traced for the devices' stages (None before the first step)."""
        return self._model

    # -- internals -------------------------------------------------------------------

    def _install(self, shapes: Any, example_inputs: Any, example_targets: Any) -> StagedModel:
        model = self._model
        if (
            model is not None
            and shapes is self._shapes
            and example_inputs is self._examples[0]
            and example_targets is self._examples[1]
        ):
            return model  # the shapes of the last step (the pipeline hands the same examples)
        model, fresh = self.backend.install(shapes, example_inputs, example_targets)
        self._examples = (example_inputs, example_targets)
        if fresh:
            # The devices hold nothing: every handle out there is out of date.
            self._sent = None
            self._versions["params"] += 1
            self._versions["opt_state"] += 1
        self._model, self._shapes = model, shapes
        return model

    def _holds(self, leaves: list[Any]) -> bool:
        """Whether the devices hold these very arrays (they were loaded from them last)."""
        sent = self._sent
        return (
            sent is not None and len(sent) == len(leaves) and all(r() is x for r, x in zip(sent, leaves, strict=True))
        )

    def _ship(self, leaves: list[Any]) -> None:
        """Load the parameter leaves."""
        self.backend.load(leaves, None)
        self._versions["params"] += 1
        self._sent = tuple(weakref.ref(x) for x in leaves) if all(isinstance(x, jax.Array) for x in leaves) else None

    def _result(
        self, reports: Sequence[DeviceReport], model: StagedModel, *, trained: bool, record: bool
    ) -> StepResult:
        schedule = self.program.schedule
        loss = reports[schedule.placement[-1]].loss
        assert loss is not None  # the last stage's device reports the loss
        timeline = None
        if record:
            timeline = measured_timeline(
                [r.events for r in reports], name=schedule.name, num_devices=schedule.num_devices
            )
        common: dict[str, Any] = {
            "loss": loss,
            "timeline": timeline,
            "peak_held": tuple(r.peak_held for r in reports),
            "leftover": tuple(r.leftover for r in reports),
        }
        if not trained:
            leaves: list[Any] = [None] * len(model.param_avals)
            for report in reports:
                for i, g in report.grads.items():
                    leaves[i] = g
            grads = jax.tree_util.tree_unflatten(model.param_treedef, leaves)
            return StepResult(grads=grads, params=None, opt_state=None, **common)
        self._sent = None
        self._versions["params"] += 1
        self._versions["opt_state"] += 1
        return StepResult(grads=None, params=self._handle("params"), opt_state=self._handle("opt_state"), **common)

    def _handle(self, kind: str) -> Resident:
        return Resident(kind, self.key, self._versions[kind])

    def _check(self, handle: Resident, kind: str) -> None:
        if handle.kind != kind:
            raise ExecutionError(f"a handle to {handle.kind} was passed where {kind} was expected")
        if handle.pipeline != self.key:
            raise ExecutionError(
                f"these {kind} are held by another pipeline; gather them there (pipe.gather) and pass the arrays"
            )
        if handle.version != self._versions[kind]:
            raise ExecutionError(
                f"this {kind} handle is out of date (version {handle.version}; the devices hold version "
                f"{self._versions[kind]}): the pipeline keeps one copy, updated in place (and rebuilt after a "
                "failed step or for new shapes); gather a state when it is returned to keep it"
            )
