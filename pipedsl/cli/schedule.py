"""``pipedsl check``, ``show`` and ``convert``: the schedule commands.

They take no cost options: a policy schedule is synthesised against the default cost model
(a note on stderr says so)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipedsl import interop, library
from pipedsl.cli.common import (
    EXIT_OK,
    add_command,
    add_param_option,
    default_costs_note,
    load_schedule,
    report_error,
    synthesize_policy,
)
from pipedsl.cli.layout import for_reader
from pipedsl.cli.outputs import CONVERTED, FORCE_HELP, check_output_file
from pipedsl.errors import PipedslError
from pipedsl.ir import Schedule
from pipedsl.policy import Policy
from pipedsl.program import lower
from pipedsl.rendezvous import exchange_groups, exchange_order
from pipedsl.validate import validate
from pipedsl.words import plural

__all__ = ["register"]


def _describe(schedule: Schedule) -> str:
    if not schedule.params:
        return schedule.name
    params = ", ".join(f"{k}={v}" for k, v in schedule.params)
    return f"{schedule.name}({params})"


def _cmd_check(args: argparse.Namespace) -> int:
    worst = EXIT_OK
    for path in args.files:
        try:
            loaded = library.load(path, max_actions=args.max_actions, **args.params)
            policy = loaded if isinstance(loaded, Policy) else None
            schedule = (
                loaded if isinstance(loaded, Schedule) else synthesize_policy(loaded, None, path=path, note=False)
            )
            report = validate(schedule, max_inflight=args.max_inflight)
        except PipedslError as err:
            worst = max(worst, report_error(err, path=path))
            continue
        peaks = " ".join(map(str, report.peak_inflight))
        print(
            for_reader(
                f"{path}: ok  {_describe(schedule)}: {plural(schedule.num_stages, 'stage')}, "
                f"{plural(schedule.num_devices, 'device')}, {plural(schedule.num_microbatches, 'microbatch')}, "
                f"{plural(report.num_actions, 'action')}, "
                f"peak in-flight per device {peaks}" + ("" if policy is None else f" ({default_costs_note(policy)})")
            )
        )
        if args.verbose:
            print(f"{path}: {_rendezvous_note(schedule)}")
        if policy is not None and policy.max_activation_bytes is not None:
            # The default cost model gives activations no size, so a byte limit held here
            # says nothing about the costs the policy will be synthesised against.
            print(
                f"{path}: note: its activation-byte limit is not tested here: the default cost model gives"
                " activations 0 bytes; `pipedsl simulate --costs FILE` synthesises it against real sizes",
                file=sys.stderr,
            )
    return worst


def _rendezvous_note(schedule: Schedule) -> str:
    """What the schedule's transfers do where each is a rendezvous (a collective both
    devices call, as on Ray): a validated schedule always runs so
    (:mod:`pipedsl.rendezvous`), in this many collectives."""
    program = lower(schedule)
    transfers, collectives = len(exchange_order(program)), len(exchange_groups(program))
    return (
        f"runs under rendezvous transfers too (as every valid schedule does): {plural(transfers, 'transfer')} "
        f"in one exchange order, made as {plural(collectives, 'collective')}"
    )


def _cmd_show(args: argparse.Namespace) -> int:
    loaded = library.load(args.file, max_actions=args.max_actions, **args.params)
    if isinstance(loaded, Policy):
        print(f"{loaded.label}: policy: {loaded.describe()}")
        schedule = synthesize_policy(loaded, None, path=args.file)
    else:
        schedule = loaded
    if args.lowered:
        print(lower(schedule).format())
        return EXIT_OK
    placement = " ".join(map(str, schedule.placement))
    print(
        f"{_describe(schedule)}: {plural(schedule.num_stages, 'stage')} on {plural(schedule.num_devices, 'device')} "
        f"(placement {placement}), {plural(schedule.num_microbatches, 'microbatch')}"
    )
    print(schedule.format_grid())
    # The grid is shown even for an invalid schedule: seeing it is how one finds the fault.
    validate(schedule)
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    if args.output is not None:
        check_output_file(args.output, option="-o", writes=CONVERTED[args.to], reads=(args.file,), force=args.force)
    schedule = load_schedule(args.file, args.params, max_actions=args.max_actions)
    validate(schedule)
    text = interop.export(schedule, args.to, lowered=args.lowered)
    if args.output is None:
        sys.stdout.write(text)
    else:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as err:
            raise PipedslError(f"{args.output}: cannot write: {err.strerror or err}") from None
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``check``, ``show`` and ``convert`` to ``pipedsl``'s subcommands."""
    _register_check(subparsers)
    _register_show(subparsers)
    _register_convert(subparsers)


def _register_check(subparsers: argparse._SubParsersAction) -> None:
    check = add_command(
        subparsers,
        "check",
        _cmd_check,
        summary="validate schedules and print their size and peak in-flight activations",
        description=(
            "Load each FILE, evaluate it with the given parameters and check every validation rule\n"
            "(completeness, placement, dependency order, deadlock, optional in-flight limit).\n"
            "Prints one line per valid file; errors go to stderr with file:line:col. A schedule that\n"
            "passes also runs where every transfer is a rendezvous (a collective both devices call,\n"
            "as on Ray): --verbose says in how many collectives."
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
    check.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print, per valid file, its transfers and the collectives they take under rendezvous",
    )


def _register_show(subparsers: argparse._SubParsersAction) -> None:
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


def _register_convert(subparsers: argparse._SubParsersAction) -> None:
    convert = add_command(
        subparsers,
        "convert",
        _cmd_convert,
        summary="convert a schedule between .sched, PyTorch's CSV and JSON",
        description=(
            "Load FILE, validate it and write it in another form: csv (PyTorch pipelining's\n"
            "compute-only CSV), json (pipedsl's JSON form of the IR) or sched (the language's\n"
            "table form, which pipedsl reads back). Writes to stdout unless -o is given. With\n"
            "--lowered, the CSV is PyTorch's runtime form, with the sends and receives."
        ),
        examples=(
            "  pipedsl convert schedules/1f1b.sched -p pp=4 --to csv -o 1f1b.csv\n"
            "  pipedsl convert torch_schedule.csv --to sched -o imported.sched\n"
            "  pipedsl convert schedules/zbv.sched --to csv --lowered -o zbv_runtime.csv"
        ),
    )
    convert.add_argument("file", metavar="FILE", help="a .sched, .csv or .json schedule")
    convert.add_argument("--to", required=True, choices=interop.FORMATS, help="the output format")
    convert.add_argument("-o", "--output", metavar="OUT", help="write here instead of stdout")
    convert.add_argument("--force", action="store_true", help=FORCE_HELP)
    convert.add_argument(
        "--lowered",
        action="store_true",
        help="with --to csv, PyTorch's runtime form: the computations with SEND_F, RECV_F, SEND_B and RECV_B",
    )
    add_param_option(convert)
