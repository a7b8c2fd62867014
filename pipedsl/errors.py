"""The error hierarchy: every user-facing failure is one of these.

Each error carries what went wrong, which rule it broke and, when the input was text,
where: file, line and column, shown with the source line and a caret. The CLI maps
:class:`ScheduleInvalid` to exit code 1 and every other :class:`PipedslError` to 2.

A file with several independent mistakes reports them all at once, as a good compiler
does: the first error is raised and carries the others (:func:`several`); printing it
prints each with its place, source line and caret, then how many there were.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MAX_REPORTED",
    "several",
    "SourcePos",
    "PipedslError",
    "ScheduleSyntaxError",
    "ScheduleEvalError",
    "RequirementFailed",
    "ScheduleInvalid",
    "ConversionError",
]


@dataclass(frozen=True, slots=True)
class SourcePos:
    """A place in a source text: 1-based line and column, with the line's text for carets."""

    file: str
    line: int
    column: int
    line_text: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    def excerpt(self) -> str:
        """The source line followed by a caret under the column, or "" without text."""
        if not self.line_text:
            return ""
        text = self.line_text.rstrip("\n").expandtabs(1)
        caret = " " * max(self.column - 1, 0) + "^"
        return f"    {text}\n    {caret}"


#: The most errors one file reports at once; past it, a count of those left out.
MAX_REPORTED = 20


class PipedslError(Exception):
    """Base of every error pipedsl raises on purpose.

    ``message`` says what is wrong and, where one is known, what to do instead;
    ``pos`` locates it in a source text when there is one. ``others`` holds further
    independent errors found in the same input (see :func:`several`), and ``omitted``
    how many more were found past :data:`MAX_REPORTED`.
    """

    def __init__(self, message: str, *, pos: SourcePos | None = None) -> None:
        self.message = message
        self.pos = pos
        self.others: tuple[PipedslError, ...] = ()
        self.omitted = 0
        super().__init__(self._render())

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from its state rather than from ``args`` (the rendered text), so that an
        # error raised in a search's worker process keeps its class, place and rule.
        return (_restore, (type(self), str(self), dict(self.__dict__)))

    @property
    def errors(self) -> tuple[PipedslError, ...]:
        """This error and the others found with it, in the order of the input."""
        return (self, *self.others)

    def headline(self) -> str:
        """The message without location, as one line."""
        return self.message

    def _render(self) -> str:
        if self.pos is None:
            return self.headline()
        head = f"{self.pos}: {self.headline()}"
        excerpt = self.pos.excerpt()
        return f"{head}\n{excerpt}" if excerpt else head

    def __str__(self) -> str:
        if not self.others:
            return self._render()
        found = len(self.others) + 1 + self.omitted
        parts = [error._render() for error in self.errors]
        if self.omitted:
            parts.append(f"... and {self.omitted} more")
        parts.append(f"{found} errors")
        return "\n".join(parts)


def _restore(cls: type[PipedslError], text: str, state: dict[str, object]) -> PipedslError:
    error = cls.__new__(cls, text)
    Exception.__init__(error, text)
    error.__dict__.update(state)
    return error


def several(errors: Sequence[PipedslError], *, limit: int = MAX_REPORTED, found: int | None = None) -> PipedslError:
    """One error to raise for ``errors`` (at least one): the first, carrying the others.

    At most ``limit`` are kept; the rest are counted in ``omitted``. ``found`` is how many
    there were in all when the caller built only the first few (at least ``len(errors)``).
    Raising the first keeps its class, so ``except ScheduleSyntaxError`` still catches a
    file with several syntax errors.
    """
    if not errors:
        raise ValueError("several() needs at least one error")
    first = errors[0]
    first.others = tuple(errors[1:limit])
    first.omitted = max(max(found or 0, len(errors)) - limit, 0)
    first.args = (str(first),)
    return first


class ScheduleSyntaxError(PipedslError):
    """The text does not follow the grammar of the language."""


class ScheduleEvalError(PipedslError):
    """The text parses but cannot be evaluated: unknown name, wrong arity, division by
    zero, a failed ``require``, a negative range, too many actions."""


class RequirementFailed(ScheduleEvalError):
    """A ``require`` of the schedule does not hold for the parameters given: the schedule
    itself refuses them (the plan search drops such a plan; every other evaluation error
    is a fault of the file). ``requirement`` is what the ``require`` demands: its own
    message, or its condition's text when it has none."""

    def __init__(self, message: str, *, requirement: str, pos: SourcePos | None = None) -> None:
        self.requirement = requirement
        super().__init__(message, pos=pos)


class ScheduleInvalid(PipedslError):
    """The evaluated schedule breaks a validation rule (see :mod:`pipedsl.validate`).

    ``rule`` names the rule (for example ``"missing-action"`` or ``"deadlock"``) and
    ``action`` is the offending action's text form (``"2F0"``) when one is to blame.
    """

    def __init__(
        self,
        message: str,
        *,
        rule: str,
        action: str | None = None,
        pos: SourcePos | None = None,
    ) -> None:
        self.rule = rule
        self.action = action
        super().__init__(message, pos=pos)

    def headline(self) -> str:
        return f"[{self.rule}] {self.message}"


class ConversionError(PipedslError):
    """An input in a foreign format (CSV, JSON) cannot be read as a schedule."""
