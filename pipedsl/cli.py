"""The ``pipedsl`` command line: the thin top floor that sees every package.

Subcommands here check, show and convert schedules; :mod:`pipedsl.simulator.cli` and
:mod:`pipedsl.executor.cli` add their own through ``register(subparsers)``. Every
subcommand sets ``handler`` (``parser.set_defaults(handler=fn)``), a function from the
parsed arguments to an exit code, and may reuse :func:`add_param_option`,
:func:`parse_params` and :func:`load_schedule`.

Exit codes: 0 success; 1 a schedule breaks a validation rule
(:class:`~pipedsl.errors.ScheduleInvalid`); 2 a usage error, a syntax or evaluation
error, an unreadable input or any other :class:`~pipedsl.errors.PipedslError`. Errors go
to stderr as ``file:line:col: message`` with the source line and a caret, never as a
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipedsl import interop
from pipedsl.errors import PipedslError, ScheduleInvalid
from pipedsl.ir import Schedule

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "EXIT_OK",
    "EXIT_INVALID",
    "EXIT_USAGE",
    "main",
    "build_parser",
    "add_param_option",
    "parse_params",
    "load_schedule",
    "report_error",
    "add_command",
    "make_console",
]

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2

_DESCRIPTION = """\
Write, check, simulate and run pipeline-parallel training schedules.

