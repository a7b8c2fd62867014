"""The main job, ``pipedsl demo`` (what ``make demo`` runs): no cluster, no GPU.

1. *Library*: check every shipped schedule and print a summary table and one schedule's
   per-device order.
2. *Plan*: calibrate this machine as a cluster of its devices (eight forced CPU devices
   by default, or the accelerators JAX sees: the executor's training steps, memory,
   bandwidth, collectives, dispatch, on CPU how many cores one device keeps busy, on an
   accelerator the matrix products per dtype: :mod:`pipedsl.cli.machine`), search the
   SPMD, pipeline and hybrid plans of the demo transformer on it (on an accelerator a
   small Llama in bf16 sized to its memory), show the ranking and write it as CSV. On
   one device (one TPU chip, or ``--devices 1``) a pipeline's devices all share it: the
   executor runs such a step as one program, and the search prices it so
   (``Plan.shared_devices``).
3. *Run*: take the best SPMD plan, the best hybrid plan (data or tensor parallel stages in
   a pipeline) and the best pure pipelines that the demo transformer splits into, and run
   each for real on the local backend (or Ray): every pipeline device a ``dp x tp`` mesh.
   A few recorded steps fit the cost model to this machine (calibration), the simulator
   predicts the step time from it, then training steps measure it with the loss going
   down (a step of each plan in turn, so that a change in the machine's speed meets
   every plan alike). The machine calibration's own steps are timed again in those
   rounds and fitted again, so that each run's prediction is priced at the machine's
   speed while the runs ran (on shared cores it moves by a fifth over minutes), beside
   the search's price from the calibration before. Prints both against the measured
   step time of every run, whether the predicted order is the measured one and how far
   the machine's speed moved, and draws the simulated and measured timelines side by side.
   Each plan's step is timed in rounds, and their spread (the quartiles over the rounds)
   is part of the table: where two plans' predictions differ by less than the spread of
   their measurements, the demo says so instead of claiming an order, and it checks the
   plan ranked first against the fastest measured within that spread.

Everything lands in ``--out``: ``cluster.toml``, ``calibration.txt`` and
``calibration-during-runs.txt`` (each figure's source and each calibration step; the
output shows a summary), ``plans.csv``, ``runs.csv``, ``timelines.png``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipedsl.cli.calibrate import MACHINE_MICROBATCH, Measurement, Run, measure
from pipedsl.cli.common import add_command, load_schedule, make_console, milliseconds
from pipedsl.cli.layout import fitted_table, paragraph
from pipedsl.cli.machine import (
    MachineCalibration,
    calibrate_machine,
    calibration_steps,
    machine_workload,
    recalibrated,
)
from pipedsl.cli.outputs import CLUSTER_TOML, FORCE_HELP, PICTURE, PLANS_CSV, RUNS_CSV, check_output_folder
from pipedsl.cli.planned import PlannedRun
from pipedsl.cli.timed import STEP_ROUNDS, TimedSteps
from pipedsl.cli.workload import DEMO, DEMO_MODEL, Workload
from pipedsl.errors import PipedslError
from pipedsl.executor.devices import request_devices
from pipedsl.library import library_path, library_schedules
from pipedsl.results import Figure, append_result
from pipedsl.simulator import (
    CostModel,
    Model,
    plot_timelines,
    save_figure,
    search,
    summarize,
)
from pipedsl.simulator.calibration.machine import cluster_toml
from pipedsl.simulator.ranked import zero_words
from pipedsl.simulator.search import DEFAULT_PRUNE
from pipedsl.validate import validate
from pipedsl.words import plural

__all__ = [
    "register", "GLOBAL_BATCH", "best_plans_table", "demo_calibration_steps", "calibrated_search", "plans_to_run",
    "runnable_plans", "pairs_agreeing", "within_spread", "first_is_fastest",
]  # fmt: skip

GLOBAL_BATCH = 32
"""Sequences per step of every plan the demo searches and runs."""
# Each action costs tens of microseconds of dispatch on CPU; microbatches of a few
# sequences per data rank keep that small against their work.
_MIN_RUN_MICROBATCH = MACHINE_MICROBATCH


# --- 1. the library -----------------------------------------------------------------


def _library(console: Console) -> None:
    rows = []
    for name, path in library_schedules().items():
        schedule = load_schedule(path, {}, costs=CostModel())
        report = validate(schedule)
        peaks = " ".join(map(str, report.peak_inflight))
        rows.append(
            [name, str(schedule.num_stages), str(schedule.num_devices), str(schedule.num_microbatches),
             str(report.num_actions), peaks]
        )  # fmt: skip
    console.print(
        fitted_table(
            ("schedule", "stages", "devices", "microbatches", "actions", "peak in-flight per device"), rows,
            width=console.width, title="The schedule library (default parameters)",
            left=("schedule", "peak in-flight per device"), droppable=("devices", "microbatches", "stages"),
        )
    )  # fmt: skip
    one = load_schedule(library_path("zb_h1"), {})
    console.print(
        f"[bold]zb_h1[/bold] per-device order ({one.num_devices} devices, {one.num_microbatches} microbatches):"
    )
    console.print(one.format_grid(), highlight=False)


# --- 2. this machine as a cluster, and the plan search -------------------------------


def demo_calibration_steps(devices: int, workload: Workload = DEMO) -> TimedSteps:
    """The machine calibration's training steps of ``workload`` (the demo transformer by
    default) over ``devices`` devices, compiled (close them when done)."""
    return calibration_steps(devices, workload, microbatch_size=_MIN_RUN_MICROBATCH)


def _search(cluster: Any, *, prune: float | None = DEFAULT_PRUNE, workload: Workload = DEMO) -> Any:
    # The executor's attention is plain (no fused kernel), and on CPU a collective runs
    # on the cores the computation needs, so none of it hides behind the computation.
    # On one device a pipeline's devices can only share it, as the executor runs them.
    return search(
        workload.model, cluster, cluster.gpus_per_node, global_batch=GLOBAL_BATCH, reduce_bytes=4,
        flash_attention=False, dp_overlap=0.0, tp_overlap=0.0, prune=prune, shared_pipelines=cluster.gpus_per_node == 1,
    )  # fmt: skip


def calibrated_search(steps: TimedSteps, workload: Workload = DEMO) -> tuple[MachineCalibration, Any]:
    """Calibrate this machine once on ``steps`` (:func:`demo_calibration_steps` of
    ``workload``), then rank every plan of its model on it (a
    :func:`~pipedsl.simulator.search` frame)."""
    calibration = calibrate_machine(steps, workload.model, microbatch_size=_MIN_RUN_MICROBATCH)
    return calibration, _search(calibration.cluster, workload=workload)


def repriced(plans: list[PlannedRun], cluster: Any, *, workload: Workload = DEMO) -> list[float]:
    """The step time the search gives each of ``plans`` on ``cluster`` (every plan that
    fits is priced there, none pruned), in seconds."""

    # A plan is the same plan on another machine; its policy order is synthesised anew there.
    def unpriced(plan: PlannedRun) -> PlannedRun:
        return dataclasses.replace(plan, planned_s=None, rank=None, synthesis_costs=None)

    prices: dict[PlannedRun, float] = {}
    for _, row in _search(cluster, prune=None, workload=workload).iterrows():
        plan = PlannedRun.from_row(row.to_dict())
        if plan.planned_s is not None:
            prices[unpriced(plan)] = plan.planned_s
    missing = [plan.label() for plan in plans if unpriced(plan) not in prices]
    if missing:
        raise PipedslError(f"the search no longer ranks {', '.join(missing)} on the machine calibrated again")
    return [prices[unpriced(plan)] for plan in plans]


def _plans(console: Console, steps: TimedSteps, workload: Workload, out: Path) -> tuple[MachineCalibration, Any]:
    console.rule(f"[bold]2. Plans for {workload.model.name} ({workload.precision}) on this machine")
    console.print(f"Calibrating this machine ({plural(steps.devices, 'device')}).", highlight=False)
    calibration, frame = calibrated_search(steps, workload)
    (out / "calibration.txt").write_text(calibration.describe() + "\n")
    _say(console, f"{calibration.report.summary()} (each figure's source and each step: {out / 'calibration.txt'})")
    (out / "cluster.toml").write_text(cluster_toml(calibration))
    frame.to_csv(out / "plans.csv", index=False)
    summary = summarize(frame)
    table = best_plans_table(frame, title_of=f"all in {out / 'plans.csv'}", width=console.width)
    console.print(table)
    _say(console, summary.text())
    return calibration, frame


def best_plans_table(frame: Any, *, title_of: str, width: int) -> Table:
    """The demo's table of the best SPMD plan and each schedule's best plan of a search
    ``frame``, fitted to ``width``; ``title_of`` ends its title (where the plans are)."""
    summary = summarize(frame)
    best = ([summary.best_spmd] if summary.best_spmd is not None else []) + list(summary.best_by_schedule)
    best.sort(key=lambda row: row["step_time_s"])
    rows = [
        [str(row["rank"]), row["schedule"] if row["kind"] == "pipeline" else "SPMD", str(row["dp"]), str(row["tp"]),
         str(row["pp"]), str(row["vpp"]), str(row["microbatch_size"]), zero_words(row), row["recompute"],
         f"{row['step_time_s'] * 1e3:.1f}", f"{row['bubble']:.1%}", f"{row['memory_bytes_per_gpu'] / 1e6:.0f}"]
        for row in best
    ]  # fmt: skip
    return fitted_table(
        ("rank", "plan", "dp", "tp", "pp", "vpp", "mb", "zero", "recompute", "step (ms)", "bubble", "memory (MB)"), rows,
        width=width, left=("plan", "recompute"),
        title=f"The best SPMD plan and each schedule's best, of {len(frame):,} that fit ({title_of})",
        droppable=("recompute", "zero", "vpp", "memory (MB)", "bubble", "mb"),
    )  # fmt: skip


def _say(console: Console, text: str) -> None:
    """A paragraph, wrapped at the console's width at word boundaries."""
    console.print(paragraph(text, width=console.width), highlight=False, soft_wrap=True)


