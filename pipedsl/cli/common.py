"""What every ``pipedsl`` subcommand shares: exit codes, ``-p NAME=VALUE``, loading a
schedule, error reporting, subcommand registration and the console.

Every subcommand sets ``handler`` (``parser.set_defaults(handler=fn)``), a function from the
parsed arguments to an exit code.

Exit codes: 0 success; 1 a schedule breaks a validation rule
(:class:`~pipedsl.errors.ScheduleInvalid`); 2 a usage error, a syntax or evaluation
error, an unreadable input or any other :class:`~pipedsl.errors.PipedslError`; 130
stopped by Ctrl-C; 143 stopped by TERM (``search``, which stops its worker processes
first). Errors go to stderr as ``file:line:col: message`` with the source line and a
caret, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pipedsl import library
from pipedsl.errors import PipedslError, ScheduleInvalid
from pipedsl.ir import Schedule
from pipedsl.lang.numbers import parse_integer
from pipedsl.policy import Policy
from pipedsl.run_options import RunOptionsError

if TYPE_CHECKING:
    from rich.console import Console

    from pipedsl.simulator.costs import CostModel

__all__ = [
    "EXIT_OK",
    "EXIT_INVALID",
    "EXIT_NOTHING_FITS",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "Terminated",
    "terminate_raises",
    "add_param_option",
    "Parser",
    "parse_params",
    "add_schedule_params",
    "load_schedule",
    "synthesize_policy",
    "default_costs_note",
    "report_error",
    "option_error",
    "add_command",
    "make_console",
    "positive_int",
]

EXIT_OK = 0
EXIT_INVALID = 1
"""A schedule that breaks a validation rule."""
EXIT_NOTHING_FITS = 1
"""``estimate`` or ``search``: no plan fits the cluster's memory (a verdict, like an invalid schedule)."""
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
"""The shell's code for a command stopped by SIGINT (Ctrl-C)."""
EXIT_TERMINATED = 143
"""The shell's code for a command stopped by SIGTERM (128 + 15)."""


