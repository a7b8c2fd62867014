"""Calibration on this machine: a cluster file for it, and schedules run against their fit.

``pipedsl calibrate`` measures the machine it runs on, CPU or GPU (:mod:`pipedsl.cli.machine`:
the executor's training steps of the demo transformer, memory, bandwidth, collectives,
dispatch, and on GPU the matrix products per dtype), fits a
:class:`~pipedsl.simulator.Cluster` to it (:mod:`pipedsl.simulator.calibration.machine`),
prints each parameter with the measurement behind it and how well the fit reproduces each
calibration step, and writes the cluster as TOML for ``pipedsl search --cluster``.

Given schedules, it also runs each for real on this machine's devices (the demo
transformer), as the demo's last part does (:func:`measure`):

1. two training steps compile the stages and settle caches;
2. a few *recorded* training steps give measured timelines, which
   :func:`pipedsl.simulator.fit_costs` turns into per-stage ``F``/``B``/``I``/``W`` times
   and a transfer time; what a step spends outside its timeline (dispatch, the
   optimizer update) is measured alongside;
3. the simulator predicts the step time from that fit;
4. plain training steps measure the step time, with the loss going down: every run's
   timed steps are taken in turns (a step of each, then the next round), so that a
   change in the machine's speed while they are timed reaches them all alike.

The fitted cost models can be saved as TOML for ``pipedsl simulate --costs``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipedsl import library
from pipedsl.cli.common import (
    add_command,
    add_param_option,
    load_schedule,
    make_console,
    milliseconds,
)
from pipedsl.cli.interrupts import take_interrupt
from pipedsl.cli.outputs import CLUSTER_TOML, COSTS_TOML, FORCE_HELP, check_output_file, check_output_folder
from pipedsl.cli.planned import PlannedRun
from pipedsl.cli.timed import STEP_ROUNDS, round_times
from pipedsl.cli.workload import DEMO, Workload, check_splits
from pipedsl.errors import PipedslError
from pipedsl.executor.devices import request_devices
from pipedsl.ir import Schedule
from pipedsl.run_options import RunOptions
from pipedsl.simulator import CostModel, Panel, fit_costs, simulate
from pipedsl.simulator.calibration.report import Report
from pipedsl.simulator.calibration.timelines import timeline_report
from pipedsl.timeline import Timeline
from pipedsl.validate import validate
from pipedsl.words import plural

__all__ = [
    "MACHINE_MICROBATCH", "Measurement", "Run", "measure", "backend_for", "results_table", "register",
]  # fmt: skip

MACHINE_MICROBATCH = 4
"""Sequences per device of the machine calibration's steps at the microbatch size: each
action costs tens of microseconds of dispatch on CPU, which microbatches of a few
sequences keep small against their work."""
_RECORDED_STEPS = 3
_DEFAULT_PARAMS = {"pp": 2, "microbatches": 8}


@dataclass(frozen=True, slots=True)
class Measurement:
    """One schedule run for real.

    Attributes:
      label: the schedule with its parameters.
      costs: the cost model fitted to its recorded steps (seconds per action per stage).
      predicted_s: the simulated step time under ``costs``, plus the time a step spends
        outside its timeline, in seconds; None where the timed steps of
        pipeline devices sharing their devices run as one program
        (:attr:`~pipedsl.executor.Pipeline.one_program`): the recorded steps that ``costs``
        is fitted to dispatch each action apart, which such a step does not, so their
        simulation is no prediction of it.
      measured_s: the median measured step time, in seconds.
      times: every timed step's seconds, in order (their spread: :attr:`quartiles`).
      losses: the loss of every step run, in order.
      panels: the simulated timeline and the last recorded one, for plotting.
      plan: the ranked plan run (degrees, ZeRO stage), or None for a plain schedule.
      report: the fit of ``costs`` to the recorded steps, each time with the actions
        behind it and each recorded step against its simulation.
    """

    label: str
    costs: CostModel
    predicted_s: float | None
    measured_s: float
    times: tuple[float, ...]
    losses: tuple[float, ...]
    panels: tuple[Panel, Panel]
    plan: PlannedRun | None = None
    report: Report | None = None

    @property
    def quartiles(self) -> tuple[float, float]:
        """(lower, upper) quartile of the timed steps' seconds: their spread from round to round."""
        _, low, high = round_times(list(self.times))
        return low, high

    @property
    def planned_s(self) -> float | None:
        """The plan search's uncalibrated estimate of the step time, when the run is a ranked plan."""
        return None if self.plan is None else self.plan.planned_s

    @property
    def error(self) -> float | None:
        """Predicted over measured, minus one (None without a prediction)."""
        return None if self.predicted_s is None else self.predicted_s / self.measured_s - 1.0

    def summary(self) -> str:
        """One line: the loss from first to last step, predicted and measured step time."""
        measured = f"measured {milliseconds(self.measured_s)} ms per step"
        if self.predicted_s is None:
            said = f"{measured}, run as one program (no prediction from its recorded steps, dispatched apart)"
        else:
            said = f"predicted {milliseconds(self.predicted_s)} ms, {measured} ({self.error:+.1%})"
        return f"{self.label}: loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}; {said}"