# --- 3. running the best plans for real ------------------------------------------------


def _fits_demo_model(plan: PlannedRun, model: Model) -> bool:
    """Whether ``model`` splits as ``plan`` needs (its layers evenly over the stages, its
    heads, key/value heads, width and vocabulary over the tensor axis) and the executor
    runs its options (no recomputation, ZeRO 3 resharding after the forward)."""
    stages = plan.pp * plan.vpp
    return (
        model.layers % stages == 0
        and model.heads % plan.tp == 0
        and model.num_kv_heads % plan.tp == 0
        and model.vocab % plan.tp == 0
        and plan.recompute == "none"
        and plan.not_run is None
        and plan.microbatch_size * plan.dp >= _MIN_RUN_MICROBATCH
    )


def runnable_plans(frame: Any, devices: int, *, model: Model = DEMO_MODEL) -> list[PlannedRun]:
    """The ranked plans of ``frame`` over every device that the executor can run on
    ``model`` (the demo transformer by default), best first."""
    plans = [PlannedRun.from_row(row.to_dict()) for _, row in frame.iterrows()]
    return [p for p in plans if p.devices == devices and _fits_demo_model(p, model)]


_APART = 0.10
"""How far (relative) a further run's prediction stays from every chosen run's, so that
each pair of runs tests the predicted order: in one demo on the quiet 2-core machine, two
plans of one shape priced alike (eager_1f1b and gpipe, dp=2 pp=4) measured 247 and
283 ms, so plans priced closer than this are ordered by the machine rather than by them."""


