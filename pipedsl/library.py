"""The one schedule loader: a library name or a path to a :class:`~pipedsl.ir.Schedule`
(or, for a policy schedule, a :class:`~pipedsl.policy.Policy`).

Every command, the planner and the Python API load schedules through this module:

- :func:`resolve` turns a spec into a file: a bare name (``1f1b``) is a schedule of the
  shipped library (``pipedsl.schedules``), anything else a path;
- :func:`parsed` parses a ``.sched`` file once per version of the file (a bounded cache);
- :func:`parameters` lists the parameters a schedule declares;
- :func:`load` evaluates a ``.sched`` file under parameter overrides, or reads PyTorch's
  CSV or pipedsl's JSON form (:mod:`pipedsl.interop`); :func:`parse` does the same for text.

Schedules come back *unvalidated*; ``pipedsl.validate(schedule)`` checks them.

    >>> import pipedsl
    >>> pipedsl.load("1f1b", pp=4, microbatches=8).num_actions
    64
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import os
from dataclasses import dataclass
from pathlib import Path

from pipedsl.arrays import ScheduleArrays
from pipedsl.errors import ConversionError, PipedslError
from pipedsl.ir import Schedule
from pipedsl.lang import MAX_ACTIONS, Module, evaluate, evaluate_arrays, evaluate_layout, parse_source
from pipedsl.policy import Policy

__all__ = [
    "MAX_ACTIONS",
    "library_path",
    "library_schedules",
    "load",
    "load_arrays",
    "parameters",
    "parse",
    "parsed",
    "resolve",
    "schedule_file",
    "ScheduleFile",
]

_SUFFIX = ".sched"
_FORMATS = (".sched", ".csv", ".json")
# Parsed files kept at once: the library plus a user's own schedules, whatever a search tries.
_CACHED_FILES = 64


def library_schedules() -> dict[str, Path]:
    """The shipped schedules by name (the file stem, such as ``"1f1b"``), sorted by name."""
    folder = _library_folder()
    try:
        version = folder.stat().st_mtime_ns
    except OSError:
        version = None
    return dict(_listing(folder, version))


@functools.cache
def _library_folder() -> Path:
    return Path(str(importlib.resources.files("pipedsl.schedules")))


# A search resolves a library name for every plan; the folder's listing is read again
# only when the folder changes (a file added, removed or renamed changes its mtime).
@functools.lru_cache(maxsize=4)
def _listing(folder: Path, version: int | None) -> tuple[tuple[str, Path], ...]:
    found = {}
    for entry in folder.iterdir():
        if entry.name.endswith(_SUFFIX) and entry.is_file():
            found[entry.name[: -len(_SUFFIX)]] = entry
    return tuple(sorted(found.items()))


def library_path(name: str | None = None) -> Path:
    """The folder of shipped schedules, or with ``name`` (``"1f1b"`` or ``"1f1b.sched"``)
    the path of that schedule.

    Raises PipedslError for a name that is not in the library, naming the closest ones.
    """
    if name is None:
        return _library_folder()
    stem = name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else name
    shipped = library_schedules()
    if stem not in shipped:
        raise PipedslError(f"no schedule {name!r} in the library{_suggest(stem, shipped)}")
    return shipped[stem]


def resolve(spec: str | os.PathLike[str]) -> Path:
    """The file a spec names: a library schedule for a bare name that is not a file, else the path.

    Raises PipedslError for a path that does not exist or has a kind of file we cannot read.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise PipedslError(f"a schedule is named by a library name or a path, not {type(spec).__name__} {spec!r}")
    path = Path(spec)
    suffix = path.suffix.lower()
    if not suffix and not path.exists():
        return library_path(str(path))
    # What the path is comes first: a folder or a FIFO is not "an unknown kind of file".
    if path.exists() and not path.is_file():
        raise PipedslError(f"{path}: {_not_a_file(path)}")
    if suffix not in _FORMATS:
        kind = suffix or "(no extension)"
        raise ConversionError(f"{path}: unknown kind of file {kind!r}; expected .sched, .csv or .json")
    if not path.is_file():
        raise PipedslError(f"{path}: {_not_a_file(path)}")
    return path