def _label(schedule: Schedule) -> str:
    params = ", ".join(f"{k}={v}" for k, v in schedule.params)
    return f"{schedule.name}({params})" if params else schedule.name


def _platform(backend: Any) -> str:
    """Where a run's steps ran: JAX's platform on the local backend, else Ray actors."""
    if backend != "local":
        return "ray"
    import jax

    return str(jax.devices()[0].platform)


def _pipeline(
    schedule: Schedule, microbatch_size: int, backend: Any, plan: PlannedRun | None, workload: Workload
) -> tuple[Any, Any, Any]:
    """(pipeline, initial parameters, batch) of ``workload`` under ``schedule``."""
    import jax

    from pipedsl.executor import Pipeline

    model = workload.build(schedule.num_stages, what=_label(schedule))
    options = RunOptions(precision=workload.precision) if plan is None else plan.run_options(workload.model)
    key = jax.random.PRNGKey(0)
    batch = model.batch(jax.random.fold_in(key, 1), microbatch_size * schedule.num_microbatches * options.dp)
    params = model.init_stages(key)
    specs = model.param_specs(params) if options.tp > 1 else None
    # Pipeline devices that share their devices are each the same first dp x tp of them.
    shared = plan is not None and plan.shared_devices
    devices = jax.devices()[: options.mesh_size] * schedule.num_devices if shared else None
    pipe = Pipeline(
        model.stages,
        loss=model.loss,
        schedule=schedule,
        options=options,
        backend=backend,
        param_specs=specs,
        devices=devices,
    )
    return pipe, params, batch


def _recorded_steps(
    pipe: Any, state: Any, opt_state: Any, batch: Any, *, optimizer: Any, losses: list[float]
) -> tuple[Any, Any, list[Timeline], list[float]]:
    """Run :data:`_RECORDED_STEPS` recorded training steps: (state, optimizer state, their
    timelines, the seconds each step spent outside its timeline); appends their losses."""
    # Medians over a few recorded steps: one step of few microbatches is noisy.
    recorded, outside = [], []
    for _ in range(_RECORDED_STEPS):
        start = time.perf_counter()
        result = pipe.step(state, batch, optimizer=optimizer, opt_state=opt_state, record=True)
        state, opt_state = result.params, result.opt_state
        losses.append(float(result.loss))
        wall = time.perf_counter() - start
        take_interrupt()
        assert result.timeline is not None  # asked for with record=True
        recorded.append(result.timeline)
        outside.append(max(wall - result.timeline.makespan, 0.0))
    return state, opt_state, recorded, outside


