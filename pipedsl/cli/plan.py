"""``pipedsl estimate`` and ``search``: parallel plans of a model on a cluster.

::

    pipedsl estimate --model gpt3-175b --cluster a100-80gb --dp 16 --tp 8 --pp 8 --vpp 3 \\
        --microbatch-size 1 --global-batch 1536 --recompute selective --zero 1 \\
        --schedule interleaved_1f1b [--json]
    pipedsl search --model gpt3-175b --cluster a100-80gb --gpus 1024 --global-batch 1536 \\
        [--top 20] [--csv plans.csv] [my_schedule.sched ...]
    pipedsl estimate --model llama-405b --cluster h100-80gb --dp 64 --tp 8 --pp 16 --vpp 8 \\
        --global-batch 2048 --zero 2 --reduce-once --stage-layers ends \\
        --schedule interleaved_1f1b --mfu-flops palm

``--model`` and ``--cluster`` take a preset name or a TOML file (see
:mod:`pipedsl.simulator.hardware`).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

from pipedsl import library
from pipedsl.arrays import paused_collector
from pipedsl.cli.common import (
    EXIT_NOTHING_FITS,
    EXIT_OK,
    add_command,
    add_schedule_params,
    make_console,
    option_error,
    positive_int,
    terminate_raises,
)
from pipedsl.cli.layout import command_lines, fitted_table, paragraph
from pipedsl.cli.llm_flags import (
    add_common_options,
    add_estimate_options,
    add_search_options,
    flops_words,
    search_mfu,
    stage_layers,
)
from pipedsl.cli.outputs import FORCE_HELP, PLANS_CSV, check_output_file
from pipedsl.cli.planned import PlannedRun
from pipedsl.errors import PipedslError
from pipedsl.run_options import RunOptionsError, check_sharding
from pipedsl.simulator.candidates import MAX_GLOBAL_BATCH, MAX_GPUS
from pipedsl.simulator.estimate import Estimate, estimate
from pipedsl.simulator.explain import fit_advice, misfit_text
from pipedsl.simulator.flops import FlopCount
from pipedsl.simulator.frameworks import default_framework
from pipedsl.simulator.hardware import (
    Cluster,
    Model,
    cluster_presets,
    load_cluster,
    load_model,
    model_presets,
)
from pipedsl.simulator.pipelines import Pipelines, ScheduleKey
from pipedsl.simulator.plan import ContextExchange, Plan, Recompute
from pipedsl.simulator.ranked import zero_words
from pipedsl.simulator.search import COLUMNS, DEFAULT_PRUNE, PARALLEL_FROM, Progress, Summary, search_ranking
from pipedsl.simulator.search_work import MAX_PAIRS_PER_SCHEDULE, SearchWork
from pipedsl.simulator.speed import relative_speed
from pipedsl.words import plural

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["register"]

_GIB = 2**30


def _add_hardware_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        metavar="M",
        help=f"a preset ({', '.join(model_presets())}) or a TOML file with a [model] table",
    )
    parser.add_argument(
        "--cluster",
        required=True,
        metavar="C",
        help=f"a preset ({', '.join(cluster_presets())}) or a TOML file with a [cluster] table",
    )


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


# --- estimate ---------------------------------------------------------------------------


# Past these a model description is a mistake (10**12 layers), and the estimate would
# print finite nonsense: a quadrillion parameters, a million layers, sequences of 10**8.
_MAX_PARAMS = 10**15
_MAX_LAYERS = 10**6
_MAX_SEQ_LEN = 10**8


def _check_model_size(model: Model) -> None:
    """Refuse model sizes no estimate can mean anything for, naming the value and the bound."""
    for field, value, bound in (
        ("layers", model.layers, _MAX_LAYERS),
        ("seq_len", model.seq_len, _MAX_SEQ_LEN),
        ("parameters", model.num_params, _MAX_PARAMS),
    ):
        if value > bound:
            raise PipedslError(
                f"model {model.name}: {field} = {value:,} is past the {bound:,} this estimator accepts;"
                " check the model description"
            )


def _cmd_estimate(args: argparse.Namespace) -> int:
    try:
        # The rule run and RunOptions follow, with the options' names.
        check_sharding(
            dp=args.dp, fsdp=args.fsdp, zero=args.zero, reduce_once=args.reduce_once,
            keep_weights=args.keep_weights,
        )  # fmt: skip
    except RunOptionsError as err:
        raise option_error(err) from None
    model = load_model(args.model)
    _check_model_size(model)
    own = _schedule_params(args.schedule, args.params)
    pipelines = Pipelines()
    microbatches = args.global_batch // (args.dp * args.microbatch_size)
    vpp = args.vpp if args.vpp is not None else _placed_vpp(args.schedule, args.pp, microbatches, own, pipelines)
    base = load_cluster(args.cluster)
    plan = Plan(
        dp=args.dp,
        fsdp=args.fsdp,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        cp_exchange=ContextExchange(args.cp_exchange),
        vpp=vpp,
        microbatch_size=args.microbatch_size,
        global_batch=args.global_batch,
        zero=args.zero,
        recompute=Recompute(args.recompute),
        schedule=args.schedule,
        sequence_parallel=not args.no_sequence_parallel,
        flash_attention=not args.no_flash_attention,
        dp_overlap=args.dp_overlap,
        tp_overlap=args.tp_overlap,
        reduce_bytes=args.reduce_bytes,
        reduce_once=args.reduce_once,
        reshard_after_forward=not args.keep_weights,
        stage_layers=stage_layers(args.stage_layers, model, args.pp * vpp),
        framework=args.framework or default_framework(base),
        schedule_params=own,
        update_barrier=not args.no_update_barrier,
    )
    if plan.gpus > MAX_GPUS or plan.global_batch > MAX_GLOBAL_BATCH:
        raise PipedslError(
            f"estimate: {plan.gpus:,} {base.devices_word} and a global batch of {plan.global_batch:,} sequences; the"
            f" estimator plans for at most {MAX_GPUS:,} {base.devices_word} and {MAX_GLOBAL_BATCH:,} sequences: check"
            " the numbers"
        )
    pairs = SearchWork.of([plan]).total
    if pairs > MAX_PAIRS_PER_SCHEDULE:
        raise PipedslError(
            f"estimate: {plan.label} runs {plan.microbatches:,} microbatches through {plan.pp * plan.vpp:,} stages,"
            f" {pairs:,} (stage, microbatch) pairs, past the {MAX_PAIRS_PER_SCHEDULE:,} the estimator evaluates: a"
            " smaller --global-batch, or a larger --microbatch-size or --dp, needs fewer"
        )
    cluster = _sliced(base, slices=args.slices, devices=plan.gpus, command="estimate")
    result = estimate(model, cluster, plan, pipelines=pipelines)
    count = FlopCount(args.mfu_flops)
    advice = [] if result.fits else fit_advice(model, cluster, plan)
    if args.json:
        data = result.to_json()
        data["mfu_flops"] = count.value
        data["mfu"] = result.mfu_by(count)
        data["tflops_per_gpu"] = result.tflops_per_gpu(count)
        if not result.fits:
            data["excess_bytes"] = result.memory.excess
            data["fits_with"] = {a.change: a.memory.total for a in advice}
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        console = make_console()
        _print_estimate(result, console, count)
        if not result.fits:
            for line in misfit_text(result.memory, advice):
                console.print(paragraph(line, width=console.width), highlight=False, soft_wrap=True)
    return EXIT_OK if result.fits else EXIT_NOTHING_FITS


def _schedule_params(schedule: str | None, params: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """``-p NAME=VALUE`` for ``estimate``'s schedule: each a parameter it declares."""
    if params and schedule is None:
        raise PipedslError(f"estimate: -p {next(iter(params))}=... sets a schedule parameter; give --schedule")
    if schedule is not None:
        declared = library.parameters(schedule)
        for name in params:
            if name not in declared:
                raise PipedslError(
                    f"estimate: schedule {schedule} has no parameter {name!r}; it takes {', '.join(declared) or 'none'}"
                )
    return tuple(params.items())