def _not_a_file(path: Path) -> str:
    """Why ``path``, which is not a regular file, cannot be read as a schedule."""
    if path.is_dir():
        return "is a directory, not a schedule file"
    if path.exists():
        # A FIFO, socket or device would block or never end: not read.
        return "is not a regular file (a pipe, socket or device); give a schedule file"
    return "no such file"


def parsed(spec: str | os.PathLike[str]) -> Module:
    """The syntax tree of a ``.sched`` spec, parsed once per version of the file."""
    path = resolve(spec)
    if path.suffix.lower() != _SUFFIX:
        raise PipedslError(f"{path}: only .sched files have a syntax tree; this is a {path.suffix} file")
    return _parsed_path(path)


def _parsed_path(path: Path) -> Module:
    """:func:`parsed` of a resolved ``.sched`` path."""
    try:
        modified = path.stat().st_mtime_ns
    except OSError as err:
        raise PipedslError(f"{path}: cannot read: {err.strerror or err}") from None
    return _parse_file(path, modified)


@functools.lru_cache(maxsize=_CACHED_FILES)
def _parse_file(path: Path, modified: int) -> Module:
    return parse_source(_read(path), file=str(path))


def parameters(spec: str | os.PathLike[str]) -> tuple[str, ...]:
    """The parameter names a ``.sched`` schedule declares, in source order; none for CSV and JSON."""
    path = resolve(spec)
    if path.suffix.lower() != _SUFFIX:
        return ()
    return tuple(p.name for p in _parsed_path(path).schedule.params)


def load(
    spec: str | os.PathLike[str],
    /,
    *,
    max_actions: int = MAX_ACTIONS,
    **params: int | str,
) -> Schedule | Policy:
    """Load a schedule by library name or path, choosing the reader by the file's extension.

    A ``.sched`` file with a ``policy`` block gives a :class:`~pipedsl.policy.Policy`
    instead of a Schedule: limits and priorities that :func:`pipedsl.synthesize.synthesize`
    turns into an order against costs (the simulator's cost model, or uniform ones).

    A ``.sched`` file is evaluated under ``params`` (overrides of its defaults; ints, or
    strings that spell one) and records its path as ``Schedule.source``. A library
    schedule is named by the name it is loaded by (``1f1b``, whatever its ``schedule``
    line says: a name may not start with a digit); any other file by the name its
    ``schedule`` line gives (``schedule my_1f1b`` is ``my_1f1b``, whatever the file is
    called), so tables, plots and saved cost files use the name the user chose. A ``.csv`` file
    (PyTorch's compute-only form) takes only ``microbatches``, the count PyTorch keeps
    outside the file; a ``.json`` file records everything and takes none.

    Raises:
      PipedslError: a missing or unreadable file, an unknown name or extension, or
        parameters the format does not take.
      ScheduleSyntaxError, ScheduleEvalError: the ``.sched`` text does not parse or evaluate.
    """
    return schedule_file(spec).load(max_actions=max_actions, **params)


def load_arrays(
    spec: str | os.PathLike[str],
    /,
    *,
    max_actions: int = MAX_ACTIONS,
    refusal_ends: bool = False,
    **params: int | str,
) -> ScheduleArrays | Policy:
    """:func:`load`, a ``.sched`` file's actions made straight into int columns
    (:func:`~pipedsl.lang.evaluate.evaluate_arrays`: no object per action, so no source
    position per action); a CSV or JSON file is read as :func:`load` reads it. What a
    caller that validates and times many schedules (the plan search) asks for. Raises as
    :func:`load`; with ``refusal_ends``, a ``.sched`` file's first error, a failed
    ``require``, ends its evaluation (see :func:`~pipedsl.lang.evaluate.evaluate_arrays`)."""
    return schedule_file(spec).load_arrays(max_actions=max_actions, refusal_ends=refusal_ends, **params)


def schedule_file(spec: str | os.PathLike[str]) -> ScheduleFile:
    """The file ``spec`` names (:func:`resolve`), a ``.sched`` file parsed (:func:`parsed`):
    what :func:`load` and :func:`load_arrays` evaluate. Raises as they do before evaluating."""
    path = resolve(spec)
    if path.suffix.lower() == _SUFFIX:
        module = _parsed_path(path)
        return ScheduleFile(path, module, _name(path), tuple(p.name for p in module.schedule.params))
    return ScheduleFile(path, None, None, ())


