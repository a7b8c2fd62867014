"""The schedule language's front door: ``.sched`` text or file to :class:`~pipedsl.ir.Schedule`.

:func:`load` reads a file, :func:`parse` a string; both parse (:mod:`pipedsl.parser`) and
evaluate (:mod:`pipedsl.evaluate`) under parameter overrides, and return the schedule
*without* validating it (``schedule.validate()`` does that). :func:`library_schedules`
lists the schedules shipped in the ``pipedsl.schedules`` package.

    >>> from pipedsl.language import load, library_path
    >>> s = load(library_path("1f1b"), pp=4, microbatches=8)
    >>> s.num_actions
    64
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from pipedsl.errors import PipedslError
from pipedsl.evaluate import MAX_ACTIONS, evaluate
from pipedsl.ir import Schedule
from pipedsl.parser import parse_source

__all__ = ["load", "parse", "library_path", "library_schedules", "MAX_ACTIONS"]

_SUFFIX = ".sched"


def parse(
    text: str,
    /,
    *,
    name: str | None = None,
    file: str = "<string>",
    max_actions: int = MAX_ACTIONS,
    **params: int | str,
) -> Schedule:
    """Parse and evaluate schedule text.

    Args:
      text: the text of a ``.sched`` file.
      name: the schedule's name; defaults to the one written after ``schedule``.
      file: how positions in error messages name the text.
      max_actions: the most actions evaluation may emit before it stops with an error.
      **params: overrides of the schedule's parameters; ints, or strings that spell one.

    Returns the Schedule (``source`` None), not yet validated.

    Raises:
      ScheduleSyntaxError: the text does not follow the grammar.
      ScheduleEvalError: it parses but cannot be evaluated (unknown name or parameter,
        failed ``require``, division by zero, negative range, too many actions, ...).
    """
    module = parse_source(text, file=file)
    return evaluate(module, params=params, name=name, source=None, max_actions=max_actions)


def load(
    path: str | os.PathLike[str],
    /,
    *,
    max_actions: int = MAX_ACTIONS,
    **params: int | str,
) -> Schedule:
    """Read, parse and evaluate a ``.sched`` file; like :func:`parse`, with
    ``Schedule.source`` set to the path.

    Raises PipedslError when the file cannot be read, otherwise as :func:`parse`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise PipedslError(f"{path}: cannot read the schedule: {err}") from None
    module = parse_source(text, file=str(path))
    return evaluate(module, params=params, source=str(path), max_actions=max_actions)


def library_schedules() -> dict[str, Path]:
    """The shipped schedules by name (the file stem, such as ``"1f1b"``), sorted by name."""
    folder = importlib.resources.files("pipedsl.schedules")
    found = {}
    for entry in folder.iterdir():
        if entry.name.endswith(_SUFFIX) and entry.is_file():
            found[entry.name[: -len(_SUFFIX)]] = Path(str(entry))
    return dict(sorted(found.items()))


def library_path(name: str | None = None) -> Path:
    """The folder of shipped schedules, or with ``name`` (``"1f1b"`` or ``"1f1b.sched"``)
    the path of that schedule.

    Raises PipedslError for a name that is not in the library, listing those that are.
    """
    if name is None:
        return Path(str(importlib.resources.files("pipedsl.schedules")))
    stem = name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else name
    shipped = library_schedules()
    if stem not in shipped:
        raise PipedslError(
            f"no schedule {name!r} in the library; it has {', '.join(shipped) or 'none'}"
        )
    return shipped[stem]
