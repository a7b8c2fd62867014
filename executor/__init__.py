"""Running schedules: JAX stage programs interpreted per device (MPMD).

``Pipeline`` runs a model (explicit stage functions, or one function split at
``stage_boundary`` markers) under a lowered schedule on a backend, as its ``RunOptions``
say (:mod:`pipedsl.run_options`), every pipeline device a ``dp x cp x tp`` mesh of JAX devices
(``Pipeline(..., options=RunOptions(dp=, tp=, zero=), param_specs=)``; see
:mod:`pipedsl.executor.stages.mesh`); the ``local`` backend hosts one worker per pipeline device
on threads of this process, the ``ray`` backend one ``jax.distributed`` world of Ray
processes whose stage meshes may span processes and nodes (``RayConfig``; a started
``RayWorld`` runs several pipelines one after another; see ``docs/cluster.md``).
``Pipeline.save`` and ``Pipeline.restore`` keep parameters and optimizer state across runs
where they live, one orbax checkpoint per pipeline device, read back by any plan of the
model (:mod:`pipedsl.executor.sharded_checkpoint`).

JAX is imported on first use of ``Pipeline``, ``StepResult``, ``stage_boundary`` or the
other names above, not with this package, so that ``pipedsl``'s command line (which imports
``pipedsl.executor.devices``) starts fast and ``pipedsl run`` can configure XLA first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipedsl.executor.errors import ExecutionError, NonFiniteStep
from pipedsl.run_options import RunOptions

if TYPE_CHECKING:
    from pipedsl.executor.backend import Resident
    from pipedsl.executor.pipeline import Pipeline, StepResult
    from pipedsl.executor.ray.cluster import DeviceLost, DeviceSlot, RayConfig, RayWorld
    from pipedsl.executor.stages.split import stage_boundary

__all__ = [
    "ExecutionError",
    "NonFiniteStep",
    "Pipeline",
    "RunOptions",
    "StepResult",
    "stage_boundary",
    "RayConfig",
    "RayWorld",
    "DeviceSlot",
    "DeviceLost",
    "Resident",
]

_LAZY = {
    "Pipeline": "pipedsl.executor.pipeline",
    "StepResult": "pipedsl.executor.pipeline",
    "stage_boundary": "pipedsl.executor.stages.split",
    "RayConfig": "pipedsl.executor.ray.cluster",
    "RayWorld": "pipedsl.executor.ray.cluster",
    "DeviceSlot": "pipedsl.executor.ray.cluster",
    "DeviceLost": "pipedsl.executor.ray.cluster",
    "Resident": "pipedsl.executor.backend",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
