"""``pipedsl simulate``, ``plot`` and ``trace``: a schedule against a cost model.

All three take the same cost options::

    --f S[,S...]  --b ...  --i ...  --w ...   seconds per F / B / I / W (one, or one per stage)
    --comm S                                  seconds per transfer
    --blocking-sends                          a sender waits for its transfer to arrive
    --costs FILE.toml                         the full model (options above override it)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipedsl import library
from pipedsl.arrays import paused_collector
from pipedsl.cli.common import (
    EXIT_OK,
    add_command,
    add_param_option,
    load_schedule,
    make_console,
    report_error,
    synthesize_policy,
)
from pipedsl.cli.layout import fitted_table, paragraph
from pipedsl.cli.outputs import FORCE_HELP, PICTURE, TRACE, check_output_file
from pipedsl.errors import ConversionError, PipedslError, ScheduleInvalid
from pipedsl.policy import Policy
from pipedsl.simulator.costs import CostModel
from pipedsl.simulator.engine import Simulation, simulate
from pipedsl.simulator.speed import relative_speed
from pipedsl.timeline import Timeline
from pipedsl.validate import checked
from pipedsl.words import plural

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["register", "cost_model_from_args"]


# --- cost options ------------------------------------------------------------------------


def _seconds(text: str) -> float | tuple[float, ...]:
    """``1.5`` or ``1,1,2,1`` (one per stage); range checks are the cost model's."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds as a number or a comma-separated list per stage, got {text!r}"
        ) from None
    return values[0] if len(values) == 1 else values


def _positive_steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps >= 1, got {text!r}")
    return value


def _add_cost_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cost model",
        "Seconds per action, uniform or one per stage (--f 1,1,1,1.5).\n"
        "Defaults: F=1, B=2F, I=W=B/2, free communication. Options override --costs.",
    )
    group.add_argument("--costs", metavar="FILE.toml", help="read the full cost model (field names as keys)")
    group.add_argument("--f", type=_seconds, metavar="S", help="seconds per forward (F)")
    group.add_argument("--b", type=_seconds, metavar="S", help="seconds per full backward (B); default 2 x F")
    group.add_argument("--i", type=_seconds, metavar="S", help="seconds per input-gradient backward (I); default B/2")
    group.add_argument("--w", type=_seconds, metavar="S", help="seconds per weight-gradient backward (W); default B/2")
    group.add_argument(
        "--comm",
        type=float,
        metavar="S",
        help="seconds per transfer between devices (the latency; bytes / bandwidth from --costs add to it)",
    )
    group.add_argument(
        "--blocking-sends",
        action="store_true",
        help="a device cannot compute while its send is in flight (default: sends overlap compute)",
    )
    group.add_argument(
        "--update",
        type=_seconds,
        metavar="S",
        help="seconds of a stage's optimizer update, priced between consecutive steps (simulate --steps)",
    )
    group.add_argument(
        "--update-barrier",
        action="store_true",
        help="the update reads the whole model's gradients (a global-norm clip, a finiteness check): "
        "every device waits for all gradients, so consecutive steps do not overlap",
    )
    group.add_argument(
        "--per-device",
        action="store_true",
        help="times are a device's whole share of the model, split evenly over the stages it holds "
        "(compare schedules with different stages per device on the same model)",
    )


# Bounds past which a cost is a mistake rather than a measurement, and past which sums
# over a few million actions leave the floats' exact range: about 31 years per action,
# an exabyte per transfer.
_MAX_SECONDS = 1e9
_MAX_BYTES = 10**18
_SECONDS_FIELDS = ("forward", "backward", "input_grad", "weight_grad", "latency")
_BYTES_FIELDS = ("activation_bytes", "gradient_bytes", "residual_bytes", "weight_residual_bytes")


def _largest(value: object) -> float:
    if value is None:
        return 0.0
    return max(value) if isinstance(value, tuple) else float(value)  # type: ignore[arg-type]