def plans_to_run(frame: Any, devices: int, top: int, *, model: Model = DEMO_MODEL) -> list[PlannedRun]:
    """The best SPMD plan, the best hybrid plan and the best pure pipeline over every
    device that the executor can run on ``model`` (the demo transformer by default), then the next best pipeline
    plans of other schedules priced at least :data:`_APART` from every plan chosen (at
    most ``top`` runs, fastest predicted first)."""
    runnable = runnable_plans(frame, devices, model=model)
    chosen: list[PlannedRun] = []
    for kind in ("spmd", "hybrid", "pipeline"):
        chosen += [p for p in runnable if p.kind == kind][:1]
    seen = {(p.schedule, p.kind) for p in chosen}
    for p in runnable:
        if len(chosen) >= top:
            break
        if p.kind != "spmd" and (p.schedule, p.kind) not in seen and _apart(p, chosen):
            chosen.append(p)
            seen.add((p.schedule, p.kind))
    return sorted(chosen[:top], key=lambda p: p.planned_s or 0.0)


def _apart(plan: PlannedRun, chosen: list[PlannedRun]) -> bool:
    """Whether ``plan``'s predicted step is at least :data:`_APART` from every chosen one's."""
    mine = plan.planned_s or 0.0
    return all(abs(mine - (c.planned_s or 0.0)) >= _APART * min(mine, c.planned_s or 0.0) for c in chosen)


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run of the demo against its two prices.

    Attributes:
      run: the run (its plan, measured step time, losses, timelines).
      predicted_s: the plan's step time priced at the machine calibrated again in turns
        with the runs, in seconds.
      searched_s: its step time as the search priced it, at the calibration before it.
    """

    run: Measurement
    predicted_s: float
    searched_s: float

    @property
    def error(self) -> float:
        """Predicted over measured, minus one."""
        return self.predicted_s / self.run.measured_s - 1.0

    @property
    def searched_error(self) -> float:
        """The search's price over measured, minus one."""
        return self.searched_s / self.run.measured_s - 1.0

    @property
    def spread_s(self) -> float:
        """The measured step's spread from round to round: its interquartile range, seconds."""
        low, high = self.run.quartiles
        return high - low


