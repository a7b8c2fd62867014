"""Output that reads at the terminal's width: tables that leave out columns by rule,
prose wrapped at word boundaries, long commands broken with ``\\`` continuations.

The width is ``$COLUMNS`` where it is set (a shell exports it; a test or a log can set
it), else the terminal's, else :data:`DEFAULT_WIDTH`; one-line reports stay one line for a
file or a pipe (:func:`for_reader`). A table never cuts a cell: a column
whose every row says the same is said once under the table, then the columns a caller
ranks least are left out, by name, until the rest fit (:func:`fitted_table`).
"""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["DEFAULT_WIDTH", "output_width", "reader_width", "for_reader", "paragraph", "command_lines", "fitted_table"]

DEFAULT_WIDTH = 120
"""Columns of output written to a file or a pipe without ``$COLUMNS``."""


def output_width() -> int:
    """The columns output may take: :func:`reader_width`, else :data:`DEFAULT_WIDTH`."""
    return reader_width() or DEFAULT_WIDTH


def reader_width() -> int | None:
    """The width of whoever reads the output: ``$COLUMNS`` if it is a whole number of at
    least 40, else the terminal's (standard output's); None for a file or a pipe."""
    given = os.environ.get("COLUMNS", "").strip()
    if given.isdigit() and int(given) >= 40:
        return int(given)
    if os.isatty(1):
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return None


def for_reader(text: str) -> str:
    """A one-line report (``check``'s verdict on a file, an error's message) wrapped as a
    :func:`paragraph` for a terminal or ``$COLUMNS``; as it is for a file or a pipe, where
    a tool reads one line per report."""
    width = reader_width()
    return text if width is None else paragraph(text, width=width)


def paragraph(text: str, *, indent: str = "", hanging: str = "    ", width: int | None = None) -> str:
    """``text`` wrapped at word boundaries to ``width`` (default :func:`output_width`): the
    first line after ``indent``, the others after ``indent + hanging``. A word longer than
    a line (a path) stays whole on a line of its own."""
    return textwrap.fill(
        text,
        width=width or output_width(),
        initial_indent=indent,
        subsequent_indent=indent + hanging,
        break_long_words=False,
        break_on_hyphens=False,
    )


def command_lines(command: str, *, indent: str = "  ", width: int | None = None) -> str:
    """A shell command broken before its options into lines of at most ``width`` (default
    :func:`output_width`), each but the last ending in `` \\``, the continuations indented
    four more: a copy of the lines runs as the one line would. An option stays with its
    value (``--dp 8``, ``-p pp=4``)."""
    limit = width or output_width()
    words = command.split(" ")
    groups: list[str] = []
    for word in words:
        if groups and not word.startswith("-") and groups[-1].startswith("-") and " " not in groups[-1]:
            groups[-1] += f" {word}"  # an option's value
        else:
            groups.append(word)
    lines = [indent]
    for group in groups:
        line = lines[-1]
        bare = line.strip() == ""
        if not bare and len(line) + 1 + len(group) + 2 > limit:
            lines[-1] += " \\"
            lines.append(indent + "    " + group)
        else:
            lines[-1] = line + group if bare else f"{line} {group}"
    return "\n".join(lines)


def fitted_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    title: str | None = None,
    left: Sequence[str] = (),
    droppable: Sequence[str] = (),
) -> Table:
    """A table of ``rows`` (strings, one per header) that fits ``width`` (default
    :func:`output_width`) without cutting a cell. Of the ``droppable`` headers, least
    wanted first: a column with the same value on every row (of two or more) is left out
    and said once in the caption (``every row: vpp 1``); then, while the table is wider
    than ``width``, the next droppable column is left out, and the caption names them
    (``left out at 80 columns: bubble %``). ``left`` headers are justified left, the rest
    right (numbers)."""
    from rich import box
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    limit = width or output_width()
    kept = list(range(len(headers)))
    said: list[str] = []
    if len(rows) > 1:
        for i, header in enumerate(headers):
            if header in droppable and len({row[i] for row in rows}) == 1:
                kept.remove(i)
                said.append(f"{header} {rows[0][i]}")
    measure = Console(width=10**4, color_system=None)

    def build(columns: list[int], caption: list[str], *, wrap: bool = False) -> Table:
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, caption_justify="left", show_edge=False)
        for i in columns:
            table.add_column(
                headers[i], justify="left" if headers[i] in left else "right", no_wrap=not wrap, overflow="fold"
            )
        for row in rows:
            table.add_row(*(row[i] for i in columns))
        if caption:
            table.caption = "; ".join(caption)
        return table

    def natural(table: Table) -> int:
        table.caption = None
        return Measurement.get(measure, measure.options, table).maximum

    left_out: list[str] = []
    for header in droppable:
        if natural(build(kept, [])) <= limit:
            break
        i = headers.index(header)
        if i in kept:
            kept.remove(i)
            left_out.append(header)
    caption = ([f"every row: {', '.join(said)}"] if said else []) + (
        [f"left out at {limit} columns: {', '.join(left_out)}"] if left_out else []
    )
    # Past every column it may leave out, a cell wraps at its words (a word longer than its
    # column folds onto the next line) rather than being cut.
    return build(kept, caption, wrap=natural(build(kept, [])) > limit)