def _check_magnitudes(costs: CostModel) -> None:
    """Refuse costs so large that the simulated times would overflow or lose all precision."""
    for field in _SECONDS_FIELDS:
        largest = _largest(getattr(costs, field))
        if largest > _MAX_SECONDS:
            raise PipedslError(
                f"{field} = {largest:g} s is more than the {_MAX_SECONDS:g} s (about 31 years) a"
                " cost may be per action; give seconds, as in --f 0.012"
            )
    largest_bytes = max(_largest(getattr(costs, field)) for field in _BYTES_FIELDS)
    if largest_bytes > _MAX_BYTES:
        raise PipedslError(
            f"a transfer or residual of {largest_bytes:g} bytes is more than the {_MAX_BYTES:g} accepted"
        )
    transfer = costs.transfer_seconds(largest_bytes)
    if transfer > _MAX_SECONDS:
        raise PipedslError(
            f"a transfer of {largest_bytes:g} bytes at bandwidth {costs.bandwidth:g} bytes/s takes"
            f" {transfer:g} s, more than the {_MAX_SECONDS:g} s a cost may be; check the bandwidth's units"
        )


def cost_model_from_args(args: argparse.Namespace) -> CostModel:
    """The cost model the options describe: ``--costs`` if given, then each option over it.

    Raises PipedslError for costs that are malformed or too large to simulate.
    """
    costs = _options_over_file(args)
    _check_magnitudes(costs)
    return costs


def _options_over_file(args: argparse.Namespace) -> CostModel:
    costs = CostModel.from_toml(args.costs) if args.costs else CostModel()
    changes: dict[str, Any] = {}
    for option, field in (("f", "forward"), ("b", "backward"), ("i", "input_grad"), ("w", "weight_grad")):
        value = getattr(args, option)
        if value is not None:
            changes[field] = value
    if args.comm is not None:
        changes["latency"] = args.comm
    if args.blocking_sends:
        changes["overlap_sends"] = False
    if args.per_device:
        changes["per_device"] = True
    if args.update is not None:
        changes["update"] = args.update
    if args.update_barrier:
        changes["update_barrier"] = True
    return costs.with_changes(**changes) if changes else costs


# --- formatting ----------------------------------------------------------------------------


def _seconds_text(value: float) -> str:
    return f"{value:.6g}"


def _bytes_text(value: int) -> str:
    if value < 1024:
        return f"{value} B" if value else "-"
    size = value / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.4g} {unit}"
        size /= 1024
    return f"{size:.4g} TiB"


def _critical_summary(sim: Simulation) -> str:
    counts: dict[str, int] = {}
    for event in sim.critical_events():
        counts[event.kind.value] = counts.get(event.kind.value, 0) + 1
    parts = " · ".join(f"{kind} {count}" for kind, count in counts.items())
    return f"{len(sim.critical_path)} events ({parts})"


def _device_table(sim: Simulation) -> Table:
    from rich.table import Table

    show_bytes = any(d.peak_activation_bytes for d in sim.devices)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for header in ("device", "stages", "busy (s)", "bubble (s)", "bubble", "peak in-flight"):
        table.add_column(header, justify="left" if header == "stages" else "right")
    if show_bytes:
        table.add_column("peak activations", justify="right")
    schedule = sim.schedule
    for stats in sim.devices:
        stages = ",".join(map(str, schedule.stages_on(stats.device)))
        row = [
            str(stats.device),
            stages,
            _seconds_text(stats.busy),
            _seconds_text(stats.bubble),
            f"{stats.bubble_ratio:.2%}",
            str(stats.peak_inflight)
            if len(stats.stages) == 1
            else f"{stats.peak_inflight} ({stats.peak_inflight_microbatches:.3g})",
        ]
        if show_bytes:
            row.append(_bytes_text(stats.peak_activation_bytes))
        table.add_row(*row)
    return table


def _print_summary(sim: Simulation) -> None:
    console = make_console()
    schedule = sim.schedule
    console.print(
        f"[bold]{sim.label}[/bold]: {plural(schedule.num_stages, 'stage')} on {plural(schedule.num_devices, 'device')}, "
        f"{plural(schedule.num_microbatches, 'microbatch')}, {plural(schedule.num_actions, 'action')}"
    )
    console.print(f"costs: {sim.costs.describe(split=sim.schedule.splits_backward)}")
    console.print(
        f"makespan [bold]{_seconds_text(sim.makespan)} s[/bold]   bubble [bold]{sim.bubble_ratio:.2%}[/bold]   "
        f"critical path {_critical_summary(sim)}"
    )
    console.print(_device_table(sim))
    if sim.steps_s:
        count = len(sim.steps_s)
        single = sim.steps_s[0]
        console.print(
            f"{count} consecutive steps [bold]{_seconds_text(sim.steps_s[-1])} s[/bold] ({count} x the first step "
            f"with its update: {_seconds_text(count * single)} s); a step in a long run "
            f"[bold]{_seconds_text(sim.steady_step or single)} s[/bold]"
        )


