"""The ``pipedsl`` command line: the top floor, the only code that sees every package.

:func:`build_parser` gathers the subcommands of each command module (``schedule``,
``simulate``, ``plan``, ``run``, ``calibrate``, ``demo``), each through its ``register``;
:func:`main` runs one and maps errors to exit codes (:mod:`pipedsl.cli.common`).
"""

from __future__ import annotations

import argparse
import os
import sys

from pipedsl.cli import calibrate, demo, plan, run, schedule, simulate
from pipedsl.cli.common import EXIT_OK, EXIT_USAGE, report_error
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

exit codes: 0 success, 1 invalid schedule, 2 usage, syntax or input error"""


def build_parser() -> argparse.ArgumentParser:
    """The full parser: the schedule commands, then simulation, planning, running, calibration, the demo."""
    parser = argparse.ArgumentParser(
        prog="pipedsl",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in (schedule, simulate, plan, run, calibrate, demo):
        module.register(subparsers)
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