@dataclass(frozen=True, slots=True, eq=False)
class ScheduleFile:
    """A schedule file found and, for a ``.sched`` file, parsed (its syntax tree ``module``,
    the name it loads by and its parameters, in source order; None, None and none for a
    CSV or JSON file). A caller that evaluates one file many times, the plan search once
    per shape, takes it once (:func:`schedule_file`): the file is then neither looked for
    nor checked for a new version again."""

    path: Path
    module: Module | None
    name: str | None
    parameters: tuple[str, ...]

    def load(self, *, max_actions: int = MAX_ACTIONS, **params: int | str) -> Schedule | Policy:
        """:func:`load` of this file."""
        path = self.path
        if self.module is not None:
            return evaluate(self.module, params=params, name=self.name, source=str(path), max_actions=max_actions)
        # The CSV and JSON readers load only for such files: a .sched file never needs them.
        from pipedsl import interop

        text = _read(path)
        if path.suffix.lower() == ".csv":
            extra = sorted(set(params) - {"microbatches"})
            if extra:
                raise ConversionError(
                    f"{path}: a CSV schedule has no parameter {extra[0]!r}; the only one it takes is "
                    "microbatches (-p microbatches=N), the count PyTorch keeps outside the file"
                )
            count = params.get("microbatches")
            return interop.from_csv(text, file=str(path), num_microbatches=None if count is None else int(count))
        if params:
            raise ConversionError(
                f"{path}: a JSON schedule records every value and takes no parameters; got {sorted(params)[0]!r}"
            )
        return interop.from_json(text, file=str(path))

    def layout(self, **params: int | str) -> tuple[int, int, tuple[int, ...]] | None:
        """A ``.sched`` file's stages, devices and placement under ``params``, its orders
        not made (:func:`~pipedsl.lang.evaluate.evaluate_layout`); None for a CSV or JSON
        file. Raises as :meth:`load` does for what comes before the orders."""
        return None if self.module is None else evaluate_layout(self.module, params=params)

    def load_arrays(
        self, *, max_actions: int = MAX_ACTIONS, refusal_ends: bool = False, **params: int | str
    ) -> ScheduleArrays | Policy:
        """:func:`load_arrays` of this file."""
        if self.module is not None:
            return evaluate_arrays(
                self.module, params=params, name=self.name, source=str(self.path), max_actions=max_actions,
                refusal_ends=refusal_ends,
            )  # fmt: skip
        loaded = self.load(max_actions=max_actions, **params)
        return loaded if isinstance(loaded, Policy) else ScheduleArrays.of(loaded)


def parse(
    text: str,
    /,
    *,
    name: str | None = None,
    file: str = "<string>",
    max_actions: int = MAX_ACTIONS,
    **params: int | str,
) -> Schedule | Policy:
    """Parse and evaluate ``.sched`` text; like :func:`load`, with ``source`` None.

    Args:
      text: the text of a ``.sched`` file.
      name: the schedule's name; defaults to the one written after ``schedule``.
      file: how positions in error messages name the text.
      max_actions: the most actions evaluation may emit before it stops with an error.
      **params: overrides of the schedule's parameters.
    """
    if not isinstance(text, str):
        raise PipedslError(f"parse takes the schedule's text as a str, not {type(text).__name__}")
    module = parse_source(text.removeprefix("\ufeff"), file=file)
    return evaluate(module, params=params, name=name, source=None, max_actions=max_actions)


def _name(path: Path) -> str | None:
    """A ``.sched`` file's schedule name: a library file's stem; None (the name its
    ``schedule`` line gives) for any other."""
    shipped = library_schedules().get(path.stem)
    if shipped is not None and shipped.resolve() == path.resolve():
        return path.stem
    return None


def _read(path: Path) -> str:
    # utf-8-sig: editors on some systems start files with a byte-order mark; accept it.
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise PipedslError(
            f"{path}: not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x}); save it as UTF-8"
        ) from None
    except OSError as err:
        raise PipedslError(f"{path}: cannot read: {err.strerror or err}") from None


def _suggest(name: str, known: dict[str, Path]) -> str:
    close = difflib.get_close_matches(name, list(known), n=2, cutoff=0.5)
    if close:
        return f"; did you mean {' or '.join(repr(c) for c in close)}?"
    return f"; it has {', '.join(known) or 'none'}"