def _placed_vpp(
    schedule: str | None, pp: int, microbatches: int, params: tuple[tuple[str, int], ...], pipelines: Pipelines
) -> int:
    """The stages per device when ``--vpp`` is not given: the number the schedule places
    when it fixes one (``zbv`` places two) and has no ``vpp`` parameter; else 1. A schedule
    that cannot be evaluated gives 1, and the estimate reports why."""
    if schedule is None or pp == 1 or "vpp" in library.parameters(schedule):
        return 1
    own = tuple(pair for pair in params if pair[0] not in ("pp", "vpp", "microbatches"))
    try:
        layout = pipelines.layout(ScheduleKey(schedule, pp, 0, microbatches, own))
    except PipedslError:
        return 1
    return max(layout.num_stages // max(layout.num_devices, 1), 1)


def _print_estimate(result: Estimate, console: Console, count: FlopCount) -> None:
    from rich.table import Table

    plan, memory = result.plan, result.memory
    device = result.cluster.devices_word.removesuffix("s")
    console.print(
        f"[bold]{result.model.name}[/] on {plan.gpus} x {result.cluster.gpu} ({result.cluster.name}): {plan.label}, "
        f"{plan.microbatches} microbatches of {plan.microbatch_size}"
    )
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("step time", f"{result.step_time_s:.3f} s")
    table.add_row("  forward/backward", f"{result.pipeline_time_s:.3f} s")
    table.add_row("  data-parallel tail", f"{result.dp_tail_s:.3f} s")
    table.add_row("  optimizer", f"{result.optimizer_s:.3f} s")
    table.add_row("pipeline bubble", f"{100 * result.bubble:.1f} %")
    table.add_row("tokens per second", f"{result.tokens_per_s:,.0f}")
    table.add_row(f"MFU ({flops_words(count)})", f"{100 * result.mfu_by(count):.1f} %")
    table.add_row(f"  model TFLOP/s per {device}", f"{result.tflops_per_gpu(count):.0f}")
    table.add_row(f"memory per {device}", f"{memory.total / _GIB:.1f} GiB of {memory.usable / _GIB:.1f} GiB usable")
    table.add_row("  weights", f"{memory.weights / _GIB:.1f} GiB")
    table.add_row("  gradients", f"{memory.gradients / _GIB:.1f} GiB")
    table.add_row("  optimizer state", f"{memory.optimizer / _GIB:.1f} GiB")
    table.add_row("  activations", f"{memory.activations / _GIB:.1f} GiB")
    table.add_row("fits", "yes" if result.fits else "[red]no[/]")
    console.print(table)
    console.print("[bold]assumes[/]")
    for assumption in result.assumptions:
        line = f"{assumption.name} = {assumption.value}: {assumption.meaning}"
        console.print(paragraph(line, indent="  ", width=console.width), highlight=False, soft_wrap=True)


# --- search -----------------------------------------------------------------------------


def _cmd_search(args: argparse.Namespace) -> int:
    cores = os.cpu_count() or 1
    if args.jobs is not None and args.jobs > cores:
        raise PipedslError(
            f"--jobs {args.jobs}: this machine has {plural(cores, 'core')}, and processes past one a core only wait"
            f" for one another: give --jobs {cores} or fewer"
        )
    if args.csv is not None:
        check_output_file(
            args.csv, option="--csv", writes=PLANS_CSV, reads=(args.model, args.cluster, *args.extra), force=args.force
        )
    model = load_model(args.model)
    _check_model_size(model)
    cluster = _sliced(load_cluster(args.cluster), slices=args.slices, devices=args.gpus, command="search")
    schedules = None if args.schedules is None else [s.strip() for s in args.schedules.split(",") if s.strip()]
    # The search and its output make hundreds of thousands of objects, none in a cycle: the
    # cyclic collector's passes over the search's large heap would find nothing to free.
    with terminate_raises(), _search_progress(make_console(stderr=True)) as progress, paused_collector():
        ranking = search_ranking(
            model,
            cluster,
            args.gpus,
            global_batch=args.global_batch,
            schedules=schedules,
            extra_schedules=args.extra,
            # What is printed needs only the best --top and each schedule's best; so does a
            # CSV, whose other plans come with their lower bounds (all of them ranked with
            # --no-prune).
            shortlist=None if args.no_prune and args.csv is not None else args.top,
            prune=None if args.no_prune else args.prune,
            progress=progress,
            jobs=args.jobs,
            reduce_bytes=args.reduce_bytes,
            cp_sizes=args.cp,
            stage_split=args.stage_layers,
            tp_overlap=args.tp_overlap,
            framework=args.framework,
            shared_pipelines=args.shared_pipelines,
            schedule_params=args.params,
            update_barrier=not args.no_update_barrier,
        )
    count = FlopCount(args.mfu_flops)
    with paused_collector():
        rows = search_mfu([plan.row() for plan in ranking.plans], model, count)
        if args.csv is not None:
            try:
                with open(args.csv, "w", newline="", encoding="utf-8") as out:
                    _write_plans(out, rows, [b.row() for b in ranking.bounded], model=model.name)
            except OSError as error:
                raise PipedslError(f"{args.csv}: cannot write: {error.strerror or error}") from None
        _print_search(
            rows, ranking.attrs, make_console(), top=args.top, csv=args.csv, layers=model.layers,
            bounded=len(ranking.bounded), flops=flops_words(count),
        )  # fmt: skip
    return EXIT_OK if rows else EXIT_NOTHING_FITS


def _write_plans(out: TextIO, ranked: list[dict[str, Any]], bounded: list[dict[str, Any]], *, model: str) -> None:
    """What ``--csv`` writes: the ranked plans (:data:`COLUMNS`), then every other plan
    that fits (``Bounded.row``), by its lower bound on the step time
    (``step_time_bound_s``; a ranked plan's is its step time), without a rank or a step
    time: they were not simulated. Written as a table of typed columns writes them: an
    empty cell for a value a row lacks, and each memory figure as a fraction where some
    bounded plans have one and others none (plans left uncosted)."""
    columns = [*COLUMNS, "step_time_bound_s"]
    memory = [b["memory_bytes_per_gpu"] for b in bounded]
    fractions = None in memory and any(m is not None for m in memory)
    at_memory = columns.index("memory_bytes_per_gpu")
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in [
        *({**r, "step_time_bound_s": r["step_time_s"]} for r in ranked),
        *({**b, "model": model} for b in bounded),
    ]:
        # Thousands of rows of some thirty cells: one pass over the columns each.
        cells = ["" if v is None else repr(v) if isinstance(v, float) else str(v) for v in map(row.get, columns)]
        value = row.get("memory_bytes_per_gpu")
        if fractions and value is not None:
            cells[at_memory] = repr(float(value))
        writer.writerow(cells)


def _sliced(cluster: Cluster, *, slices: int, devices: int, command: str) -> Cluster:
    """``cluster`` as ``slices`` slices joined by DCN (``--slices``): a TPU cluster's only."""
    if slices == 1:
        return cluster
    if not cluster.torus:
        raise PipedslError(
            f"{command}: --slices {slices} needs a TPU cluster (one with a torus, such as tpu-v5e); "
            f"{cluster.name} has GPUs in nodes (--fsdp groups them: FSDP inside, data parallelism across)"
        )
    if devices % slices:
        raise PipedslError(f"{command}: {devices} chips do not split evenly over --slices {slices}")
    return dataclasses.replace(cluster, slices=slices)


@contextlib.contextmanager
def _search_progress(err: Console) -> Iterator[Progress]:
    """What a search reports its progress to (:data:`~pipedsl.simulator.search.Progress`):
    a bar on ``err`` where it is a terminal, redrawn by the thread the search reports on
    (a search with no thread of its own starts its worker processes forked,
    :mod:`~pipedsl.simulator.workers`); elsewhere (a log, a pipe) a line now and then."""
    if not err.is_terminal:
        yield _ProgressLines().report
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    columns = (TextColumn("{task.description:<11}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Bar(*columns, console=err, transient=True, auto_refresh=False) as bar:
        tasks: dict[str, TaskID] = {}
        drawn = [0.0]  # when the bar was last drawn (time.monotonic)

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done, total=total)
            # At most ten times a second: a search in one process reports every plan.
            if time.monotonic() - drawn[0] >= _REDRAW_S or done == total:
                bar.refresh()
                drawn[0] = time.monotonic()

        yield progress


_REDRAW_S = 0.1
"""Seconds between two drawings of a search's progress bar on a terminal, at least."""

_LINE_EVERY_S = 10.0
"""Seconds between two progress lines of a search whose standard error is not a terminal."""


class _ProgressLines:
    """A search's progress as plain lines on standard error, for a log or a pipe: the
    first report at once, then at most one every :data:`_LINE_EVERY_S` seconds."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.last: float | None = None

    def report(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if self.last is not None and now - self.last < _LINE_EVERY_S and done < total:
            return
        self.last = now
        print(f"pipedsl search: {phase} {done:,} of {total:,} plans ({now - self.started:.0f} s)", file=sys.stderr)


_HEADERS = {
    "rank": "#",
    "schedule": "schedule",
    "dp": "dp",
    "tp": "tp",
    "cp": "cp",
    "pp": "pp",
    "vpp": "vpp",
    "microbatch_size": "mb",
    "microbatches": "m",
    "zero": "zero",
    "recompute": "recompute",
    "step_time_s": "step s",
    "mfu": "MFU %",
    "bubble": "bubble %",
    "memory_bytes_per_gpu": "GiB/GPU",
    "inflight_limit": "limit",
}
"""The columns of the printed table of best plans, and their headers."""


def _prune_factor(text: str) -> float:
    """``--prune``'s factor: a finite number >= 1 (``--no-prune`` simulates every plan)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a factor >= 1, got {text!r}") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be a factor >= 1 (--no-prune simulates every plan), got {text}")
    return value


def _print_search(
    rows: list[dict[str, Any]],
    attrs: dict[str, Any],
    console: Console,
    *,
    top: int,
    csv: str | None,
    layers: int,
    bounded: int,
    flops: str,
) -> None:
    """A search's report: what was tried and dropped, the best ``top`` of ``rows``, each
    schedule's best, the best plan's assumptions and how to run it; with ``csv``, what
    it holds (the ranked rows and ``bounded`` more)."""
    word = attrs["devices_word"]

    def say(text: str, indent: str = "") -> None:
        console.print(paragraph(text, indent=indent, width=console.width), highlight=False, soft_wrap=True)

    say(
        f"{attrs['model']} on {plural(attrs['gpus'], word.removesuffix('s'))} of {attrs['cluster']}, global batch "
        f"{attrs['global_batch']:,}: {attrs['considered']:,} plans, {len(rows):,} ranked, "
        f"{plural(attrs['simulations'], 'pipeline simulation')} in {attrs['seconds']:.1f} s"
        + (f" ({attrs['processes']} processes)" if attrs["processes"] > 1 else "")
    )
    for line in attrs["explanation"].lines(devices=word):
        say(line, "  ")
    say(f"MFU counts {flops}", "  ")
    if not rows:
        return
    console.print(_best_plans_table(rows, top, devices_word=word, width=console.width))
    uneven = sorted({row["pp"] * row["vpp"] for row in rows if layers % (row["pp"] * row["vpp"])})
    if uneven:
        say(
            f"where pp × vpp ({', '.join(map(str, uneven))}) does not divide the {layers} layers, the first and"
            " the last stage hold only the embedding and the head (--stage-layers even leaves such plans out)",
            "  ",
        )
    summary = Summary.of(rows)
    if summary.best_by_schedule:
        console.print(_per_schedule_table(summary, width=console.width))
    say(summary.text())
    console.print("[bold]the best plan assumes[/]")
    for name, value, meaning in attrs["assumptions"]:
        say(f"{name} = {value}: {meaning}", "  ")
    if csv is not None:
        say(
            f"{plural(len(rows), 'ranked plan')} written to {csv}"
            + (f", and {bounded:,} more not ranked, each with a lower bound on its step time" if bounded else "")
        )
    _print_run_command(rows[0], console, csv=csv)


def _best_plans_table(rows: list[dict[str, Any]], top: int, *, devices_word: str, width: int) -> Table:
    """The best ``top`` rows, one column per :data:`_HEADERS` entry, fitted to ``width``
    (:data:`_DROPPED_FIRST` leaves out the columns)."""
    columns = [c for c in COLUMNS if c in _HEADERS]
    headers = [_HEADERS[c].replace("GPU", devices_word.removesuffix("s")) for c in columns]
    cells = [[zero_words(values) if c == "zero" else _cell(c, values[c]) for c in columns] for values in rows[:top]]
    return fitted_table(
        headers, cells, width=width, title=f"best {min(top, len(rows))} plans", left=("schedule", "recompute"),
        droppable=[headers[columns.index(c)] for c in _DROPPED_FIRST],
    )  # fmt: skip


_DROPPED_FIRST = ("inflight_limit", "cp", "microbatches", "bubble", "vpp", "memory_bytes_per_gpu", "mfu", "rank")
"""The best-plans table's columns that may be left out, least wanted first: each where
every row has the same value, then as many as a narrow terminal needs."""


def _cell(column: str, value: Any) -> str:
    """One value of the best-plans table as printed."""
    if column == "step_time_s":
        return f"{value:.3f}"
    if column in ("mfu", "bubble"):
        return f"{100 * value:.1f}"
    if column == "memory_bytes_per_gpu":
        return f"{value / _GIB:.1f}"
    if column == "inflight_limit":
        return str(value) if value else "none"
    return str(value)


def _per_schedule_table(summary: Summary, *, width: int) -> Table:
    """Each schedule's best plan and how it compares with the best SPMD plan, fitted to ``width``."""
    rows = []
    for row in summary.best_by_schedule:
        vpp = f" vpp{row['vpp']}" if row["vpp"] > 1 else ""
        cp = f" cp{row['cp']}" if row.get("cp", 1) > 1 else ""
        limit = f" inflight{row['inflight_limit']}" if row.get("inflight_limit") else ""
        recompute = "" if row["recompute"] == "none" else f" {row['recompute']}"
        spmd = summary.best_spmd
        rows.append([
            row["schedule"],
            f"dp{row['dp']} tp{row['tp']}{cp} pp{row['pp']}{vpp} mb{row['microbatch_size']} "
            f"zero{zero_words(row)}{recompute}{limit}",
            f"{row['step_time_s']:.3f}",
            f"{100 * row['mfu']:.1f}",
            f"{100 * row['bubble']:.1f}",
            "-" if spmd is None else relative_speed(row["step_time_s"], spmd["step_time_s"]),
        ])  # fmt: skip
    return fitted_table(
        ("schedule", "plan", "step s", "MFU %", "bubble %", "vs best SPMD"), rows, width=width,
        title="best plan of each schedule (recomputation none unless named)", left=("schedule", "plan"),
        droppable=("bubble %", "MFU %", "step s"),
    )  # fmt: skip


def _print_run_command(best: dict, console: Console, *, csv: str | None) -> None:
    """How to run the best plan's layout for real (on the executor's built-in transformer)."""
    planned = PlannedRun.from_row(best)
    if planned.not_run is not None:
        console.print(f"the best plan {planned.not_run}; `pipedsl run` does not run it", highlight=False)
        return
    by_rank = (
        f"pipedsl run --plan {planned.rank} --plans {csv}" if csv is not None and planned.rank is not None else None
    )
    what = (
        "the best plan, SPMD (pp = 1: data and tensor parallel, no pipeline),"
        if planned.kind == "spmd"
        else "the best plan"
    )
    # A device per core at most: past that, the CPU devices `run` would make share cores and the step
    # measures the machine's contention, not the plan.
    cores = os.cpu_count() or 1
    where = (
        f"needs {planned.devices:,} devices, more than this machine's {plural(cores, 'CPU core')}: run it on a"
        " cluster of that size (docs/cluster.md, --backend ray); its layout with the built-in transformer is"
        if planned.devices > cores
        else f"runs here on {plural(planned.devices, 'device')} with the built-in transformer"
    )
    lines = [paragraph(f"{what} {where}:", width=console.width), command_lines(planned.command(), width=console.width)]
    if by_rank:
        lines += ["or:", command_lines(by_rank, width=console.width)]
    console.print("\n".join(lines), highlight=False, soft_wrap=True)


# --- registration -----------------------------------------------------------------------


def _add_reduce_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--reduce-bytes",
        type=int,
        choices=(2, 4),
        default=4,
        help="bytes per gradient value in data-parallel reductions: 4 fp32 (default), 2 bf16",
    )
    parser.add_argument(
        "--tp-overlap",
        type=_fraction,
        default=1.0,
        metavar="F",
        help="fraction of the products beside each tensor-parallel collective that can hide it, the collective"
        " decomposed under them (XLA's collective matmul, userbuffer overlap; default 1; 0: exposed)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``estimate`` and ``search`` to ``pipedsl``'s subcommands."""
    _register_estimate(subparsers)
    _register_search(subparsers)


def _register_estimate(subparsers: argparse._SubParsersAction) -> None:
    est = add_command(
        subparsers,
        "estimate",
        _cmd_estimate,
        summary="estimate step time, MFU and memory of one parallel plan",
        description=(
            "Estimate one training plan of MODEL on CLUSTER: per-stage costs from FLOPs, memory\n"
            "traffic and alpha-beta collectives, the pipeline part simulated under SCHEDULE.\n"
            "GPUs = dp x tp x pp; microbatches = global batch / (dp x microbatch size)."
        ),
        examples=(
            "  pipedsl estimate --model gpt3-175b --cluster a100-80gb --dp 16 --tp 8 --pp 8 --vpp 3 \\\n"
            "      --microbatch-size 1 --global-batch 1536 --recompute selective --zero 1 \\\n"
            "      --schedule interleaved_1f1b\n"
            "  pipedsl estimate --model llama-8b --cluster h100-80gb --dp 64 --global-batch 512 \\\n"
            "      --zero 3 --recompute full --json\n"
            "  pipedsl estimate --model llama-8b --cluster tpu-v5e --slices 4 --dp 1024 --fsdp 256 \\\n"
            "      --global-batch 1024 --zero 3 --recompute full"
        ),
    )
    _add_hardware_options(est)
    _add_plan_options(est.add_argument_group("plan"))
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")


def _add_plan_options(plan: argparse._ArgumentGroup) -> None:
    """The plan ``estimate`` costs: degrees, batch, ZeRO, recomputation, schedule, overlap."""
    plan.add_argument("--dp", type=positive_int, default=1, metavar="N", help="data-parallel degree (default 1)")
    plan.add_argument(
        "--fsdp",
        type=positive_int,
        metavar="N",
        help="ZeRO shard groups of N of the dp ranks (FSDP inside a TPU slice or GPU nodes), dp/N replicas of them"
        " whose gradient shards are all-reduced across (HSDP; default: one group of all dp)",
    )
    plan.add_argument(
        "--slices",
        type=positive_int,
        default=1,
        metavar="N",
        help="on a TPU cluster, N slices of GPUs/N chips each, joined by the data-center network (default 1)",
    )
    plan.add_argument("--tp", type=positive_int, default=1, metavar="N", help="tensor-parallel degree (default 1)")
    plan.add_argument("--pp", type=positive_int, default=1, metavar="N", help="pipeline-parallel degree (default 1)")
    plan.add_argument(
        "--vpp",
        type=positive_int,
        metavar="N",
        help="stages per pipeline device (default: what the schedule places, 2 for zbv; else 1)",
    )
    plan.add_argument("--microbatch-size", type=positive_int, default=1, metavar="B", help="sequences per microbatch")
    plan.add_argument("--global-batch", type=positive_int, required=True, metavar="B", help="sequences per step")
    plan.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage (default 0)")
    plan.add_argument(
        "--recompute", choices=[r.value for r in Recompute], default="none", help="activation recomputation"
    )
    plan.add_argument("--schedule", metavar="FILE", help="for pp > 1: a library name (1f1b) or a .sched file")
    add_schedule_params(plan, help="set an integer parameter of the schedule (repeatable), e.g. -p max_inflight=16")
    plan.add_argument(
        "--no-sequence-parallel", action="store_true", help="tensor parallelism without sequence splitting"
    )
    plan.add_argument("--no-flash-attention", action="store_true", help="attention stores its a x s x s scores")
    plan.add_argument(
        "--dp-overlap",
        type=_fraction,
        default=1.0,
        metavar="F",
        help="fraction of the covering computation that hides data-parallel traffic (default 1)",
    )
    _add_reduce_option(plan)
    add_estimate_options(plan)
    add_common_options(plan)


def _register_search(subparsers: argparse._SubParsersAction) -> None:
    src = add_command(
        subparsers,
        "search",
        _cmd_search,
        summary="rank SPMD and pipeline plans of a model on N GPUs or TPU chips by step time",
        description=(
            "Enumerate SPMD plans (data x tensor parallel, ZeRO 0-3, recomputation) and pipeline\n"
            "plans over the schedule library and any extra .sched files; drop plans that do not\n"
            "fit or that a schedule rejects; rank the rest by estimated step time. Prints the best\n"
            "plans and how the best pipeline plan compares with the best SPMD plan."
        ),
        examples=(
            "  pipedsl search --model gpt3-175b --cluster a100-80gb --gpus 1024 --global-batch 1536\n"
            "  pipedsl search --model llama-70b --cluster h100-80gb --gpus 256 --csv plans.csv my.sched\n"
            "  pipedsl search --model llama-70b --cluster tpu-v5e --slices 4 --devices 1024"
        ),
    )
    _add_hardware_options(src)
    src.add_argument(
        "--gpus", "--devices", dest="gpus", type=positive_int, required=True, metavar="N",
        help="GPUs (or TPU chips) to use, all of them",
    )  # fmt: skip
    src.add_argument(
        "--slices",
        type=positive_int,
        default=1,
        metavar="N",
        help="on a TPU cluster, N slices of gpus/N chips each, joined by the data-center network (default 1)",
    )
    src.add_argument(
        "--global-batch", type=positive_int, metavar="B", help="sequences per step (default: about 4 Mi tokens)"
    )
    src.add_argument(
        "--top",
        type=positive_int,
        default=15,
        metavar="K",
        help="show the best K plans (default 15); without --csv only they and each schedule's best are ranked",
    )
    src.add_argument(
        "--csv",
        metavar="OUT",
        help="write the ranked plans to this CSV file, then every other plan that fits with a lower bound on its step"
        " time (step_time_bound_s; with --no-prune every plan is ranked)",
    )
    src.add_argument("--schedules", metavar="A,B", help="try only these library schedules (comma-separated)")
    add_schedule_params(
        src,
        help="set an integer parameter of every schedule tried that declares it (repeatable), e.g. -p max_inflight=16:"
        " a policy is then ranked at that limit only",
    )
    src.add_argument(
        "--prune",
        type=_prune_factor,
        default=DEFAULT_PRUNE,
        metavar="F",
        help="skip pipeline plans whose lower bound exceeds F x their schedule's best step time "
        f"(default {DEFAULT_PRUNE:g})",
    )
    src.add_argument("--no-prune", action="store_true", help="simulate every plan that fits")
    src.add_argument(
        "--shared-pipelines",
        action="store_true",
        help="also rank pipelines whose pipeline devices all share the same devices (every stage on one chip), "
        "priced as the executor runs them: one program per step",
    )
    src.add_argument(
        "--jobs",
        type=positive_int,
        metavar="N",
        help="rank schedules in N processes at once (default: one per core for a search of at least "
        f"{PARALLEL_FROM} pipeline plans, else 1; at most one per core); the ranking is the same for any N",
    )
    src.add_argument("--force", action="store_true", help=FORCE_HELP)
    _add_reduce_option(src)
    add_search_options(src)
    add_common_options(src)
    src.add_argument("extra", nargs="*", metavar="FILE.sched", help="more schedules to try")