A schedule is a .sched file (the pipedsl language), PyTorch pipelining's compute-only
CSV, or pipedsl's JSON form. Integer parameters of a .sched file are set with
-p NAME=VALUE, for example -p pp=8 -p microbatches=32."""

_EPILOG = """\
examples:
  pipedsl check schedules/*.sched
  pipedsl show schedules/1f1b.sched -p pp=4 --lowered
  pipedsl convert schedules/zb_h1.sched --to csv -o zb_h1.csv

exit codes: 0 success, 1 invalid schedule, 2 usage, syntax or input error"""


# --- helpers other subcommands reuse -------------------------------------------------


def parse_params(items: Sequence[str]) -> dict[str, int]:
    """Read ``NAME=VALUE`` pairs with integer values into a dict, in the given order.

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
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"parameter {name} needs an integer value, got {value!r}") from None
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
            raise argparse.ArgumentError(self, f"parameter {name} is given twice")
        params[name] = value
        setattr(namespace, self.dest, params)


def add_param_option(parser: argparse.ArgumentParser) -> None:
    """Add ``-p/--param NAME=VALUE`` (repeatable, integer values) as ``args.params``, a dict."""
    parser.add_argument(
        "-p",
        "--param",
        dest="params",
        action=_ParamAction,
        default={},
        metavar="NAME=VALUE",
        help="set an integer parameter of a .sched file (repeatable), e.g. -p pp=8",
    )


def load_schedule(path: str | Path, params: dict[str, int]) -> Schedule:
    """Load a .sched, .csv or .json schedule (see :func:`pipedsl.interop.load_any`), unvalidated."""
    return interop.load_any(path, **params)


def report_error(err: PipedslError, *, path: str | Path | None = None) -> int:
    """Print ``err`` to stderr in our format and return its exit code.

    An error without a source position is prefixed with ``path`` so that the reader
    still knows which file it is about.
    """
    text = str(err)
    if err.pos is None and path is not None and not text.startswith(f"{path}:"):
        text = f"{path}: {text}"
    print(text, file=sys.stderr)
    return EXIT_INVALID if isinstance(err, ScheduleInvalid) else EXIT_USAGE


# --- check, show, convert --------------------------------------------------------------


def _describe(schedule: Schedule) -> str:
    if not schedule.params:
        return schedule.name
    params = ", ".join(f"{k}={v}" for k, v in schedule.params)
    return f"{schedule.name}({params})"


def _cmd_check(args: argparse.Namespace) -> int:
    worst = EXIT_OK
    for path in args.files:
        try:
            schedule = load_schedule(path, args.params)
            report = schedule.validate(max_inflight=args.max_inflight)
        except PipedslError as err:
            worst = max(worst, report_error(err, path=path))
            continue
        peaks = " ".join(map(str, report.peak_inflight))
        print(
            f"{path}: ok  {_describe(schedule)}: {schedule.num_stages} stages, {schedule.num_devices} devices, "
            f"{schedule.num_microbatches} microbatches, {report.num_actions} actions, "
            f"peak in-flight per device {peaks}"
        )
    return worst


def _cmd_show(args: argparse.Namespace) -> int:
    schedule = load_schedule(args.file, args.params)
    if args.lowered:
        print(schedule.lower().format())
        return EXIT_OK
    placement = " ".join(map(str, schedule.placement))
    print(
        f"{_describe(schedule)}: {schedule.num_stages} stages on {schedule.num_devices} devices "
        f"(placement {placement}), {schedule.num_microbatches} microbatches"
    )
    print(schedule.format_grid())
    # The grid is shown even for an invalid schedule: seeing it is how one finds the fault.
    schedule.validate()
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    schedule = load_schedule(args.file, args.params)
    schedule.validate()
    text = interop.export(schedule, args.to)
    if args.output is None:
        sys.stdout.write(text)
    else:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as err:
            raise PipedslError(f"{args.output}: cannot write: {err.strerror or err}") from None
    return EXIT_OK


def make_console(*, stderr: bool = False, width: int = 120) -> Console:
    """A rich console for a command's output; when writing to a file or a pipe, ``width``
    columns wide rather than rich's 80, so that tables are not squeezed."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    return console if console.is_terminal else Console(stderr=stderr, highlight=False, width=width)


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


def _register_core(subparsers: argparse._SubParsersAction) -> None:
    check = add_command(
        subparsers,
        "check",
        _cmd_check,
        summary="validate schedules and print their size and peak in-flight activations",
        description=(
            "Load each FILE, evaluate it with the given parameters and check every validation rule\n"
            "(completeness, placement, dependency order, deadlock, optional in-flight limit).\n"
            "Prints one line per valid file; errors go to stderr with file:line:col."
        ),
        examples=(
            "  pipedsl check schedules/*.sched\n"
            "  pipedsl check schedules/1f1b.sched -p pp=8 -p microbatches=32 --max-inflight 8\n"
            "  pipedsl check torch_1f1b.csv -p microbatches=8"
        ),
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="a .sched, .csv or .json schedule")
    add_param_option(check)
    check.add_argument(
        "--max-inflight",
        type=int,
        metavar="N",
        help="fail if any device holds more than N microbatches' activations at once",
    )

    show = add_command(
        subparsers,
        "show",
        _cmd_show,
        summary="print a schedule's per-device order, or its lowered programs",
        description=(
            "Print FILE's per-device order as a grid, one row per device. With --lowered, print\n"
            "the per-device programs of compute, send, receive and free instructions instead."
        ),
        examples=(
            "  pipedsl show schedules/1f1b.sched -p pp=4 -p microbatches=8\n"
            "  pipedsl show schedules/zbv.sched --lowered"
        ),
    )
    show.add_argument("file", metavar="FILE", help="a .sched, .csv or .json schedule")
    add_param_option(show)
    show.add_argument("--lowered", action="store_true", help="print the lowered per-device programs")

    convert = add_command(
        subparsers,
        "convert",
        _cmd_convert,
        summary="convert a schedule between .sched, PyTorch's CSV and JSON",
        description=(
            "Load FILE, validate it and write it in another form: csv (PyTorch pipelining's\n"
            "compute-only CSV), json (pipedsl's JSON form of the IR) or sched (the language's\n"
            "table form, which pipedsl reads back). Writes to stdout unless -o is given."
        ),
        examples=(
            "  pipedsl convert schedules/1f1b.sched -p pp=4 --to csv -o 1f1b.csv\n"
            "  pipedsl convert torch_schedule.csv --to sched -o imported.sched"
        ),
    )
    convert.add_argument("file", metavar="FILE", help="a .sched, .csv or .json schedule")
    convert.add_argument("--to", required=True, choices=interop.FORMATS, help="the output format")
    convert.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    add_param_option(convert)


def build_parser() -> argparse.ArgumentParser:
    """The full parser: the core subcommands, then the simulator's and the executor's."""
    from pipedsl import calibration, demo
    from pipedsl.executor import cli as executor_cli
    from pipedsl.simulator import cli as simulator_cli
    from pipedsl.simulator import plan_cli

    parser = argparse.ArgumentParser(
        prog="pipedsl",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    _register_core(subparsers)
    simulator_cli.register(subparsers)
    plan_cli.register(subparsers)
    executor_cli.register(subparsers)
    calibration.register(subparsers)
    demo.register(subparsers)
    return parser


def _exit_code(exit: SystemExit) -> int:
    if exit.code is None:
        return EXIT_OK
    return exit.code if isinstance(exit.code, int) else EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:
        # argparse exits on --help and on usage errors; callers in-process want a code.
        return _exit_code(exit)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.handler(args)
    except PipedslError as err:
        return report_error(err, path=getattr(args, "file", None))
    except BrokenPipeError:
        # The reader went away (``pipedsl show ... | head``); that is not our error. Point
        # stdout at /dev/null so that the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
