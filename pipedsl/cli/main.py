"""The ``pipedsl`` command line: the top floor, the only code that sees every package.

:func:`build_parser` gathers the subcommands of each command module (``schedule``,
``simulate``, ``plan``, ``run``, ``calibrate``, ``demo``), each through its ``register``;
:func:`main` runs one and maps errors to exit codes (:mod:`pipedsl.cli.common`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from pipedsl.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    EXIT_USAGE,
    Parser,
    Terminated,
    report_error,
)
from pipedsl.cli.interrupts import Interrupted, TerminatedAtSafePoint, end_process, held_interrupts, take_interrupt
from pipedsl.errors import PipedslError

__all__ = ["build_parser", "main"]

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

exit codes: 0 success, 1 invalid schedule or no plan fits (estimate, search),
  2 usage, syntax or input error,
  130 interrupted (Ctrl-C), 143 terminated (TERM); either ends a run at a step
  boundary, its last checkpoint whole"""


#: The command modules in the order of ``pipedsl --help``, each with the commands its
#: ``register`` adds. A command line names its module here, and only that one is
#: imported: the others bring in the plan search, the executor and JAX.
COMMANDS: dict[str, tuple[str, ...]] = {
    "schedule": ("check", "show", "convert"),
    "simulate": ("simulate", "plot", "trace"),
    "plan": ("estimate", "search"),
    "run": ("run",),
    "calibrate": ("calibrate",),
    "demo": ("demo",),
}

#: The commands that run JAX: a Ctrl-C there is taken at their safe points, never while
#: an XLA call is in flight (:mod:`pipedsl.cli.interrupts`).
HELD_INTERRUPTS = frozenset({"run", "calibrate", "demo"})


def _modules_for(argv: Sequence[str]) -> tuple[str, ...]:
    """The command modules a parser for ``argv`` needs: the one that owns the command
    it starts with, or all of them (for ``--help``, no command or an unknown one)."""
    if argv and not argv[0].startswith("-"):
        for module, commands in COMMANDS.items():
            if argv[0] in commands:
                return (module,)
    return tuple(COMMANDS)


def build_parser(modules: Sequence[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The parser with the commands of ``modules`` (default all: the schedule commands,
    then simulation, planning, running, calibration, the demo)."""
    parser = Parser(
        prog="pipedsl",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in modules:
        importlib.import_module(f"pipedsl.cli.{name}").register(subparsers)
    return parser


def _exit_code(exit: SystemExit) -> int:
    if exit.code is None:
        return EXIT_OK
    return exit.code if isinstance(exit.code, int) else EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit code.

    Run as the program (``argv`` None), a command of :data:`HELD_INTERRUPTS` stopped by
    Ctrl-C ends the process once it has said so, without the interpreter's teardown
    (:func:`~pipedsl.cli.interrupts.end_process`); called with ``argv``, it returns 130.
    """
    own = argv is None
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else ""
    # Held from the start: the command's modules take a while to import.
    held = held_interrupts(name=f"pipedsl {command}") if command in HELD_INTERRUPTS else contextlib.nullcontext()
    with held:
        try:
            parser = build_parser(_modules_for(argv))
        except KeyboardInterrupt:
            print("pipedsl: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        try:
            args = parser.parse_args(argv)
        except SystemExit as exit:
            # argparse exits on --help and on usage errors; callers in-process want a code.
            return _exit_code(exit)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return _run(args, own=own)


def _end(code: int) -> NoReturn:
    """End a command that runs JAX, stopped at a safe point, with ``code``."""
    if "ray" in sys.modules:
        # Its exit handler would do it, and the process ends without them.
        from pipedsl.executor.ray.connection import shutdown_started

        shutdown_started()
    end_process(code)


def _run(args: argparse.Namespace, *, own: bool) -> int:
    """The command's handler on ``args``, its errors mapped to exit codes."""
    try:
        code: int = args.handler(args)
        take_interrupt()  # a Ctrl-C during the command's last part, after its last safe point
        return code
    except PipedslError as err:
        return report_error(err, path=getattr(args, "file", None))
    except KeyboardInterrupt as err:
        # One line, not a traceback. What the command started stops with this process:
        # the search's worker processes are stopped on the way out, a local Ray instance
        # pipedsl started is shut down at exit (its processes die with this one), and a
        # joined cluster stops the actors of a driver that is gone.
        print(f"pipedsl {args.command}: interrupted", file=sys.stderr)
        if own and isinstance(err, Interrupted):
            _end(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except Terminated as err:
        # The same way out as a Ctrl-C: the search's workers stop on the way out, a
        # command that runs JAX ends at its safe point as on Ctrl-C.
        print(f"pipedsl {args.command}: terminated", file=sys.stderr)
        if own and isinstance(err, TerminatedAtSafePoint):
            _end(EXIT_TERMINATED)
        return EXIT_TERMINATED
    except BrokenPipeError:
        # The reader went away (``pipedsl show ... | head``); that is not our error. Point
        # stdout at /dev/null so that the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
