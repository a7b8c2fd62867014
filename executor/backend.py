"""What a backend provides to :class:`pipedsl.executor.pipeline.Pipeline`.

A backend owns the pipeline devices: it puts values on them, runs every device's
lowered program for one step (each with a :class:`pipedsl.executor.interpreter.DeviceRuntime`
and a :class:`pipedsl.executor.transport.Transport`), and runs small per-stage
functions (the optimizer update) where the stage lives. The pipeline does the rest
(stage compilation, splitting the batch, summing shared gradients, the optimizer) in
terms of this interface, so a backend never sees the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pipedsl.executor.interpreter import DeviceStep
from pipedsl.executor.stages import StageProgram
from pipedsl.timeline import Timeline

__all__ = ["Backend", "BackendStep"]

Leaves = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class BackendStep:
    """One step on every device: ``devices[d]`` is device d's result; ``timeline`` is
    the measured timeline when the step was recorded, else None."""

    devices: tuple[DeviceStep, ...]
    timeline: Timeline | None


class Backend(Protocol):
    """The pipeline devices of one schedule, as the pipeline drives them."""

    def place(self, value: Any, device: int) -> Any:
        """``value`` (a pytree of arrays) on pipeline device ``device``."""
        ...

    def run_step(
        self,
        stages: Mapping[int, StageProgram],
        params: Mapping[int, Leaves],
        inputs: Sequence[Leaves],
        targets: Sequence[Leaves],
        *,
        record: bool,
    ) -> BackendStep:
        """Run every device's program once.

        ``stages`` maps each stage to its compiled program, ``params`` each stage to its
        parameter leaves (already on the stage's device), ``inputs[m]`` / ``targets[m]``
        microbatch m's leaves (already on the devices of the first / last stage).
        """
        ...

    def call(self, device: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run where pipeline device ``device`` lives (args already there)."""
        ...