def _inflight_text(sim: Simulation) -> str:
    """The peak in-flight count over devices, with microbatch-equivalents when a device
    holds several stages (``11 (5.5)``)."""
    worst = max(sim.devices, key=lambda d: (d.peak_inflight_microbatches, d.peak_inflight))
    if len(worst.stages) == 1:
        return str(worst.peak_inflight)
    return f"{worst.peak_inflight} ({worst.peak_inflight_microbatches:.3g})"


def _print_comparison(sims: Sequence[tuple[str, Simulation]]) -> None:
    ranked = sorted(sims, key=lambda item: (item[1].makespan, item[0]))
    best = ranked[0][1].makespan
    show_bytes = any(d.peak_activation_bytes for _, s in ranked for d in s.devices)
    headers = ["rank", "schedule", "parameters", "makespan (s)", "vs best", "bubble", "peak in-flight"]
    if show_bytes:
        headers.append("peak activations")
    rows = []
    for rank, (_, sim) in enumerate(ranked, start=1):
        row = [
            str(rank),
            sim.schedule.name,
            " ".join(f"{k}={v}" for k, v in sim.schedule.params),
            _seconds_text(sim.makespan),
            "best" if rank == 1 else relative_speed(sim.makespan, best),
            f"{sim.bubble_ratio:.2%}",
            _inflight_text(sim),
        ]
        if show_bytes:
            row.append(_bytes_text(max((d.peak_activation_bytes for d in sim.devices), default=0)))
        rows.append(row)
    console = make_console()
    table = fitted_table(
        headers, rows, width=console.width, left=("schedule", "parameters"),
        droppable=("parameters", "rank", "bubble", "peak activations"),
    )  # fmt: skip
    split = any(s.schedule.splits_backward for _, s in ranked)
    console.print(f"[bold]ranked by makespan[/bold]  (costs: {ranked[0][1].costs.describe(split=split)})")
    console.print(table)
    console.print(
        paragraph(
            "peak in-flight: the most stage activation sets a device holds at once; in parentheses, "
            "microbatches of the device's whole share of the model when it holds several stages.",
            hanging="",
            width=console.width,
        ),
        soft_wrap=True,
    )
    shares = {len(d.stages) for _, s in ranked for d in s.devices}
    if len(shares) > 1 and not ranked[0][1].costs.per_device:
        console.print(
            "[yellow]note:[/yellow] these schedules hold different numbers of stages per device and the "
            "costs are per stage, so they model different amounts of work; add --per-device to compare "
            "them on the same model."
        )


# --- loading ---------------------------------------------------------------------------------


def _timeline_file(path: str) -> Timeline | None:
    """The saved timeline at ``path``, or None when ``path`` is not a timeline JSON file."""
    if Path(path).suffix.lower() != ".json":
        return None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # let the schedule loader report what is wrong with it
    except RecursionError:
        raise ConversionError(f"{path}: not JSON that pipedsl reads: nested too deeply") from None
    if isinstance(data, dict) and data.get("format") == "pipedsl-timeline":
        return Timeline.from_json(data, file=path)
    return None


def _simulate_file(path: str, args: argparse.Namespace, costs: CostModel) -> Simulation:
    """``path`` simulated under ``costs``. An order is evaluated, validated and lowered as
    int columns (a million actions as objects cost about twice the time and memory); when
    it breaks a rule, its objects are checked again, for the error's place in the file."""
    loaded = library.load_arrays(path, max_actions=args.max_actions, **args.params)
    steps = getattr(args, "steps", 1)
    if isinstance(loaded, Policy):
        return simulate(synthesize_policy(loaded, costs, path=path), costs, steps=steps)
    try:
        return simulate(loaded, costs, steps=steps)
    except ScheduleInvalid as err:
        checked(load_schedule(path, args.params, max_actions=args.max_actions))
        raise err from None


def _each_file(paths: Sequence[str], work: Callable[[str], Any]) -> tuple[list[tuple[str, Any]], int]:
    """Run ``work`` on every path; report failures as they come. Returns the successes
    in order and the worst exit code."""
    done: list[tuple[str, Any]] = []
    worst = EXIT_OK
    for path in paths:
        try:
            done.append((path, work(path)))
        except PipedslError as err:
            worst = max(worst, report_error(err, path=path))
    return done, worst