def _runs(
    console: Console,
    frame: Any,
    calibration: MachineCalibration,
    steps: TimedSteps,
    workload: Workload,
    *,
    top: int,
    rounds: int,
    backend: str,
    out: Path,
) -> list[RunResult]:
    plans = plans_to_run(frame, steps.devices, top, model=workload.model)
    console.rule(
        f"[bold]3. Running {len(plans)} ranked plans for real ({backend} backend, {plural(steps.devices, 'device')})"
    )
    if not plans:
        raise PipedslError(
            f"no ranked plan over {plural(steps.devices, 'device')} fits {workload.model.name}; nothing to run"
        )
    for plan in plans:
        _say(console, f"plan {plan.rank} ({plan.kind}): {plan.label()}")

    def prepared(i: int) -> None:
        console.print(f" plan {plans[i].rank}", end="\n" if i == len(plans) - 1 else ",", highlight=False)

    runs = [Run(plan.schedule_of(), plan.microbatch_size, plan, workload) for plan in plans]
    _say(
        console,
        f"Compiling and calibrating each plan, then timing {rounds} steps of each, a step of each in turn and a "
        "step of each of the machine calibration's.",
    )
    console.print("compiled and calibrated:", end="", highlight=False)
    reports = measure(runs, backend=backend, steps=rounds, prepared=prepared, each_round=steps.timed_round)
    during = recalibrated(calibration, workload.model, steps.take())
    (out / "calibration-during-runs.txt").write_text(during.describe() + "\n")
    results = [
        RunResult(run=m, predicted_s=price, searched_s=_searched(m))
        for m, price in zip(reports, repriced(plans, during.cluster, workload=workload), strict=True)
    ]
    console.print(_results_table(results, width=console.width))
    _say(console, _order_verdict(results))
    _say(
        console,
        f"{_speed_verdict(calibration, during)} (the calibration steps timed in turns with the runs and fitted again:"
        f" {out / 'calibration-during-runs.txt'})",
    )
    _write_runs(out / "runs.csv", results)
    figure = plot_timelines(
        [p for m in reports for p in m.panels], share_time=False, caption="simulated against measured"
    )
    save_figure(figure, out / "timelines.png")
    return results


