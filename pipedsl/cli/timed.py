"""Timing the executor's training steps on this machine's devices.

What the machine calibration (:mod:`pipedsl.cli.machine`) times, before the search and
again in turns with the demo's runs: a call's median wall seconds, its result blocked on,
after one warm-up call; several calls *in turns* (a round of each, then the next round),
so that a change in the machine's load while they are measured slows them all alike and
their ratios hold; and the executor's own training step of a model on every device
(:func:`training_step`, built and compiled once in :class:`TimedSteps`), since the stage
programs a run executes are what a prediction must price."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipedsl.cli.common import load_schedule
from pipedsl.cli.interrupts import take_interrupt
from pipedsl.cli.planned import SPMD_SCHEDULE
from pipedsl.run_options import Fuse, Precision, RunOptions

__all__ = ["STEP_ROUNDS", "Step", "TimedSteps", "median_seconds", "interleaved_medians", "round_times", "training_step"]

STEP_ROUNDS = 11
"""Timed rounds of a training step whose median is taken: the calibration's steps, and by
default each run the demo measures against its prediction. On the shared 2-core machine
a step of four layers x four sequences per device varies 147-234 ms from one round to
the next; its median of 5 rounds ranged 153-272 ms over eight calibrations, of 11 rounds
156-194 ms over four, and that step sets the compute rate every plan is priced at. (More
rounds do not remove the machine's slower changes of speed, over minutes: hence the demo
times the calibration's steps again in turns with its runs.)"""


def median_seconds(run: Callable[[], Any], *, repeats: int) -> float:
    """Median wall seconds of ``run()`` over ``repeats`` calls (its result blocked on),
    after one warm-up call."""
    return interleaved_medians({0: run}, repeats=repeats)[0]


def interleaved_medians(runs: dict[Any, Callable[[], Any]], *, repeats: int) -> dict[Any, float]:
    """Median wall seconds of each of ``runs`` over ``repeats`` rounds (results blocked
    on), after one warm-up call each, taking turns, so that a change in the machine's load
    while they are measured slows them all alike and their ratios hold."""
    import jax

    for run in runs.values():
        jax.block_until_ready(run())
        take_interrupt()
    rounds = _Rounds(runs)
    for _ in range(repeats):
        rounds.timed_round()
    return rounds.take()


class _Rounds:
    """``runs`` timed in rounds, a call of each in turn (results blocked on), their wall
    times kept until taken as medians."""

    def __init__(self, runs: dict[Any, Callable[[], Any]]) -> None:
        self._runs = runs
        self._times: dict[Any, list[float]] = {key: [] for key in runs}

    def timed_round(self) -> None:
        import jax

        for key, run in self._runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            self._times[key].append(time.perf_counter() - start)
            take_interrupt()

    def take(self) -> dict[Any, float]:
        return {key: statistics.median(times) for key, times in self.take_rounds().items()}

    def take_rounds(self) -> dict[Any, list[float]]:
        if not all(self._times.values()):
            raise ValueError("no round of the steps has been timed since they were last taken")
        taken, self._times = self._times, {key: [] for key in self._runs}
        return taken


def round_times(times: list[float]) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of one step's wall seconds over rounds:
    the spread of a step from round to round (one round: its time, thrice)."""
    if len(times) < 2:
        return times[0], times[0], times[0]
    low, _, high = statistics.quantiles(times, n=4, method="inclusive")
    return statistics.median(times), low, high


@dataclass(frozen=True, slots=True)
class Step:
    """A training step that :class:`TimedSteps` times (see :func:`training_step`).

    Attributes:
      model: the executor model, of one stage (the SPMD plan).
      sequences: sequences per device in each microbatch.
      microbatches: microbatches per device.
      devices: the devices it runs on (the first so many; None: every device of the
        :class:`TimedSteps`), the rest idle.
      tp: tensor-parallel degree (with sequence parallelism) inside data-parallel groups
        of ``tp`` devices, each group's microbatch ``tp × sequences`` sequences.
      precision: the executor's ``"fp32"`` or ``"bf16"`` (mixed precision).
      fuse: ``"loop"`` (one program, as the executor runs one pipeline device) or
        ``"off"`` (each action dispatched apart, as pipeline devices of their own run).
    """

    model: Any
    sequences: int
    microbatches: int = 1
    devices: int | None = None
    tp: int = 1
    precision: Precision = "fp32"
    fuse: Fuse = "loop"


def training_step(
    model: Any,
    devices: int,
    sequences: int,
    *,
    microbatches: int = 1,
    tp: int = 1,
    precision: Precision = "fp32",
    fuse: Fuse = "loop",
) -> tuple[Callable[[], Any], Any]:
    """The executor's SPMD plan of ``model`` (one stage) over the first ``devices``
    devices on the local backend, ``tp``-way tensor parallel (with sequence parallelism)
    inside ``devices / tp`` data-parallel groups, ``microbatches`` of ``sequences``
    sequences per device, in ``precision``, as ``fuse`` says (:data:`~pipedsl.run_options.Fuse`):
    (a call that runs one Adam training step and returns the new parameters, the pipeline
    to close). The calibration times the executor's own programs: a forward and a
    backward dispatched apart run at another speed than one program of both."""
    import jax
    import optax

    from pipedsl.executor import Pipeline

    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    schedule = load_schedule(SPMD_SCHEDULE, {"pp": 1, "microbatches": microbatches})
    pipe = Pipeline(
        model.stages, loss=model.loss, schedule=schedule, backend="local",
        options=RunOptions(dp=devices // tp, tp=tp, sequence_parallel=tp > 1, precision=precision, fuse=fuse),
        param_specs=model.param_specs(params) if tp > 1 else None,
    )  # fmt: skip
    batch = model.batch(jax.random.fold_in(key, 1), devices * sequences * microbatches)
    optimizer = optax.adam(1e-3)
    held: list[Any] = [params, None]

    def step() -> Any:
        held[0], held[1], _ = pipe.train_step(held[0], held[1], batch, optimizer=optimizer)
        pipe.block_until_ready()  # the step returns once it is queued; its time runs to its update's end
        return held[0]

    return step, pipe


class TimedSteps:
    """:func:`training_step` s over ``devices`` devices (or a step's own, the rest idle),
    built and compiled once and then timed in rounds (:meth:`timed_round`, a step of each
    in turn), so that the same steps can be timed again later without compiling them
    again: the calibration times them, and the demo times them again in turns with its
    runs. ``steps`` maps a key to the :class:`Step` timed under it. Close it (or use it
    as a context manager) to release the pipelines.
    """

    def __init__(self, steps: dict[Any, Step], devices: int) -> None:
        import jax

        self.devices = devices
        runs: dict[Any, Callable[[], Any]] = {}
        self._pipes: list[Any] = []
        try:
            for key, step in steps.items():
                runs[key], pipe = training_step(
                    step.model, step.devices or devices, step.sequences, microbatches=step.microbatches, tp=step.tp,
                    precision=step.precision, fuse=step.fuse,
                )  # fmt: skip
                self._pipes.append(pipe)
                jax.block_until_ready(runs[key]())  # compiles it, outside the timed rounds
                take_interrupt()
        except BaseException:
            self.close()
            raise
        self._rounds = _Rounds(runs)

    def timed_round(self) -> None:
        """One training step of each, in turn, their wall times kept."""
        self._rounds.timed_round()

    def take(self) -> dict[Any, float]:
        """The median seconds of each step over the rounds timed since the last take (at
        least one), which are then forgotten."""
        return self._rounds.take()

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.close()
        self._pipes.clear()

    def __enter__(self) -> TimedSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