def _json_text(payload: dict[str, Any] | list[dict[str, Any]]) -> str:
    """``payload`` as readable JSON: each key of a summary on its own line, each element
    of a list value compact on its own line, e.g. one critical-path event per line.

    ``json.dumps(indent=2)`` gives the same data but runs the pure-Python encoder token
    by token (a fifth of a large simulation's command); each line here is one call of
    the C encoder.
    """
    if isinstance(payload, list):
        return "[\n" + ",\n".join(_json_object(item, "  ") for item in payload) + "\n]"
    return _json_object(payload, "")


def _json_object(summary: dict[str, Any], margin: str) -> str:
    inner = margin + "  "
    lines = []
    for key, value in summary.items():
        head = f"{inner}{json.dumps(key)}: "
        if isinstance(value, list) and value:
            rows = f",\n{inner}  ".join(map(json.dumps, value))
            lines.append(f"{head}[\n{inner}  {rows}\n{inner}]")
        else:
            lines.append(head + json.dumps(value))
    return margin + "{\n" + ",\n".join(lines) + "\n" + margin + "}"


# --- subcommands -----------------------------------------------------------------------------


def _cmd_simulate(args: argparse.Namespace) -> int:
    # A short command over acyclic data: the collector's passes over the schedule's
    # objects would find nothing to free (the cost is one full pass after the
    # simulation's own pause, or several for a million actions).
    with paused_collector():
        return _simulate_command(args)


def _simulate_command(args: argparse.Namespace) -> int:
    costs = cost_model_from_args(args)
    sims, worst = _each_file(args.files, lambda path: _simulate_file(path, args, costs))
    if not sims:
        return worst
    if args.json:
        ranked = sorted(sims, key=lambda item: (item[1].makespan, item[0])) if len(args.files) > 1 else sims
        payload = [dict(s.to_json(), file=path) for path, s in ranked]
        # One write: json.dump would make one per token (a hundred thousand for a long critical path).
        sys.stdout.write(_json_text(payload[0] if len(args.files) == 1 else payload) + "\n")
    elif len(args.files) == 1:
        _print_summary(sims[0][1])
    else:
        _print_comparison(sims)
    return worst


def _cmd_plot(args: argparse.Namespace) -> int:
    check_output_file(args.output, option="-o", writes=PICTURE, reads=(*args.files, args.costs), force=args.force)
    from pipedsl.simulator.plot import Panel, plot_timelines, save_figure

    costs = cost_model_from_args(args)

    def panel(path: str) -> tuple[Panel, bool | None]:
        """The panel for ``path`` and, where it was simulated here, whether its schedule
        splits the backward (None for a recorded timeline)."""
        timeline = _timeline_file(path)
        if timeline is not None:
            return Panel(timeline=timeline, title=f"{timeline.name} ({Path(path).name})"), None
        sim = _simulate_file(path, args, costs)
        panel = Panel(timeline=sim.timeline, title=sim.label, critical=sim.critical_path if args.critical else ())
        return panel, sim.schedule.splits_backward

    made, worst = _each_file(args.files, panel)
    if worst != EXIT_OK:
        return worst
    panels = [p for _, (p, _) in made]
    simulated = [split for _, (_, split) in made if split is not None]
    caption = f"simulated with costs {costs.describe(split=any(simulated))}" if simulated else ""
    figure = plot_timelines(panels, share_time=False if args.own_time else None, caption=caption)
    save_figure(figure, args.output)
    print(f"wrote {args.output} ({len(panels)} panel{'s' if len(panels) != 1 else ''})")
    return EXIT_OK


def _cmd_trace(args: argparse.Namespace) -> int:
    check_output_file(args.output, option="-o", writes=TRACE, reads=(args.file, args.costs), force=args.force)
    from pipedsl.simulator.trace import write_trace

    timeline = _timeline_file(args.file)
    if timeline is None:
        timeline = _simulate_file(args.file, args, cost_model_from_args(args)).timeline
    write_trace(timeline, args.output)
    print(f"wrote {args.output} ({len(timeline)} events; open in https://ui.perfetto.dev)")
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``simulate``, ``plot`` and ``trace`` to ``pipedsl``'s subcommands."""
    _register_simulate(subparsers)
    _register_plot(subparsers)
    _register_trace(subparsers)