def _searched(m: Measurement) -> float:
    assert m.planned_s is not None  # every demo run comes from a ranked plan
    return m.planned_s


def _results_table(results: list[RunResult], *, width: int) -> Table:
    """Each run's loss, its prediction (the machine calibrated in turns with the runs), its
    measured step and spread, and the search's price, fitted to ``width``."""
    rows = []
    for r in results:
        m = r.run
        low, high = m.quartiles
        rows.append([
            _name(r), m.plan.kind if m.plan is not None else "", f"{m.losses[0]:.2f} -> {m.losses[-1]:.2f}",
            milliseconds(r.predicted_s), milliseconds(m.measured_s), f"{milliseconds(low)}-{milliseconds(high)}",
            f"{r.error:+.1%}", milliseconds(r.searched_s), f"{r.searched_error:+.1%}",
        ])  # fmt: skip
    return fitted_table(
        ("plan", "kind", "loss", "predicted ms", "measured ms", "spread ms", "error", "searched ms", "its error"), rows,
        width=width, left=("plan", "kind", "loss"), droppable=("kind", "spread ms", "its error", "loss"),
        title="Predicted (this machine calibrated in turns with the runs) against measured step time",
    )  # fmt: skip


def _name(result: RunResult) -> str:
    """How the demo's tables and verdicts name a run: by its plan's rank in the search."""
    plan = result.run.plan
    return result.run.label if plan is None or plan.rank is None else f"plan {plan.rank}"


