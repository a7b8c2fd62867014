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
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipedsl.errors import PipedslError
from pipedsl.executor.cli import request_devices
from pipedsl.language import library_path, library_schedules, load
from pipedsl.simulator import (
    Cluster,
    Model,
    Panel,
    fit_costs,
    plot_timelines,
    save_figure,
    search,
    simulate,
    summarize,
)
from pipedsl.simulator.search import describe

__all__ = ["register", "DEMO_MODEL"]

DEMO_MODEL = Model(
    name="demo-cpu",
    layers=4,
    hidden=128,
    ffn_hidden=512,
    heads=4,
    seq_len=64,
    vocab=512,
    dtype_bytes=4,
    learned_positions=True,
    tied_embeddings=False,
)
"""The transformer the demo plans and runs: the executor's built-in one at this shape."""

_GLOBAL_BATCH = 32
_RECORDED_STEPS = 3
# Each action costs tens of microseconds of dispatch on CPU, which the FLOP-based plan
# estimate does not see; microbatches of a few sequences keep that overhead small.
_MIN_RUN_MICROBATCH = 4


@dataclass(frozen=True, slots=True)
class RunReport:
    """One schedule run for real: its plan, predicted and measured seconds per step, and losses."""

    label: str
    predicted_s: float
    measured_s: float
    losses: tuple[float, ...]
    panels: tuple[Panel, Panel]

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


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


def _wait(state: Any, backend: Any) -> None:
    """Wait for a step's parameter updates: the local backend returns before they are
    computed (JAX dispatches asynchronously); Ray's steps return when they are done."""
    if backend == "local":
        import jax

        jax.block_until_ready(state)


def _run_one(row: dict[str, Any], *, backend: Any, steps: int, console: Console) -> RunReport:
    import jax
    import optax

    from pipedsl.executor import Pipeline
    from pipedsl.executor.models import transformer

    params = {"pp": row["pp"], "microbatches": row["microbatches"]}
    path = library_path(row["schedule"])
    if "vpp" in {name for name, _ in load(path).params}:
        params["vpp"] = row["vpp"]
    schedule = load(path, **params)
    model = transformer(
        num_stages=schedule.num_stages,
        vocab=DEMO_MODEL.vocab,
        dim=DEMO_MODEL.hidden,
        heads=DEMO_MODEL.heads,
        seq=DEMO_MODEL.seq_len,
        layers_per_stage=DEMO_MODEL.layers // schedule.num_stages,
    )
    key = jax.random.PRNGKey(0)
    batch = model.batch(jax.random.fold_in(key, 1), row["microbatch_size"] * schedule.num_microbatches)
    label = f"{row['schedule']}(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"
    pipe = Pipeline(model.stages, loss=model.loss, schedule=schedule, backend=backend)
    try:
        state: Any = model.init_stages(key)
        optimizer = optax.adam(3e-3)
        opt_state = None
        # Two unmeasured steps: the first compiles, the second settles caches.
        losses = []
        for _ in range(2):
            state, opt_state, loss = pipe.train_step(state, opt_state, batch, optimizer=optimizer)
            losses.append(float(loss))
        # Medians over a few recorded training steps: one step of few microbatches is
        # noisy. What a step spends outside its timeline (dispatching the step, summing
        # shared gradients, the optimizer update) is calibrated alongside.
        recorded, outside = [], []
        for _ in range(_RECORDED_STEPS):
            start = time.perf_counter()
            result = pipe.step(state, batch, optimizer=optimizer, opt_state=opt_state, record=True)
            state, opt_state = result.params, result.opt_state
            losses.append(float(result.loss))
            _wait(state, backend)
            wall = time.perf_counter() - start
            assert result.timeline is not None  # asked for with record=True
            recorded.append(result.timeline)
            outside.append(max(wall - result.timeline.makespan, 0.0))
        fit = fit_costs(recorded, num_stages=schedule.num_stages)
        # On Ray a send costs its sender the serialisation and the actor call (measured
        # as the transfer), so sends are modelled as blocking there.
        simulated = simulate(schedule, fit.cost_model().with_changes(overlap_sends=backend == "local"))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, opt_state, loss = pipe.train_step(state, opt_state, batch, optimizer=optimizer)
            losses.append(float(loss))
            _wait(state, backend)
            times.append(time.perf_counter() - start)
    finally:
        pipe.close()
    report = RunReport(
        label=label,
        predicted_s=simulated.makespan + statistics.median(outside),
        measured_s=statistics.median(times),
        losses=tuple(losses),
        panels=(
            Panel(simulated.timeline, title=f"{label} simulated (calibrated)"),
            Panel(recorded[-1], title=f"{label} measured (recorded step)"),
        ),
    )
    console.print(
        f"  {label}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; predicted {report.predicted_s * 1e3:.1f} ms, "
        f"measured {report.measured_s * 1e3:.1f} ms per step ({report.error:+.1%})"
    )
    return report


def _runs(console: Console, frame: Any, *, devices: int, top: int, steps: int, backend: str, out: Path) -> list[RunReport]:
    rows = _runnable(frame, devices, top)
    console.rule(f"[bold]3. Running the best {len(rows)} pipeline schedules for real ({backend} backend)")
    if not rows:
        raise PipedslError("no pipeline plan over every device fits; nothing to run")
    for row in rows:
        console.print(f"plan {describe(row)}", highlight=False)
    if backend == "ray":
        from pipedsl.executor.ray_cluster import RayConfig, RayDevices

        # One group of actors serves every run: Ray starts once, each run ships its model.
        with RayDevices.start(devices, RayConfig()) as group:
            where = sorted({node.ip for node in group.nodes})
            console.print(f"Ray: {devices} actors on {', '.join(where)}", highlight=False)
            reports = [_run_one(row, backend=group, steps=steps, console=console) for row in rows]
    else:
        reports = [_run_one(row, backend=backend, steps=steps, console=console) for row in rows]
    table = Table(title="Predicted (simulator, calibrated on this machine) against measured step time", title_justify="left")
    for column in ("schedule", "predicted (ms)", "measured (ms)", "error", "first loss", "last loss"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    lines = ["schedule,predicted_s,measured_s,error,first_loss,last_loss"]
    for r in reports:
        table.add_row(
            r.label,
            f"{r.predicted_s * 1e3:.1f}",
            f"{r.measured_s * 1e3:.1f}",
            f"{r.error:+.1%}",
            f"{r.losses[0]:.4f}",
            f"{r.losses[-1]:.4f}",
        )
        lines.append(f"\"{r.label}\",{r.predicted_s},{r.measured_s},{r.error},{r.losses[0]},{r.losses[-1]}")
    console.print(table)
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
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
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
    from pipedsl.cli import add_command

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
