"""What a backend provides to :class:`pipedsl.executor.pipeline.Pipeline`, and what a step returns.

A backend owns the pipeline devices, one :class:`pipedsl.executor.worker.Worker` each
(threads of this process for ``local``; for ``ray`` the processes of a ``jax.distributed``
world, several per device when its mesh spans them), and the state they keep between steps. The pipeline traces the model and splits the batch; the backend
runs the step and hands back a :class:`StepResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import optax

from pipedsl.program import Buffer
from pipedsl.timeline import Timeline

__all__ = ["Backend", "StepResult"]


@dataclass(frozen=True, slots=True)
class StepResult:
    """Everything one step produced.

    Attributes:
      loss: the mean loss over microbatches (a scalar array on the last stage's mesh;
        numpy on Ray).
      grads: gradients with the structure of ``params`` (each leaf on the mesh of the
        stage that owns it); None after an optimizer step, which consumes them.
      params: the updated parameters after an optimizer step, else None.
      opt_state: the optimizer state after an optimizer step (a tuple, one optax state
        per stage, over the leaves that stage owns; on Ray a handle to it), else None.
      timeline: the measured timeline when the step was recorded, else None.
      peak_held: per device, the most (stage, microbatch) pairs whose residuals it held
        at once (equals the schedule's peak in-flight count).
      leftover: per device, buffers still held after the step (always empty).
    """

    loss: jax.Array
    grads: Any
    params: Any
    opt_state: Any
    timeline: Timeline | None
    peak_held: tuple[int, ...]
    leftover: tuple[tuple[Buffer, ...], ...]


class Backend(Protocol):
    """The pipeline devices of one schedule, as the pipeline drives them."""

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
        ``example_inputs``/``example_targets`` give one microbatch's shapes."""
        ...

    def gather(self, value: Any) -> Any:
        """``value`` (parameters, optimizer state, gradients) on the driver as numpy."""
        ...

    def close(self) -> None:
        """Release what the backend holds."""
        ...