@dataclass(frozen=True, slots=True)
class Run:
    """What :func:`measure` runs: ``schedule`` of ``workload`` with microbatches of
    ``microbatch_size`` sequences (per data-parallel replica); with ``plan``, every pipeline
    device is a ``dp x tp`` mesh with the plan's ZeRO stage (all of them the same mesh
    where the plan's pipeline devices share their devices)."""

    schedule: Schedule
    microbatch_size: int
    plan: PlannedRun | None = None
    workload: Workload = DEMO


class _Trial:
    """One schedule on this machine's devices, compiled and calibrated when made (steps
    1-3 of the module docstring), then timed one plain training step at a time (step 4);
    :meth:`close` releases its pipeline."""

    def __init__(self, run: Run, *, backend: Any) -> None:
        import optax

        self.run, self.backend = run, backend
        self.pipe, self.state, self.batch = _pipeline(
            run.schedule, run.microbatch_size, backend, run.plan, run.workload
        )
        try:
            self.optimizer = optax.adam(3e-3)
            self.opt_state: Any = None
            self.losses: list[float] = []
            for _ in range(2):
                self._train()
            self.state, self.opt_state, self.recorded, outside = _recorded_steps(
                self.pipe, self.state, self.opt_state, self.batch, optimizer=self.optimizer,
                losses=self.losses,
            )  # fmt: skip
            # On Ray a send is a collective that holds the sender until its receiver takes
            # part (a rendezvous), so sends are modelled as blocking there.
            fit = fit_costs(self.recorded, num_stages=run.schedule.num_stages)
            self.costs = fit.cost_model().with_changes(overlap_sends=backend == "local")
            self.simulated = simulate(run.schedule, self.costs)
            self.report = timeline_report(fit, run.schedule, self.recorded, self.costs, platform=_platform(backend))
        except BaseException:
            self.pipe.close()
            raise
        self.outside_s = statistics.median(outside)
        self.times: list[float] = []

    def _train(self) -> None:
        self.state, self.opt_state, loss = self.pipe.train_step(
            self.state, self.opt_state, self.batch, optimizer=self.optimizer
        )
        self.losses.append(float(loss))
        self.pipe.block_until_ready()  # the update too: a step returns once it is queued
        take_interrupt()  # the loss read, the step is over

    def timed_step(self) -> None:
        """One plain training step, its wall time kept (seconds, updates included)."""
        start = time.perf_counter()
        self._train()
        self.times.append(time.perf_counter() - start)

    def result(self) -> Measurement:
        """The prediction against the median of the timed steps (at least one)."""
        plan = self.run.plan
        label = _label(self.run.schedule) if plan is None else plan.label()
        # A step run as one program is timed whole; its recorded steps dispatched each action apart.
        one_program = self.pipe.one_program
        apart = ", actions dispatched apart" if one_program else ""
        return Measurement(
            plan=plan,
            label=label,
            costs=self.costs,
            predicted_s=None if one_program else self.simulated.makespan + self.outside_s,
            measured_s=statistics.median(self.times),
            times=tuple(self.times),
            losses=tuple(self.losses),
            report=self.report,
            panels=(
                Panel(self.simulated.timeline, title=f"{label} simulated (calibrated{apart})"),
                Panel(self.recorded[-1], title=f"{label} recorded step{apart}"),
            ),
        )

    def close(self) -> None:
        self.pipe.close()


def measure(
    runs: Sequence[Run],
    *,
    backend: Any,
    steps: int,
    prepared: Callable[[int], None] | None = None,
    each_round: Callable[[], None] | None = None,
) -> list[Measurement]:
    """Calibrate on each run and compare prediction with measurement (module docstring).

    Every run is compiled and calibrated first, one after another (``prepared(i)`` is
    called once run i is); then their ``steps`` timed steps are taken in turns, a step of
    each run and then the next round, so that a change in the machine's speed while they
    are timed reaches every run alike rather than the runs timed during it.
    ``each_round()``, when given, is called after every round, in turn with the runs
    (the demo times the machine calibration's steps there). ``backend`` is ``"local"``, ``"ray"`` or a
    :class:`~pipedsl.executor.ray.cluster.RayConfig`.
    """
    trials: list[_Trial] = []
    try:
        for i, run in enumerate(runs):
            trials.append(_Trial(run, backend=backend))
            if prepared is not None:
                prepared(i)
        for _ in range(steps):
            for trial in trials:
                trial.timed_step()
            if each_round is not None:
                each_round()
        return [trial.result() for trial in trials]
    finally:
        for trial in trials:
            trial.close()


