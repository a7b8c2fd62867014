"""The executor's errors: what went wrong while preparing or running a pipelined step.

Every failure the executor raises on purpose is an :class:`ExecutionError`; when a stage
is to blame it names the stage, the device that owns it and, during a run, the action.
"""

from __future__ import annotations

from pipedsl.errors import PipedslError

__all__ = ["ExecutionError", "NonFiniteStep", "first_line", "stage_failure", "summary"]


class ExecutionError(PipedslError):
    """A model, batch or backend that cannot run the schedule, or a step that failed.

    ``stage`` and ``device`` locate the failure when one stage is to blame (None otherwise).
    """

    def __init__(self, message: str, *, stage: int | None = None, device: int | None = None) -> None:
        self.stage = stage
        self.device = device
        super().__init__(message)


class NonFiniteStep(ExecutionError):
    """A training step whose loss is not finite (``train_step(check_finite=True)``).

    ``params`` and ``opt_state`` are the handles the step would have returned: on the local
    backend the step's update was skipped, so they hold the values that went in.
    """

    def __init__(self, message: str, *, params: object, opt_state: object) -> None:
        self.params = params
        self.opt_state = opt_state
        super().__init__(message)


def first_line(err: BaseException) -> str:
    """The first line of an error's message (Ray's carry whole remote tracebacks), or its
    type's name when it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def summary(err: BaseException) -> str:
    """The error's type and first line, and its last line when there are more (where a
    runtime error wrapping a Python traceback keeps the original exception)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = f"{type(err).__name__}: {lines[0]}"
    return f"{text} ... {lines[-1]}" if len(lines) > 1 else text


def stage_failure(stage: int, device: int, what: str, err: BaseException) -> ExecutionError:
    """An :class:`ExecutionError` for ``err``, raised while stage ``stage`` on device
    ``device`` was doing ``what`` (for example ``"tracing its forward"``)."""
    return ExecutionError(
        f"stage {stage} (device {device}) failed while {what}: {summary(err)}",
        stage=stage,
        device=device,
    )
