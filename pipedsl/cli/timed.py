"""Timing the executor's training steps on this machine's forced CPU devices.

What the machine calibration (:mod:`pipedsl.cli.machine`) and its load check time: a
call's median wall seconds, its result blocked on, after one warm-up call; several calls
*in turns* (a round of each, then the next round), so that a change in the machine's load
while they are measured slows them all alike and their ratios hold; and the executor's
own training step of a model on every device (:func:`training_step`), since the stage
programs a run executes are what a prediction must price.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from pipedsl.cli.common import load_schedule
from pipedsl.cli.planned import SPMD_SCHEDULE

__all__ = ["STEP_ROUNDS", "median_seconds", "interleaved_medians", "training_step", "timed_steps"]

STEP_ROUNDS = 11
"""Timed rounds of a training step whose median is taken: the calibration's steps, and by
default each run the demo measures against its prediction. On the shared 2-core machine
a step of four layers x four sequences per device varies 147-234 ms from one round to
the next; its median of 5 rounds ranged 153-272 ms over eight calibrations, of 11 rounds
156-194 ms over four, and that step sets the compute rate every plan is priced at. (More
rounds do not remove the machine's slower changes of speed, over minutes: the load check
reports those.)"""


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
    times: dict[Any, list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(run())
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def training_step(
    model: Any, devices: int, microbatch_size: int, *, tensor: int = 1, microbatches: int = 1
) -> tuple[Callable[[], Any], Any]:
    """The executor's plan of ``model`` (its stages a ``gpipe`` pipeline; one stage: the
    SPMD plan) over every device at tp ``tensor``, the data axis the rest of each stage's
    devices, ``microbatches`` of ``microbatch_size`` sequences per data rank: (a call
    that runs one Adam training step and returns the new parameters, the pipeline to
    close). The calibration times the executor's own programs: a forward and a backward
    jitted apart run at another speed than one program of both."""
    import jax
    import optax

    from pipedsl.executor import Pipeline

    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    stages = model.num_stages
    dp = devices // (tensor * stages)
    schedule = load_schedule(SPMD_SCHEDULE, {"pp": stages, "microbatches": microbatches})
    pipe = Pipeline(
        model.stages, loss=model.loss, schedule=schedule, backend="local", dp=dp, tp=tensor,
        param_specs=model.param_specs(params) if tensor > 1 else None,
    )  # fmt: skip
    batch = model.batch(jax.random.fold_in(key, 1), dp * microbatch_size * microbatches)
    optimizer = optax.adam(1e-3)
    held: list[Any] = [params, None]

    def step() -> Any:
        held[0], held[1], _ = pipe.train_step(held[0], held[1], batch, optimizer=optimizer)
        return held[0]

    return step, pipe


def timed_steps(steps: dict[Any, tuple[Any, int, int, int]], devices: int) -> dict[Any, float]:
    """Median seconds of :func:`training_step` s over ``devices`` devices, by key, timed
    in turns for :data:`STEP_ROUNDS` rounds; each is (executor model, sequences per data
    rank, tensor axis, microbatches). Their pipelines are closed whatever happens."""
    runs: dict[Any, Callable[[], Any]] = {}
    pipes = []
    try:
        for key, (model, sequences, tensor, microbatches) in steps.items():
            runs[key], pipe = training_step(model, devices, sequences, tensor=tensor, microbatches=microbatches)
            pipes.append(pipe)
        return interleaved_medians(runs, repeats=STEP_ROUNDS)
    finally:
        for pipe in pipes:
            pipe.close()
