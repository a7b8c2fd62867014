"""Timing the executor's training steps on this machine's forced CPU devices.

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
from pipedsl.cli.planned import SPMD_SCHEDULE

__all__ = [
    "PIPELINE_STEP_SCHEDULE", "STEP_ROUNDS", "Step", "TimedSteps", "backward_halves", "median_seconds",
    "interleaved_medians", "training_step",
]  # fmt: skip

PIPELINE_STEP_SCHEDULE = "gpipe"
"""The schedule of the calibration's pipeline steps: every stage's forward, then the
backwards, of one microbatch."""

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

    def take(self) -> dict[Any, float]:
        if not all(self._times.values()):
            raise ValueError("no round of the steps has been timed since they were last taken")
        medians = {key: statistics.median(times) for key, times in self._times.items()}
        self._times = {key: [] for key in self._runs}
        return medians


@dataclass(frozen=True, slots=True)
class Step:
    """A training step that :class:`TimedSteps` times (see :func:`training_step`).

    Attributes:
      model: the executor model, its stages the pipeline's (one stage: the SPMD plan).
      sequences: sequences per data rank in each microbatch.
      tensor: the tensor axis of each stage's mesh.
      microbatches: microbatches per data rank.
    """

    model: Any
    sequences: int
    tensor: int = 1
    microbatches: int = 1


def _planned(
    model: Any, devices: int, microbatch_size: int, *, tensor: int = 1, microbatches: int = 1
) -> tuple[Any, Any, Any]:
    """The executor's plan of ``model`` (one stage: the SPMD plan's schedule; more:
    :data:`PIPELINE_STEP_SCHEDULE`) over every device at tp ``tensor`` (the data axis the
    rest of each stage's devices) on the local backend, its parameters and a batch of
    ``microbatches`` microbatches of ``microbatch_size`` sequences per data rank:
    (pipeline, parameters, batch)."""
    import jax

    from pipedsl.executor import Pipeline

    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    stages = model.num_stages
    dp = devices // (tensor * stages)
    name = SPMD_SCHEDULE if stages == 1 else PIPELINE_STEP_SCHEDULE
    schedule = load_schedule(name, {"pp": stages, "microbatches": microbatches})
    pipe = Pipeline(
        model.stages, loss=model.loss, schedule=schedule, backend="local", dp=dp, tp=tensor,
        param_specs=model.param_specs(params) if tensor > 1 else None,
    )  # fmt: skip
    return pipe, params, model.batch(jax.random.fold_in(key, 1), dp * microbatch_size * microbatches)


def training_step(
    model: Any, devices: int, microbatch_size: int, *, tensor: int = 1, microbatches: int = 1
) -> tuple[Callable[[], Any], Any]:
    """The executor's plan of ``model`` (its stages a :data:`PIPELINE_STEP_SCHEDULE`
    pipeline; one stage: the SPMD plan) over every device at tp ``tensor``, the data
    axis the rest of each stage's devices, ``microbatches`` of ``microbatch_size``
    sequences per data rank: (a call that runs one Adam training step and returns the new
    parameters, the pipeline to close). The calibration times the executor's own programs: a forward and a backward
    jitted apart run at another speed than one program of both."""
    import optax

    pipe, params, batch = _planned(model, devices, microbatch_size, tensor=tensor, microbatches=microbatches)
    optimizer = optax.adam(1e-3)
    held: list[Any] = [params, None]

    def step() -> Any:
        held[0], held[1], _ = pipe.train_step(held[0], held[1], batch, optimizer=optimizer)
        return held[0]

    return step, pipe


def backward_halves(model: Any, devices: int, microbatch_size: int) -> tuple[dict[str, Callable[[], Any]], Any]:
    """The last stage's backward of ``model`` (an executor model of two stages or more)
    as the executor's plan over ``devices`` devices compiles it (each stage's data axis
    ``devices / stages``, one microbatch of ``microbatch_size`` sequences per data rank),
    run on the residuals of one forward: (``{"fused": a call of B, "split": a call of I
    then W}``, each adding to an accumulator of its own, which it returns; the pipeline to
    close). What a zero-bubble schedule pays for running the backward as two programs."""
    import jax

    stages = model.num_stages
    pipe, params, (inputs, targets) = _planned(model, devices, microbatch_size)
    try:
        values = tuple(jax.tree_util.tree_leaves(inputs))
        for s, program in enumerate(pipe.compile(params, (inputs, targets))):
            last = s == stages - 1
            stage_params = tuple(map(jax.device_put, jax.tree_util.tree_leaves(params[s]), program.layout.params))
            given = _placed(jax.tree_util.tree_leaves(targets), program.layout) if last else ()
            values, residuals, _ = program.forward(
                stage_params, _placed(values, program.layout), given, program.zero_loss() if last else None
            )
    except BaseException:
        pipe.close()
        raise
    held = {"fused": program.zero_grads(), "split": program.zero_grads()}

    def fused() -> Any:
        _, held["fused"] = program.backward(residuals, (), held["fused"])
        return held["fused"]

    def split() -> Any:
        _, handoff = program.backward_input(residuals, ())
        held["split"] = program.backward_weight(handoff, held["split"])
        return held["split"]

    return {"fused": fused, "split": split}, pipe


def _placed(leaves: Any, layout: Any) -> tuple[Any, ...]:
    """``leaves`` on ``layout``'s mesh, split over its data axis."""
    import jax

    return tuple(jax.device_put(leaf, layout.batch(leaf.shape)) for leaf in leaves)


class TimedSteps:
    """:func:`training_step` s over ``devices`` devices, built and compiled once and then
    timed in rounds (:meth:`timed_round`, a step of each in turn), so that the same steps
    can be timed again later without compiling them again: the calibration times them,
    and the demo times them again in turns with its runs. ``steps`` maps a key to the
    :class:`Step` timed under it. ``backward`` (an executor model of two stages or more,
    sequences per data rank) adds its last stage's backward, fused and split
    (:func:`backward_halves`), timed apart by :meth:`backward_seconds`. Close it (or use
    it as a context manager) to release the pipelines.
    """

    def __init__(self, steps: dict[Any, Step], devices: int, *, backward: tuple[Any, int] | None = None) -> None:
        import jax

        self.devices = devices
        runs: dict[Any, Callable[[], Any]] = {}
        self._pipes: list[Any] = []
        self._halves: dict[str, Callable[[], Any]] = {}
        try:
            for key, step in steps.items():
                runs[key], pipe = training_step(
                    step.model, devices, step.sequences, tensor=step.tensor, microbatches=step.microbatches
                )
                self._pipes.append(pipe)
                jax.block_until_ready(runs[key]())  # compiles it, outside the timed rounds
            if backward is not None:
                model, sequences = backward
                self._halves, pipe = backward_halves(model, devices, sequences)
                self._pipes.append(pipe)
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

    def backward_seconds(self, *, repeats: int) -> tuple[float, float] | None:
        """Median seconds of the backward given at construction, fused and split (``I``
        then ``W``), over ``repeats`` rounds in turns; None where none was given."""
        if not self._halves:
            return None
        medians = interleaved_medians(self._halves, repeats=repeats)
        return medians["fused"], medians["split"]

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.close()
        self._pipes.clear()

    def __enter__(self) -> TimedSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
