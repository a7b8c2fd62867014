"""The functions a :class:`~pipedsl.executor.Pipeline` is built from, checked before any is traced.

A loss, stage or model function that is not callable (None, a module, an array) would be
found only when tracing calls it, in words about shapes or about ``NoneType``; here it is
refused with the argument's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipedsl.executor.errors import ExecutionError

__all__ = ["check_functions"]


def _refused(argument: str, value: object) -> ExecutionError:
    return ExecutionError(
        f"Pipeline: {argument} must be a function (a callable), got {type(value).__name__} {repr(value)[:60]}"
    )


def check_functions(*, loss: Any, stages: Sequence[Any] | None, model_fn: Any) -> None:
    """Refuse a ``loss``, a stage of ``stages`` or a ``model_fn`` (whichever the pipeline
    has) that cannot be called, naming it."""
    if not callable(loss):
        raise _refused("loss", loss)
    for index, stage in enumerate(stages or ()):
        if not callable(stage):
            raise _refused(f"stages[{index}]", stage)
    if stages is None and not callable(model_fn):
        raise _refused("model_fn", model_fn)