def _register_simulate(subparsers: argparse._SubParsersAction) -> None:
    sim = add_command(
        subparsers,
        "simulate",
        _cmd_simulate,
        summary="simulate schedules under a cost model: makespan, bubble, memory",
        description=(
            "Validate, lower and simulate each FILE under the cost model. One FILE prints its\n"
            "makespan, bubble ratio, critical path and per-device busy time, bubble and peak\n"
            "in-flight activations; several FILEs print a table ranked by makespan. --json prints\n"
            "the same as JSON: an object for one FILE, a list ranked by makespan for several,\n"
            'each with a "file" key naming its input.'
        ),
        examples=(
            "  pipedsl simulate schedules/1f1b.sched -p pp=8 -p microbatches=32\n"
            "  pipedsl simulate schedules/*.sched -p pp=4 -p microbatches=8 --comm 0.1\n"
            "  pipedsl simulate schedules/zb_h1.sched --f 1 --i 1 --w 1 --json\n"
            "  pipedsl simulate zb_h1 -p pp=4 -p microbatches=8 --steps 2 --update 0.5,0.5,0.5,3\n"
            "  pipedsl simulate schedules/interleaved_1f1b.sched --costs costs.toml"
        ),
    )
    sim.add_argument("files", nargs="+", metavar="FILE", help="a .sched, .csv or .json schedule")
    add_param_option(sim)
    _add_cost_options(sim)
    sim.add_argument(
        "--steps",
        type=_positive_steps,
        default=1,
        metavar="N",
        help="also time N consecutive training steps, a device's optimizer update (--update) after its last "
        "compute of each, and report a step in a long run (default 1)",
    )
    sim.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")


def _register_plot(subparsers: argparse._SubParsersAction) -> None:
    plot = add_command(
        subparsers,
        "plot",
        _cmd_plot,
        summary="draw simulated (or measured) timelines, one panel per file",
        description=(
            "Simulate each FILE and draw its timeline: one row per device, one colour per action\n"
            "kind, microbatch numbers on the bars, transfers as grey bars beneath. A FILE may also\n"
            "be a timeline saved as JSON (a measured run), drawn beside the simulated ones, each\n"
            "panel then on its own time (the cost model's seconds are not the machine's).\n"
            "The picture format follows -o's suffix: .png, .svg or .pdf."
        ),
        examples=(
            "  pipedsl plot schedules/1f1b.sched schedules/zb_h1.sched -p pp=4 -p microbatches=8 -o cmp.png\n"
            "  pipedsl plot schedules/1f1b.sched measured.json -p pp=2 -p microbatches=4 -o overlay.svg"
        ),
    )
    plot.add_argument("files", nargs="+", metavar="FILE", help="a schedule, or a saved timeline .json")
    plot.add_argument("-o", "--output", required=True, metavar="OUT", help="the picture to write (.png, .svg, .pdf)")
    plot.add_argument("--force", action="store_true", help=FORCE_HELP)
    add_param_option(plot)
    _add_cost_options(plot)
    plot.add_argument("--critical", action="store_true", help="outline the critical path of simulated panels")
    plot.add_argument(
        "--own-time",
        action="store_true",
        help="scale each panel to its own makespan (the default where measured and simulated timelines are mixed)",
    )


def _register_trace(subparsers: argparse._SubParsersAction) -> None:
    trace = add_command(
        subparsers,
        "trace",
        _cmd_trace,
        summary="write a Chrome/Perfetto trace of a simulated (or measured) timeline",
        description=(
            "Simulate FILE (or read a saved timeline .json) and write the trace event JSON that\n"
            "chrome://tracing and ui.perfetto.dev open: a process per device with a compute track\n"
            "and a track for the transfers it sends. Times are microseconds."
        ),
        examples="  pipedsl trace schedules/zbv.sched -p pp=4 --comm 0.05 -o zbv.trace.json",
    )
    trace.add_argument("file", metavar="FILE", help="a schedule, or a saved timeline .json")
    trace.add_argument("-o", "--output", required=True, metavar="OUT", help="the trace file to write (.json)")
    trace.add_argument("--force", action="store_true", help=FORCE_HELP)
    add_param_option(trace)
    _add_cost_options(trace)
