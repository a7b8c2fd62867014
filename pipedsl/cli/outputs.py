"""Where a command writes: the one check every writing option goes through, before any work.

A command writes a file only where it can (not a folder, not a missing or read-only
folder), never over a file it reads (its schedule, a saved timeline, a cost, model or
cluster TOML, a plans CSV), and never over an existing file that is not one of the kind
it writes (:class:`Written`: a trace, a timeline, a plans CSV, a picture, a cluster or
cost file, a converted schedule), which is most likely a file of the user's given by
mistake. ``--force`` lifts the last two rules; running the same command again, over its
own output, needs no ``--force``.

The kind of an existing file is read from its first :data:`_HEAD_BYTES` bytes, so the
check costs the same whatever the file's size.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pipedsl.errors import PipedslError

__all__ = [
    "Written",
    "TRACE",
    "TIMELINE",
    "PLANS_CSV",
    "RUNS_CSV",
    "PICTURE",
    "CLUSTER_TOML",
    "COSTS_TOML",
    "CONVERTED",
    "check_output_file",
    "check_output_folder",
    "FORCE_HELP",
]

_HEAD_BYTES = 4096

FORCE_HELP = "write over an existing file that is not this command's output, or over one it reads"
"""The help of ``--force`` in every command that writes a file."""


@dataclass(frozen=True, slots=True)
class Written:
    """A kind of file a command writes: ``what`` it is in words, and ``start``, a pattern
    that the beginning of every such file matches (after leading white space)."""

    what: str
    start: re.Pattern[bytes]

    def holds(self, path: Path) -> bool:
        """Whether the file at ``path`` begins as a file of this kind does."""
        try:
            with path.open("rb") as handle:
                head = handle.read(_HEAD_BYTES)
        except OSError:
            return False
        return self.start.match(head.lstrip()) is not None


def _kind(what: str, start: bytes) -> Written:
    return Written(what, re.compile(start, re.DOTALL))


TRACE = _kind("a trace pipedsl wrote", rb'\{"traceEvents"')
TIMELINE = _kind("a timeline pipedsl saved", rb'\{"format": "pipedsl-timeline"')
PLANS_CSV = _kind("a plans CSV pipedsl wrote", rb"rank,kind,schedule,")
RUNS_CSV = _kind("a runs CSV pipedsl wrote", rb"schedule,kind,dp,")
PICTURE = _kind("a picture (PNG, SVG or PDF)", rb"\x89PNG|%PDF|<\?xml|<svg")
CLUSTER_TOML = _kind("a cluster file pipedsl calibrate wrote", rb"# [^\n]*calibrated by pipedsl calibrate")
COSTS_TOML = _kind("a cost model pipedsl calibrate fitted", rb"# fitted by pipedsl calibrate")
CONVERTED = {
    "sched": _kind(
        "a schedule table pipedsl converted", rb"(# [^\n]* as a table\.\n)?schedule \w+ \{\n  stages \d+\n  devices"
    ),
    "csv": _kind("a schedule CSV", rb"(\d+[A-Z_]+\d+)?(,\d+[A-Z_]+\d+)*\r?\n"),
    "json": _kind("a schedule pipedsl converted", rb'\{\s*"format": "pipedsl-schedule"'),
}
"""What ``convert --to FORMAT`` writes, by format."""


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _writable(folder: Path) -> bool:
    """Whether a file can be made in ``folder``, tried with a nameless temporary file
    (removed at once): permission bits say nothing of a read-only mount or of ``/proc``,
    and nothing at all to root."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _same_file(a: str | Path, b: Path) -> bool:
    try:
        return Path(a).samefile(b)
    except OSError:
        return False


def check_output_file(
    path: str | Path,
    *,
    option: str,
    writes: Written,
    reads: Iterable[str | Path | None] = (),
    force: bool = False,
    makes_folder: bool = False,
) -> None:
    """Refuse, before any work, to write ``writes`` at ``path`` (given as ``option``)
    where it cannot be written: a folder, or a place whose folder is missing (unless
    ``makes_folder``: the command makes it, so it must be creatable) or read-only; and,
    unless ``force``, over one of the files the command ``reads`` (None: not given) or
    over an existing file that is not of the kind ``writes``. Nothing is left behind."""
    target = Path(path)
    if target.is_dir():
        raise PipedslError(f"{option} {target}: is a folder; give a file name")
    folder = target.parent
    existing = _nearest_existing(folder) if makes_folder else folder
    if not existing.is_dir():
        what = f"the folder {folder} does not exist" if existing == folder else f"{existing} is a file"
        raise PipedslError(f"{option} {target}: {what}")
    if not _writable(existing) or (target.exists() and not os.access(target, os.W_OK)):
        raise PipedslError(f"{option} {target}: cannot write in {existing}")
    if force or not target.exists():
        return
    for read in reads:
        if read is not None and _same_file(read, target):
            raise PipedslError(
                f"{option} {target}: would write over {read}, which this command reads:"
                " choose another output, or pass --force"
            )
    if not writes.holds(target):
        raise PipedslError(
            f"{option} {target}: exists and is not {writes.what}; choose another output, or pass --force"
            " to write over it"
        )


def check_output_folder(
    path: str | Path, *, option: str, files: Iterable[tuple[str, Written]] = (), force: bool = False
) -> None:
    """Refuse, before any work, an output folder that cannot be made or written: a file
    of that name, a file in its way, or a read-only place; and, unless ``force``, one where
    a file the command writes there (``files``: name and kind) exists and is not of its
    kind. Nothing is left behind."""
    target = Path(path)
    existing = _nearest_existing(target)
    if not existing.is_dir():
        what = "is a file" if existing == target else f"cannot be made: {existing} is a file"
        raise PipedslError(f"{option} {target}: {what}; give a folder")
    if not _writable(existing):
        raise PipedslError(f"{option} {target}: cannot write in {existing}")
    if force:
        return
    for name, writes in files:
        inside = target / name
        if inside.is_dir() or (inside.exists() and not writes.holds(inside)):
            raise PipedslError(
                f"{option} {target}: {inside} exists and is not {writes.what}; choose another folder, or pass"
                " --force to write over it"
            )
