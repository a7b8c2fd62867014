"""The error hierarchy: every user-facing failure is one of these.

Each error carries what went wrong, which rule it broke and, when the input was text,
where: file, line and column, shown with the source line and a caret. The CLI maps
:class:`ScheduleInvalid` to exit code 1 and every other :class:`PipedslError` to 2.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SourcePos",
    "PipedslError",
    "ScheduleSyntaxError",
    "ScheduleEvalError",
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


class PipedslError(Exception):
    """Base of every error pipedsl raises on purpose.

    ``message`` says what is wrong and, where one is known, what to do instead;
    ``pos`` locates it in a source text when there is one.
    """

    def __init__(self, message: str, *, pos: SourcePos | None = None) -> None:
        self.message = message
        self.pos = pos
        super().__init__(self.__str__())

    def headline(self) -> str:
        """The message without location, as one line."""
        return self.message

    def __str__(self) -> str:
        if self.pos is None:
            return self.headline()
        head = f"{self.pos}: {self.headline()}"
        excerpt = self.pos.excerpt()
        return f"{head}\n{excerpt}" if excerpt else head


class ScheduleSyntaxError(PipedslError):
    """The text does not follow the grammar of the language."""


class ScheduleEvalError(PipedslError):
    """The text parses but cannot be evaluated: unknown name, wrong arity, division by
    zero, a failed ``require``, a negative range, too many actions."""


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