def pairs_agreeing(predicted: list[float], measured: list[float], spread: list[float]) -> tuple[int, int]:
    """(pairs of runs that the prediction orders as measured, pairs it orders): a pair
    whose predictions differ by less than the larger ``spread`` of its two measurements
    (seconds) is not ordered by the prediction (:func:`within_spread`)."""
    pairs = [(i, j) for i in range(len(measured)) for j in range(i + 1, len(measured))]
    tied = set(within_spread(predicted, spread))
    ordered = [pair for pair in pairs if pair not in tied]
    same = sum((predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0 for i, j in ordered)
    return same, len(ordered)


def within_spread(predicted: list[float], spread: list[float]) -> list[tuple[int, int]]:
    """The pairs of runs (i < j) whose predictions differ by less than the larger of their
    measured spreads: the measurement cannot tell them apart, so no order is claimed."""
    return [
        (i, j)
        for i in range(len(predicted))
        for j in range(i + 1, len(predicted))
        if abs(predicted[i] - predicted[j]) < max(spread[i], spread[j])
    ]


def first_is_fastest(results: list[RunResult]) -> tuple[RunResult, RunResult, bool]:
    """(the run the search ranked first, the fastest measured, whether the first is the
    fastest or within the measured spread of it: their interquartile ranges overlap)."""
    first = min(results, key=lambda r: r.searched_s)
    fastest = min(results, key=lambda r: r.run.measured_s)
    return first, fastest, first is fastest or first.run.quartiles[0] <= fastest.run.quartiles[1]


def _order_verdict(results: list[RunResult]) -> str:
    """How many pairs of runs the prediction orders as measured (and the search's prices),
    which pairs it cannot order within the measured spread, how many predictions are
    within 20%, and whether the plan ranked first is the fastest measured."""
    measured = [r.run.measured_s for r in results]
    spread = [r.spread_s for r in results]
    same, ordered = pairs_agreeing([r.predicted_s for r in results], measured, spread)
    searched, searched_ordered = pairs_agreeing([r.searched_s for r in results], measured, spread)
    tied = within_spread([r.predicted_s for r in results], spread)
    within = sum(abs(r.error) <= 0.2 for r in results)
    first, fastest, holds = first_is_fastest(results)
    said = [
        f"{same} of {ordered} pairs of runs that the prediction orders are ordered as measured "
        f"(the search's prices: {searched} of {searched_ordered})."
    ]
    for i, j in tied:
        a, b = results[i], results[j]
        said.append(
            f"{_name(a)} and {_name(b)}: predicted {milliseconds(a.predicted_s)} and {milliseconds(b.predicted_s)} ms, a "
            f"difference within the measured spread ({milliseconds(max(a.spread_s, b.spread_s))} ms): no order claimed."
        )
    said.append(f"{within} of {len(results)} predictions within 20% of measured.")
    verdict = "is the fastest measured" if first is fastest else (
        f"is within the measured spread of the fastest, {_name(fastest)}" if holds
        else f"is not the fastest measured: {_name(fastest)} is"
    )  # fmt: skip
    said.append(f"The plan ranked first, {_name(first)}, {verdict}.")
    return " ".join(said)


_DRIFT = 0.15
"""A change of the calibration's largest step beyond which the demo says the machine's
speed moved (on the quiet 2-core machine the median of 11 rounds of that step read
151-183 ms over ten timings within six minutes, in one process with nothing else changed)."""


def _speed_verdict(before: MachineCalibration, during: MachineCalibration) -> str:
    """How far the machine's speed moved from the calibration ``before`` the search to
    the one ``during`` the runs, read on the calibration's largest step."""
    layers, sequences, _ = shape = before.largest_step
    then, now = before.step_s[shape], during.step_s[shape]
    change = now / then - 1.0
    said = (
        f"The calibration's largest step ({layers} layer{'s' if layers > 1 else ''} x {sequences} sequence"
        f"{'s' if sequences > 1 else ''} per device) took {milliseconds(then)} ms before the search and {milliseconds(now)} ms "
        f"in turns with the runs ({change:+.0%}): "
    )
    if abs(change) <= _DRIFT:
        return (
            said + f"the machine held its speed (within {_DRIFT:.0%}); the predictions are priced at the runs' speed."
        )
    return said + (
        f"the machine ran {'faster' if change < 0 else 'slower'} during the runs than before the search "
        "(devices that share cores run as fast as the rest of the machine lets them), so the search's prices "
        "carry that difference and the predictions, priced at the runs' speed, do not."
    )


_OUTPUTS = (
    ("cluster.toml", CLUSTER_TOML),
    ("plans.csv", PLANS_CSV),
    ("runs.csv", RUNS_CSV),
    ("timelines.png", PICTURE),
)
"""The files the demo writes in ``--out``, and their kinds (refused where another file has the name)."""

_RUN_COLUMNS = (
    "schedule",
    "kind",
    "dp",
    "tp",
    "pp",
    "vpp",
    "zero",
    "microbatches",
    "microbatch_size",
    "predicted_s",
    "measured_s",
    "measured_q1_s",
    "measured_q3_s",
    "error",
    "searched_s",
    "searched_error",
    "fitted_s",
    "fitted_error",
    "first_loss",
    "last_loss",
)


def _write_runs(path: Path, results: list[RunResult]) -> None:
    """One row per run: the plan, its prediction (the machine calibrated in turns with
    the runs) and the search's price against its measured step time, and (for reference)
    the prediction fitted to its own steps (empty where the step runs as one program)."""
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(_RUN_COLUMNS)
        for r in results:
            m, p = r.run, r.run.plan
            assert p is not None  # every demo run comes from a ranked plan
            writer.writerow(
                (p.schedule, p.kind, p.dp, p.tp, p.pp, p.vpp, p.zero, p.microbatches, p.microbatch_size,
                 r.predicted_s, m.measured_s, *m.quartiles, r.error, r.searched_s, r.searched_error, m.predicted_s, m.error,
                 m.losses[0], m.losses[-1])
            )  # fmt: skip


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.devices < 1 or args.top < 1 or args.steps < 1:
        raise PipedslError("--devices, --top and --steps must be at least 1")
    check_output_folder(args.out, option="--out", files=_OUTPUTS, force=args.force)
    request_devices(args.devices)
    import jax

    if args.backend == "ray" and "JAX_PLATFORMS" not in os.environ:
        # The driver's own work (calibration, parameters) stays on the CPU: on a GPU node
        # the actors need the GPUs' memory (a setting of this process, not their environment).
        jax.config.update("jax_platforms", "cpu")
    # The local backend runs on the devices JAX has: CPU devices as many as asked, an
    # accelerator's as many as there are (one TPU chip: every pipeline device shares it).
    devices = args.devices if args.backend == "ray" else min(args.devices, jax.device_count())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = make_console()
    started = time.perf_counter()
    console.rule("[bold]1. The schedule library")
    _library(console)
    workload = machine_workload(devices)
    with demo_calibration_steps(devices, workload) as steps:
        calibration, frame = _plans(console, steps, workload, out)
        results = _runs(
            console, frame, calibration, steps, workload, top=args.top, rounds=args.steps, backend=args.backend,
            out=out,
        )  # fmt: skip
    console.rule()
    seconds = time.perf_counter() - started
    _say(
        console,
        f"done in {seconds:.0f} s; outputs in {out}/: cluster.toml, calibration.txt, calibration-during-runs.txt,"
        " plans.csv, runs.csv, timelines.png",
    )
    _record(results, seconds, calibration, workload)
    return 0


def _record(results: list[RunResult], seconds: float, calibration: MachineCalibration, workload: Workload) -> None:
    """One line for this run in ``$PIPEDSL_RESULTS_DIR/demo.jsonl`` (``make demo`` sets it; unset, nothing),
    with the platform and kind of the devices it ran on and the model it trained."""
    measured = [r.run.measured_s for r in results]
    spread = [r.spread_s for r in results]
    same, pairs = pairs_agreeing([r.predicted_s for r in results], measured, spread)
    searched, searched_pairs = pairs_agreeing([r.searched_s for r in results], measured, spread)
    plans = "; ".join(
        f"{r.run.label} {r.error:+.1%} ±{r.spread_s / r.run.measured_s:.0%} (searched {r.searched_error:+.1%})"
        for r in results
    )
    within = sum(abs(r.error) <= 0.2 for r in results)
    verdict = "no runs"
    if results:
        first, fastest, holds = first_is_fastest(results)
        verdict = "yes" if first is fastest else ("within the spread" if holds else "no")
    machine = calibration.measurements
    figures: dict[str, Figure] = {
        "platform": machine.platform,
        "device_kind": machine.device_kind,
        "devices": machine.devices,
        "model": f"{workload.model.name} {workload.precision}",
        "seconds": round(seconds),
        "plans": plans,
        "within_20_percent": f"{within} of {len(results)}",
        "pairs_in_order": f"{same} of {pairs}",
        "searched_pairs_in_order": f"{searched} of {searched_pairs}",
        "first_is_fastest": verdict,
    }
    append_result("demo", figures, command=shlex.join(["pipedsl", *sys.argv[1:]]))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``demo`` to ``pipedsl``'s subcommands."""
    demo = add_command(
        subparsers,
        "demo",
        _cmd_demo,
        summary="the main job: check the library, plan the demo model on this machine, run the best plans",
        description=__doc__ or "",
        examples="  pipedsl demo --out out\n  pipedsl demo --backend ray --top 2 --steps 3",
    )
    demo.add_argument(
        "--out",
        default="out",
        help="folder for cluster.toml, the calibrations, plans.csv, runs.csv and timelines.png (default out)",
    )
    demo.add_argument(
        "--devices",
        type=int,
        default=8,
        help="JAX devices to plan for and run on (default 8; CPU devices are forced, accelerators at most as many as JAX sees)",
    )
    demo.add_argument("--force", action="store_true", help=FORCE_HELP)
    demo.add_argument("--top", type=int, default=4, help="how many ranked plans to run for real (default 4)")
    demo.add_argument(
        "--steps", type=int, default=STEP_ROUNDS, help=f"measured training steps per plan (default {STEP_ROUNDS})"
    )
    demo.add_argument("--backend", choices=("local", "ray"), default="local", help="executor backend (default local)")
