"""What a backend hosts for :class:`pipedsl.executor.driver.Driver`, and what a step returns.

A backend owns the pipeline devices, one :class:`pipedsl.executor.runtime.worker.Worker` each
(in this process for ``local``; for ``ray`` in the processes of a ``jax.distributed``
world, several per device when its mesh spans them), and the state they keep between
steps: the compiled stages, the parameters and the optimizer state. The driver, written
once for both, runs the step loop over it: it ships what the devices do not hold yet,
asks for a step, and puts the devices' reports together into a :class:`StepResult`.

Both backends return the same types: the loss is a scalar array (on the local backend a
device array nothing has waited for; on Ray, a training step's is a
:class:`~pipedsl.executor.ray.remote_loss.RemoteLoss` kept by the last stage's process until
it is read, and a step that returns gradients ships it back as numpy), the gradients and
timeline are on the driver as numpy, and parameters and optimizer state stay where they
live, as :class:`Resident` handles that ``Pipeline.gather`` fetches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import optax

from pipedsl.executor.stages.model import StagedModel
from pipedsl.program import Buffer
from pipedsl.timeline import Event, Timeline

__all__ = ["Backend", "DeviceReport", "Resident", "StepResult"]


@dataclass(frozen=True, slots=True)
class Resident:
    """Parameters (``kind="params"``) or optimizer state (``kind="opt_state"``) held by
    the pipeline devices of pipeline ``pipeline``, as of ``version``. Pass it back to the
    pipeline that returned it (nothing moves); ``pipeline.gather(handle)`` fetches the
    values. The devices keep one copy, updated in place, so only the latest handle of
    each kind is valid."""

    kind: str
    pipeline: int
    version: int


@dataclass(frozen=True, slots=True)
class StepResult:
    """Everything one step produced, the same types on every backend.

    Attributes:
      loss: the mean loss over microbatches, a scalar array (local backend: a device array,
        not waited for; Ray: a training step's kept by its process until it is read, a
        :class:`~pipedsl.executor.ray.remote_loss.RemoteLoss`, else numpy).
      grads: gradients with the structure of ``params``, numpy arrays of the whole
        (unsharded) leaves; None after an optimizer step, which consumes them.
      params: after an optimizer step, a :class:`Resident` handle to the updated
        parameters, else None.
      opt_state: after an optimizer step, a :class:`Resident` handle to the optimizer
        state (gathered: a tuple of one optax state per stage, over the leaves that
        stage owns), else None.
      timeline: the measured timeline when the step was recorded, else None.
      peak_held: per device, the most (stage, microbatch) pairs whose residuals it held
        at once (equals the schedule's peak in-flight count).
      leftover: per device, buffers still held after the step (always empty).
    """

    loss: Any
    grads: Any
    params: Resident | None
    opt_state: Resident | None
    timeline: Timeline | None
    peak_held: tuple[int, ...]
    leftover: tuple[tuple[Buffer, ...], ...]


@dataclass(frozen=True, slots=True)
class DeviceReport:
    """One pipeline device's step as the driver gets it.

    Attributes:
      loss: the mean loss where the last stage is (a scalar array, as in
        :class:`StepResult`), else None.
      grads: per flat parameter leaf the device owns, its summed gradient as a numpy
        array of the whole leaf (empty unless asked for).
      peak_held: the most (stage, microbatch) pairs whose residuals were held at once.
      leftover: buffers still held after the device's last instruction.
      events: the recorded events (empty unless recording), seconds since the step's start.
    """

    loss: Any
    grads: Mapping[int, np.ndarray]
    peak_held: int
    leftover: tuple[Buffer, ...]
    events: tuple[Event, ...]


class Backend(Protocol):
    """The pipeline devices of one schedule, as the driver runs them."""

    @property
    def ticked(self) -> bool:
        """Whether an unrecorded step runs as one SPMD program over the pipeline devices
        (:mod:`pipedsl.executor.local.ticked`); known once the stages are installed."""
        ...

    def install(self, params: Any, example_inputs: Any, example_targets: Any) -> tuple[StagedModel, bool]:
        """The model traced and its stages compiled on the devices for parameters of the
        shapes ``params`` (a pytree of ``jax.ShapeDtypeStruct``) and one microbatch's
        ``example_inputs``/``example_targets``; and whether the devices were built afresh
        and hold no parameters or optimizer state."""
        ...

    def load(self, leaves: Sequence[Any] | None, states: Sequence[Any] | None) -> None:
        """Give the devices the parameters (every flat leaf, in order) and the optimizer
        states (one per stage), each when not None; each device keeps its share."""
        ...

    def make(self, init: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Make the parameters on the devices as ``init(*args)``, each device its own leaves."""
        ...

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
        """One step over the batch's leaves, per pipeline device its report. With
        ``optimizer`` the devices apply it (starting the optimizer state afresh with
        ``fresh_state``; with ``skip_nonfinite`` not where the loss or a gradient is not
        finite); with ``record`` they time every action and transfer."""
        ...

    def fetch(self, *, params: bool) -> tuple[dict[int, np.ndarray], dict[int, Any]]:
        """The owned parameter leaves by flat index (with ``params``), else the optimizer
        states by stage, as numpy."""
        ...

    def save(self, path: str | Path, *, step: int) -> Path:
        """Save the parameters and optimizer state where they are as ``path/step-<step>``
        (:mod:`pipedsl.executor.sharded_checkpoint`); the version's directory."""
        ...

    def restore(
        self,
        path: str | Path,
        like_params: Any,
        example: tuple[Any, Any],
        *,
        optimizer: optax.GradientTransformation | None,
    ) -> int:
        """Read the latest complete version under ``path`` back onto the devices (the
        optimizer state only with ``optimizer``), for parameters of the shapes
        ``like_params`` and one microbatch's ``example``; its step."""
        ...

    def wait(self) -> None:
        """Return once the devices have computed every step dispatched so far, updates
        included, raising a failed computation's error."""
        ...

    def close(self) -> None:
        """Release what the backend holds."""
        ...