class Terminated(BaseException):
    """A SIGTERM taken on the main thread (:func:`terminate_raises`). Not an Exception, as
    KeyboardInterrupt is not: no ``except Exception`` on the way out swallows it."""


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise Terminated


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Inside the block a SIGTERM raises :class:`Terminated`, so that what the command
    started is stopped on the way out (a search's worker processes) as on Ctrl-C, and the
    command ends with one line rather than silently in the middle of its work."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def milliseconds(seconds: float | None) -> str:
    """``seconds`` in milliseconds to a tenth ("12.3"), or "-" where there is no figure (None)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def parse_params(items: Sequence[str]) -> dict[str, int]:
    """Read ``NAME=VALUE`` pairs with integer values into a dict, in the given order.

    Values are read as the language reads a number (:func:`~pipedsl.lang.numbers.parse_integer`).

    Raises:
      ValueError: an item without ``=``, a name that is not an identifier, a value that
        is not an integer, or a name given twice.
    """
    params: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name.isidentifier():
            raise ValueError(f"parameter {item!r} should be NAME=VALUE, for example pp=4")
        number = parse_integer(value)
        if number is None:
            raise ValueError(
                f"parameter {name} needs an integer value, got {value!r} (digits 0-9, with a minus sign "
                "for a negative number, as a schedule writes one)"
            )
        if name in params:
            raise ValueError(f"parameter {name} is given twice")
        params[name] = number
    return params


class _ParamAction(argparse.Action):
    """Collects repeated ``-p NAME=VALUE`` into one dict; bad syntax is a usage error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        # A fresh dict each time: the default one is shared by every parse.
        params: dict[str, int] = dict(getattr(namespace, self.dest) or {})
        try:
            ((name, value),) = parse_params([str(values)]).items()
        except ValueError as err:
            raise argparse.ArgumentError(self, str(err)) from None
        if name in params:
            raise argparse.ArgumentError(
                self, f"parameter {name} is given twice: {name}={params[name]} and {name}={value}; keep one"
            )
        params[name] = value
        setattr(namespace, self.dest, params)


_GIVEN = "_pipedsl_given"
"""The namespace attribute where :class:`Parser` keeps, while it parses, the options given
so far (by destination: the words that gave each)."""


def _given_once(parser: argparse.ArgumentParser, namespace: argparse.Namespace, dest: str, said: str) -> None:
    """Refuse an option given twice, or two options that set the same thing (``--gpus``
    and ``--devices``), naming both as given."""
    given: dict[str, str] = namespace.__dict__.setdefault(_GIVEN, {})
    if dest in given:
        first = given[dest]
        parser.error(
            f"{said} is given twice: give it once"
            if first == said
            else f"{first} and {said} set the same thing: give one"
        )
    given[dest] = said


class _StoreOnce(argparse.Action):
    """``store``, refusing a second value for the same destination."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if option_string is not None:
            shown = " ".join(map(str, values)) if isinstance(values, list) else str(values)
            _given_once(parser, namespace, self.dest, f"{option_string} {shown}")
        setattr(namespace, self.dest, values)


class _FlagOnce(argparse.Action):
    """``store_true``, refusing the flag given twice."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        default: bool = False,
        required: bool = False,
        help: str | None = None,
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, const=True, default=default, required=required, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        _given_once(parser, namespace, self.dest, str(option_string))
        setattr(namespace, self.dest, True)


class Parser(argparse.ArgumentParser):
    """``pipedsl``'s parser and its subcommands': an option given twice, or two options
    for one setting, is refused with one line naming both, never the last one kept
    silently; a usage error is one line (the command, the error, where help is)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.register("action", "store_true", _FlagOnce)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        parsed.__dict__.pop(_GIVEN, None)
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def add_param_option(parser: argparse.ArgumentParser) -> None:
    """Add ``-p/--param NAME=VALUE`` (repeatable, integer values) as ``args.params``, a dict,
    and ``--max-actions N``, the bound on the actions a .sched evaluation may emit, as
    ``args.max_actions``: every command that takes parameters loads a schedule."""
    parser.add_argument(
        "--max-actions",
        type=positive_int,
        default=library.MAX_ACTIONS,
        metavar="N",
        help=f"stop evaluating a .sched file past N actions (default {library.MAX_ACTIONS:,})",
    )
    add_schedule_params(parser, help="set an integer parameter of a .sched file (repeatable), e.g. -p pp=8")


def add_schedule_params(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, help: str) -> None:
    """Add ``-p/--param NAME=VALUE`` (repeatable, integer values, a name at most once) as
    ``args.params``, a dict."""
    parser.add_argument(
        "-p", "--param", dest="params", action=_ParamAction, default={}, metavar="NAME=VALUE", help=help
    )


def load_schedule(
    path: str | Path,
    params: dict[str, int],
    *,
    max_actions: int = library.MAX_ACTIONS,
    costs: CostModel | None = None,
) -> Schedule:
    """Load a library schedule or a .sched, .csv or .json file (:func:`pipedsl.library.load`), unvalidated.

    A policy schedule is synthesised (:func:`pipedsl.synthesize.synthesize`)
    against ``costs``; without them, against the default ``CostModel()``, which a note on
    stderr says, since the order then follows costs the command was not given.
    """
    loaded = library.load(path, max_actions=max_actions, **params)
    if isinstance(loaded, Schedule):
        return loaded
    return synthesize_policy(loaded, costs, path=path)


def synthesize_policy(policy: Policy, costs: CostModel | None, *, path: str | Path, note: bool = True) -> Schedule:
    """``policy``'s order under ``costs``; when ``costs`` is None, under the default model,
    with a note on stderr saying so unless ``note`` is False (the caller says it)."""
    from pipedsl.simulator.costs import CostModel
    from pipedsl.synthesize import synthesize

    if costs is None:
        costs = CostModel()
        if note:
            print(f"{path}: note: {default_costs_note(policy)}", file=sys.stderr)
    return synthesize(policy, costs)


def default_costs_note(policy: Policy) -> str:
    """What a command without cost options says about a policy it synthesised."""
    from pipedsl.simulator.costs import CostModel

    return f"{policy.name} is a policy, synthesised against the default cost model ({CostModel().describe()})"


def option_error(err: RunOptionsError) -> PipedslError:
    """A rule of :mod:`pipedsl.run_options` broken on the command line, said with the
    option's name (``--reduce-once applies to zero 2 and 3 ...``)."""
    return PipedslError(f"--{err.argument.replace('_', '-')} {err.rule}")


def report_error(err: PipedslError, *, path: str | Path | None = None) -> int:
    """Print ``err`` to stderr in our format and return its exit code.

    An error without a source position is prefixed with ``path`` so that the reader
    still knows which file it is about.
    """
    text = str(err)
    if err.pos is None and path is not None and not text.startswith(f"{path}:"):
        text = f"{path}: {text}"
    print(text, file=sys.stderr)
    # What the code that raised it knew of the context (the plan a search stopped at).
    for note in getattr(err, "__notes__", ()):
        print(note, file=sys.stderr)
    return EXIT_INVALID if isinstance(err, ScheduleInvalid) else EXIT_USAGE


def make_console(*, stderr: bool = False) -> Console:
    """A rich console for a command's output, :func:`~pipedsl.cli.layout.output_width`
    columns wide when ``$COLUMNS`` says or when writing to a file or a pipe (rich's own
    default there is 80)."""
    from rich.console import Console

    from pipedsl.cli.layout import output_width

    console = Console(stderr=stderr, highlight=False)
    if console.is_terminal and "COLUMNS" not in os.environ:
        return console
    return Console(stderr=stderr, highlight=False, width=output_width())


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    handler: Callable[[argparse.Namespace], int],
    *,
    summary: str,
    description: str,
    examples: str,
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` running ``handler``, with its help text and examples."""
    parser = subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(handler=handler)
    return parser
