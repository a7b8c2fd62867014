"""Running schedules: JAX stage programs interpreted per device (MPMD).

``Pipeline`` runs a model (explicit stage functions, or one function split at
``stage_boundary`` markers) under a lowered schedule on a backend; the ``local`` backend
uses one JAX device of this process per pipeline device.

JAX is imported on first use of ``Pipeline``, ``StepResult`` or ``stage_boundary``, not
with this package, so that ``pipedsl``'s command line (which imports
``pipedsl.executor.cli``) starts fast and ``pipedsl run`` can configure XLA first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipedsl.executor.errors import ExecutionError

if TYPE_CHECKING:
    from pipedsl.executor.pipeline import Pipeline, StepResult
    from pipedsl.executor.split import stage_boundary

__all__ = ["ExecutionError", "Pipeline", "StepResult", "stage_boundary"]

_LAZY = {
    "Pipeline": "pipedsl.executor.pipeline",
    "StepResult": "pipedsl.executor.pipeline",
    "stage_boundary": "pipedsl.executor.split",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
