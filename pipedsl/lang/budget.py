"""The bounds of one evaluation, and the errors the evaluator words.

Bounds, so no input can hang or exhaust memory: at most ``max_actions`` actions; a work
budget of ``WORK_PER_ACTION * max_actions`` steps charged by loops (iterations times the
size of their body) before they start, so an empty loop cannot spin; at most
``COMPILE_BUDGET`` expression nodes after inlining. :class:`Run` holds the counters of
one evaluation, read by the compiled closures.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from pipedsl.errors import RequirementFailed, ScheduleEvalError, SourcePos
from pipedsl.ir import Kind
from pipedsl.lang import ast
from pipedsl.lang.arith import fail

__all__ = [
    "COMPILE_BUDGET",
    "RAISE_THE_LIMIT",
    "WORK_PER_ACTION",
    "Columns",
    "Run",
    "count",
    "no_output",
    "require_failed",
    "suggest",
]


@dataclass(frozen=True, slots=True, eq=False)
class Columns:
    """A vectorised loop's actions: its iterations' actions, iteration by iteration, each
    iteration's in the order of the loop's ``k`` action statements (``kinds[c]`` written at
    ``poses[c]``). ``stages`` and ``microbatches`` are int64 of shape (n·k,), row i·k + c
    statement c's action in iteration i; ``keep`` (bool, the same shape) leaves out the
    rows whose condition is false, None keeps them all. A sink takes what it keeps:
    objects with their positions, or int columns without a list in between."""

    kinds: tuple[Kind, ...]
    poses: tuple[SourcePos, ...]
    stages: np.ndarray
    microbatches: np.ndarray
    keep: np.ndarray | None


#: Loop work allowed per allowed action: room for bodies that loop without emitting.
WORK_PER_ACTION = 25
#: Bound on expression nodes compiled for one schedule, counting inlined function bodies.
COMPILE_BUDGET = 1_000_000

#: How an error about the bound on actions says to lift it, in both the places it is set.
RAISE_THE_LIMIT = (
    "if the schedule really is this large, raise the limit"
    " (--max-actions N on the command line, max_actions=N in Python)"
)


class Run:
    """Mutable state of one evaluation, read by the compiled closures."""

    __slots__ = (
        "append",
        "extend",
        "actions_left",
        "work_left",
        "sole_stage",
        "device",
        "device_stages",
        "max_actions",
    )

    def __init__(self, max_actions: int) -> None:
        # Where a device body's actions go: one at a time (kind, stage, microbatch, source
        # position), or a loop's as columns (see :data:`Columns`).
        self.append: Callable[[Kind, int, int, SourcePos | None], None] = no_output
        self.extend: Callable[[Columns], None] = no_output
        self.actions_left = max_actions
        self.work_left = WORK_PER_ACTION * max_actions
        self.sole_stage: int | None = None
        self.device = 0
        self.device_stages: tuple[int, ...] = ()
        self.max_actions = max_actions

    def charge(self, work: int, pos: SourcePos, what: str) -> None:
        self.work_left -= work
        if self.work_left < 0:
            raise fail(
                f"runaway expansion: {what} goes past the evaluation budget of"
                f" {WORK_PER_ACTION * self.max_actions} steps ({WORK_PER_ACTION} per allowed"
                f" action, max_actions={self.max_actions}); {RAISE_THE_LIMIT}",
                pos,
            )

    def too_many(self, pos: SourcePos) -> ScheduleEvalError:
        return fail(
            f"runaway expansion: more than max_actions={self.max_actions} actions; {RAISE_THE_LIMIT}",
            pos,
        )

    def stage_needed(self, kind: Kind, microbatch: int, pos: SourcePos) -> ScheduleEvalError:
        call = f"{kind.value}({microbatch})"
        if not self.device_stages:
            held = "holds no stage"
        else:
            held = "holds stages " + ", ".join(map(str, self.device_stages))
        return fail(
            f"{call} leaves out the stage, but device {self.device} {held}; write {kind.value}({microbatch}, stage)",
            pos,
        )


def no_output(*actions: object) -> None:
    # Actions are statements, and statements exist only in device bodies, which set the
    # real sink before they run; this stands in between bodies so a misrouted action is
    # loud rather than lost.
    raise RuntimeError("internal error: an action was emitted outside a device body")


def require_failed(node: ast.Require, values: Mapping[str, int]) -> RequirementFailed:
    """The error a failed ``require`` raises: its message and ``values`` (what the
    condition read), at the ``require``."""
    message = "requirement failed"
    if node.message:
        message += f": {node.message}"
    if values:
        message += " (" + ", ".join(f"{name} = {value}" for name, value in values.items()) + ")"
    return RequirementFailed(message, requirement=node.message or _condition_text(node), pos=node.pos)


def _condition_text(node: ast.Require) -> str:
    """The ``require``'s condition as written: its source line from the condition on (a
    ``require`` without a message is one statement on its line, as the library writes it)."""
    column = _first_column(node.cond, node.pos.line)
    text = node.pos.line_text[column - 1 :].strip() if column is not None else ""
    return text or f"the condition at line {node.pos.line}"


def _first_column(expr: object, line: int) -> int | None:
    """The leftmost column on ``line`` of ``expr`` and its parts (an operator's position
    is its own, to the right of its left operand)."""
    found: list[int] = []
    pending = [expr]
    while pending:
        item = pending.pop()
        pos = getattr(item, "pos", None)
        if isinstance(pos, SourcePos) and pos.line == line:
            found.append(pos.column)
        for name in getattr(item, "__slots__", ()):
            value = getattr(item, name, None)
            pending.extend(value if isinstance(value, tuple) else (value,))
    return min(found, default=None)


def suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
