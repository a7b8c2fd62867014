"""The main job, ``pipedsl demo`` (what ``make demo`` runs): no cluster, no GPU.

1. *Library*: check every shipped schedule and print a summary table and one schedule's
   per-device order.
2. *Plan*: describe this machine as a cluster (one device per pipeline device, its
   matrix FLOP/s and copy bandwidth measured on the spot), search the SPMD and pipeline
   plans of the demo transformer on it, show the ranking and write it as CSV.
3. *Run*: take the best few pipeline schedules the executor can run here (no data or
   tensor parallelism), run each for real on a local Ray instance (or the local
   backend): one recorded step fits the cost model to this machine (calibration), the
   simulator predicts the step time from it, then a few training steps measure it with
   the loss going down. Prints predicted against measured step time and draws the
   simulated and measured timelines side by side.

Everything lands in ``--out``: ``plans.csv``, ``runs.csv``, ``timelines.png``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipedsl.cli.calibrate import (
    DEMO_MODEL,
    Measurement,
    backend_for,
    measure,
    results_table,
)
from pipedsl.cli.common import add_command, make_console
from pipedsl.errors import PipedslError
from pipedsl.executor.devices import request_devices
from pipedsl.library import library_path, library_schedules, load
from pipedsl.simulator import (
    Cluster,
    plot_timelines,
    save_figure,
    search,
    summarize,
)
from pipedsl.simulator.plan import load_pipeline
from pipedsl.simulator.search import describe

__all__ = ["register", "DEMO_MODEL"]

_GLOBAL_BATCH = 32
_RECORDED_STEPS = 3
# Each action costs tens of microseconds of dispatch on CPU, which the FLOP-based plan
# estimate does not see; microbatches of a few sequences keep that overhead small.
_MIN_RUN_MICROBATCH = 4


# --- 1. the library -----------------------------------------------------------------


def _library(console: Console) -> None:
    table = Table(title="The schedule library (default parameters)", title_justify="left")
    for column in ("schedule", "stages", "devices", "microbatches", "actions", "peak in-flight per device"):
        table.add_column(column, justify="left" if column.startswith(("schedule", "peak")) else "right")
    for name, path in library_schedules().items():
        schedule = load(path)
        report = schedule.validate()
        peaks = " ".join(map(str, report.peak_inflight))
        table.add_row(
            name,
            str(schedule.num_stages),
            str(schedule.num_devices),
            str(schedule.num_microbatches),
            str(report.num_actions),
            peaks,
        )
    console.print(table)
    one = load(library_path("zb_h1"))
    console.print(f"\n[bold]zb_h1[/bold] per-device order ({one.num_devices} devices, {one.num_microbatches} microbatches):")
    console.print(one.format_grid(), highlight=False)


# --- 2. this machine as a cluster, and the plan search -------------------------------


def _measure_machine(devices: int) -> Cluster:
    """This machine as a cluster of ``devices`` CPU devices in one node."""
    import jax
    import jax.numpy as jnp

    n = 512
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        a = matmul(a) * (1.0 / n)
    a.block_until_ready()
    flops = 2 * n**3 * reps / (time.perf_counter() - start)

    cpu = jax.devices()
    payload = jnp.ones((1 << 20,), jnp.float32)
    jax.device_put(payload, cpu[-1]).block_until_ready()
    start = time.perf_counter()
    for _ in range(reps):
        jax.device_put(payload, cpu[-1]).block_until_ready()
    bandwidth = payload.nbytes * reps / (time.perf_counter() - start)

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(devices, 1)
    return Cluster(
        name="this machine",
        gpu="CPU device",
        peak_flops=flops,
        matmul_efficiency=1.0,
        memory_bytes=int(memory),
        hbm_bandwidth=bandwidth,
        gpus_per_node=devices,
        intra_node_bandwidth=bandwidth,
        intra_node_latency=50e-6,
        inter_node_bandwidth=bandwidth,
        inter_node_latency=50e-6,
    )


def _plans(console: Console, cluster: Cluster, devices: int, out: Path) -> Any:
    console.rule("[bold]2. Plans for the demo transformer on this machine")
    console.print(
        f"{cluster.name}: {devices} devices, {cluster.peak_flops / 1e9:.1f} GFLOP/s matrix work each (measured), "
        f"{cluster.intra_node_bandwidth / 1e9:.2f} GB/s between devices (measured)"
    )
    frame = search(DEMO_MODEL, cluster, devices, global_batch=_GLOBAL_BATCH, reduce_bytes=4)
    frame.to_csv(out / "plans.csv", index=False)
    summary = summarize(frame)
    best = ([summary.best_spmd] if summary.best_spmd is not None else []) + list(summary.best_by_schedule)
    best.sort(key=lambda row: row["step_time_s"])
    table = Table(
        title=f"The best SPMD plan and each schedule's best plan, of {len(frame)} that fit (all in {out / 'plans.csv'})",
        title_justify="left",
    )
    for column in ("rank", "plan", "dp", "tp", "pp", "vpp", "mb", "zero", "recompute", "step (ms)", "bubble", "memory (MB)"):
        table.add_column(column, justify="left" if column in ("plan", "recompute") else "right")
    for row in best:
        table.add_row(
            str(row["rank"]),
            row["schedule"] if row["kind"] == "pipeline" else "SPMD",
            str(row["dp"]),
            str(row["tp"]),
            str(row["pp"]),
            str(row["vpp"]),
            str(row["microbatch_size"]),
            str(row["zero"]),
            row["recompute"],
            f"{row['step_time_s'] * 1e3:.1f}",
            f"{row['bubble']:.1%}",
            f"{row['memory_bytes_per_gpu'] / 1e6:.0f}",
        )
    console.print(table)
    console.print(summary.text())
    return frame


# --- 3. running the best schedules for real -------------------------------------------


def _runnable(frame: Any, devices: int, top: int) -> list[dict[str, Any]]:
    """The best plan of each schedule that the executor runs here: a pure pipeline over
    every device, without recomputation, with microbatches of a few sequences."""
    rows = frame[
        (frame["kind"] == "pipeline")
        & (frame["dp"] == 1)
        & (frame["tp"] == 1)
        & (frame["pp"] == devices)
        & (frame["recompute"] == "none")
        & (frame["microbatch_size"] >= _MIN_RUN_MICROBATCH)
    ].drop_duplicates("schedule")
    return [row.to_dict() for _, row in rows.head(top).iterrows()]


def _runs(console: Console, frame: Any, *, devices: int, top: int, steps: int, backend: str, out: Path) -> list[Measurement]:
    rows = _runnable(frame, devices, top)
    console.rule(f"[bold]3. Running the best {len(rows)} pipeline schedules for real ({backend} backend)")
    if not rows:
        raise PipedslError("no pipeline plan over every device fits; nothing to run")
    for row in rows:
        console.print(f"plan {describe(row)}", highlight=False)
    schedules = [load_pipeline(r["schedule"], pp=r["pp"], vpp=r["vpp"], microbatches=r["microbatches"]) for r in rows]
    with backend_for(backend, devices, console) as where:
        reports = []
        for schedule, row in zip(schedules, rows, strict=True):
            m = measure(schedule, microbatch_size=row["microbatch_size"], backend=where, steps=steps)
            console.print(f"  {m.summary()}", highlight=False)
            reports.append(m)
    lines = ["schedule,predicted_s,measured_s,error,first_loss,last_loss"]
    lines += [f"\"{r.label}\",{r.predicted_s},{r.measured_s},{r.error},{r.losses[0]},{r.losses[-1]}" for r in reports]
    console.print(results_table(reports))
    (out / "runs.csv").write_text("\n".join(lines) + "\n")
    figure = plot_timelines([p for r in reports for p in r.panels], share_time=False, caption="simulated against measured")
    save_figure(figure, out / "timelines.png")
    return reports


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.devices < 2 or args.top < 1 or args.steps < 1:
        raise PipedslError("--devices must be at least 2, --top and --steps at least 1")
    request_devices(args.devices)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = make_console()
    started = time.perf_counter()
    console.rule("[bold]1. The schedule library")
    _library(console)
    cluster = _measure_machine(args.devices)
    frame = _plans(console, cluster, args.devices, out)
    _runs(console, frame, devices=args.devices, top=args.top, steps=args.steps, backend=args.backend, out=out)
    console.rule()
    console.print(f"done in {time.perf_counter() - started:.0f} s; outputs in {out}/: plans.csv, runs.csv, timelines.png")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``demo`` to ``pipedsl``'s subcommands."""
    demo = add_command(
        subparsers,
        "demo",
        _cmd_demo,
        summary="the main job: check the library, plan the demo model on this machine, run the best plans",
        description=__doc__ or "",
        examples="  pipedsl demo --out out\n  pipedsl demo --backend local --top 2 --steps 3",
    )
    demo.add_argument("--out", default="out", help="folder for plans.csv, runs.csv and timelines.png (default out)")
    demo.add_argument("--devices", type=int, default=2, help="pipeline devices on this machine (default 2)")
    demo.add_argument("--top", type=int, default=3, help="how many schedules to run for real (default 3)")
    demo.add_argument("--steps", type=int, default=5, help="measured training steps per schedule (default 5)")
    demo.add_argument("--backend", choices=("ray", "local"), default="ray", help="executor backend (default ray)")