@contextlib.contextmanager
def backend_for(name: str, devices: int, console: Console) -> Iterator[Any]:
    """What to pass as ``backend``: ``"local"``, or for ``"ray"`` a Ray connection held for
    every run (Ray starts once; each run starts its own world of processes), released on exit."""
    if name != "ray":
        yield name
        return
    from pipedsl.executor.ray.cluster import RayConfig, connect, disconnect

    config = RayConfig()
    connect(config.address, timeout=config.start_timeout)
    try:
        console.print(f"Ray: one world of processes per run, {devices} pipeline devices each", highlight=False)
        yield config
    finally:
        disconnect()


def results_table(measurements: Sequence[Measurement]) -> Table:
    """Predicted against measured step time, one row per schedule."""
    table = Table(
        title="Predicted (simulator, calibrated on this machine) against measured step time", title_justify="left"
    )
    for column in ("schedule", "predicted (ms)", "measured (ms)", "error", "first loss", "last loss"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for m in measurements:
        table.add_row(
            m.label,
            milliseconds(m.predicted_s),
            milliseconds(m.measured_s),
            "-" if m.error is None else f"{m.error:+.1%}",
            f"{m.losses[0]:.4f}",
            f"{m.losses[-1]:.4f}",
        )
    return table


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.microbatch_size < 1 or args.devices < 1:
        raise PipedslError("--steps, --microbatch-size and --devices must be at least 1")
    check_output_file(
        args.out, option="--out", writes=CLUSTER_TOML, reads=args.files, force=args.force, makes_folder=True
    )
    schedules = []
    for spec in args.files:
        # Two devices and eight microbatches unless told otherwise: this machine's size.
        declared = _parameters(spec)
        chosen = {k: v for k, v in _DEFAULT_PARAMS.items() if k in declared} | args.params
        schedule = load_schedule(spec, chosen, max_actions=args.max_actions)
        validate(schedule)
        check_splits(schedule.num_stages, what=_label(schedule))
        schedules.append(schedule)
    if args.save_costs is not None:
        check_output_folder(
            args.save_costs,
            option="--save-costs",
            files=[(f"{schedule.name}.toml", COSTS_TOML) for schedule in schedules],
            force=args.force,
        )
    request_devices(max([args.devices, *(s.num_devices for s in schedules)]))
    console = make_console()
    _machine(console, args)
    if not schedules:
        return 0
    if args.save_costs is not None:
        Path(args.save_costs).mkdir(parents=True, exist_ok=True)
    runs = [Run(schedule, args.microbatch_size) for schedule in schedules]

    def prepared(i: int) -> None:
        console.print(f"  {_label(schedules[i])}: compiled and calibrated", highlight=False)

    with backend_for(args.backend, max(s.num_devices for s in schedules), console) as backend:
        measurements = measure(runs, backend=backend, steps=args.steps, prepared=prepared)
    for schedule, m in zip(schedules, measurements, strict=True):
        console.print(f"  {m.summary()}", highlight=False)
        if m.report is not None:
            console.print("\n".join(f"    {line}" for line in m.report.lines()), highlight=False)
        if args.save_costs is not None:
            path = Path(args.save_costs) / f"{schedule.name}.toml"
            path.write_text(f"# fitted by pipedsl calibrate on {m.label}\n{m.costs.to_toml()}")
    console.print(results_table(measurements))
    if args.save_costs is not None:
        console.print(f"cost models written to {args.save_costs}/ (use with pipedsl simulate --costs)")
    return 0


def _machine(console: Console, args: argparse.Namespace) -> None:
    """Calibrate this machine's devices (at most ``--devices``) and write the cluster file."""
    import jax

    from pipedsl.cli.machine import calibrate_machine, calibration_steps, machine_workload, platform
    from pipedsl.simulator.calibration.machine import cluster_toml

    devices = min(args.devices, jax.device_count())
    kind, what = platform()
    workload = machine_workload(devices)
    console.print(
        f"Calibrating this machine: {plural(devices, kind + ' device')} ({what}), training {workload.model.name} in "
        f"{workload.precision} ...",
        highlight=False,
    )
    with calibration_steps(devices, workload, microbatch_size=args.microbatch_size) as steps:
        calibration = calibrate_machine(steps, workload.model, microbatch_size=args.microbatch_size, rounds=args.steps)
    console.print(calibration.describe(), highlight=False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(cluster_toml(calibration))
    console.print(f"cluster written to {args.out} (pipedsl search --cluster {args.out})", highlight=False)


def _parameters(spec: str) -> set[str]:
    """The parameter names a ``.sched`` file or library name declares (none for CSV or
    JSON, and none for a path that does not load: ``load_schedule`` then says why)."""
    try:
        return set(library.parameters(spec))
    except PipedslError:
        return set()


_DESCRIPTION = """\
Measure this machine (CPU or GPU, the platform JAX runs on) and write it as a cluster
file: the executor's training steps of the demo transformer at several shapes, memory,
memory bandwidth, all-reduces, dispatch, and on GPU matrix products per dtype. Prints
each parameter with the measurement behind it and how well the fitted model reproduces
each calibration step. Use the file with `pipedsl search --cluster FILE`.

Given schedules, also run each for real on this machine's devices (the demo transformer):
two steps compile the stages; a few recorded steps give measured timelines, from which
per-stage F, B, I and W times and a transfer time are fitted; the simulator predicts the
step time from that fit. Then plain training steps measure it, a step of each schedule
in turn, so that every schedule meets the same load. With --save-costs DIR, each fitted
cost model is written to DIR/NAME.toml, NAME being the schedule's name (its file stem),
for `pipedsl simulate --costs`."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``calibrate`` to ``pipedsl``'s subcommands."""
    cal = add_command(
        subparsers,
        "calibrate",
        _cmd_calibrate,
        summary="measure this machine into a cluster file; run schedules against their fitted cost model",
        description=_DESCRIPTION,
        examples=(
            "  pipedsl calibrate --out cluster.toml && pipedsl search --model demo-small --cluster cluster.toml\n"
            "  pipedsl calibrate 1f1b zb_h1 -p microbatches=16 --backend ray\n"
            "  pipedsl calibrate gpipe --save-costs costs/ && pipedsl simulate gpipe -p pp=2 --costs costs/gpipe.toml"
        ),
    )
    cal.add_argument("files", nargs="*", metavar="FILE", help="schedules to run against their fitted cost model")
    cal.add_argument(
        "--out", default="cluster.toml", help="where to write this machine's cluster (default cluster.toml)"
    )
    cal.add_argument("--devices", type=int, default=8, help="devices to calibrate (default 8; CPU devices are forced)")
    add_param_option(cal)
    cal.add_argument(
        "--microbatch-size", type=int, default=MACHINE_MICROBATCH,
        help=f"sequences per microbatch and per device (default {MACHINE_MICROBATCH})",
    )  # fmt: skip
    cal.add_argument(
        "--steps",
        type=int,
        default=STEP_ROUNDS,
        help=f"timed rounds of each calibration step, and measured training steps per schedule (default {STEP_ROUNDS})",
    )
    cal.add_argument("--backend", choices=("local", "ray"), default="local", help="executor backend (default local)")
    cal.add_argument("--save-costs", metavar="DIR", help="write each fitted cost model to DIR/NAME.toml")
    cal.add_argument("--force", action="store_true", help=FORCE_HELP)
