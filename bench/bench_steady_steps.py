"""Two training steps against one on this machine's CPU devices, beside the simulator's
``--steps 2`` prediction.

For each schedule (ZB-H1, and ZB-V, whose drain leaves device 0 free early), on a GELU MLP
of ``--layers`` layers ``--width`` wide per stage: the median of one ``train_step`` (Adam)
waited for, and of two in a row waited for once (the second step dispatched while the
first one's update may still run), timed in turns. The simulator's costs per action come
from recorded steps (medians, :func:`pipedsl.simulator.calibration.timelines.fit_costs`);
its optimizer update per stage is what one measured step takes beyond the simulated
step, spread evenly over the stages. The prediction for two steps is then
``simulate(..., steps=2)`` with each device's update after its own last compute and no
barrier (the executor's update reads only its own stages' gradients), and the figure
that matters is measured / predicted for the two steps.

    python bench/bench_steady_steps.py [--pp 2] [--microbatches 8] [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from timing import interleaved_medians, record


def _configure(devices: int) -> None:
    flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}"]
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f)


def _measure(
    name: str, pp: int, microbatches: int, width: int, layers: int, rows: int, repeat: int
) -> dict[str, float]:
    import jax
    import optax

    from pipedsl.executor import Pipeline
    from pipedsl.executor.models import mlp
    from pipedsl.library import library_path, load
    from pipedsl.simulator import simulate
    from pipedsl.simulator.calibration.timelines import fit_costs

    schedule = load(library_path(name), pp=pp, microbatches=microbatches)
    model = mlp(num_stages=schedule.num_stages, width=width, layers_per_stage=layers)
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    batch = model.batch(key, microbatches * rows)
    pipe = Pipeline(model.stages, loss=model.loss, schedule=schedule)
    optimizer = optax.adam(1e-4)
    state: dict[str, Any] = {"params": params, "opt": None}

    def steps(count: int) -> None:
        for _ in range(count):
            state["params"], state["opt"], _ = pipe.train_step(
                state["params"], state["opt"], batch, optimizer=optimizer
            )
        pipe.block_until_ready()

    timelines: list[Any] = []

    def recorded() -> None:
        timelines.append(pipe.step(state["params"], batch, record=True).timeline)

    medians = interleaved_medians({1: lambda: steps(1), 2: lambda: steps(2), "record": recorded}, repeat)
    fitted = fit_costs(timelines, num_stages=schedule.num_stages).cost_model()
    one_step = simulate(schedule, fitted).makespan
    update = max(medians[1] - one_step, 0.0) / schedule.num_stages * pp
    predicted = simulate(schedule, fitted.with_changes(update=update), steps=2)
    barrier = simulate(schedule, fitted.with_changes(update=update, update_barrier=True), steps=2)
    figures = {
        "one_step_ms": medians[1] * 1e3,
        "two_steps_ms": medians[2] * 1e3,
        "predicted_two_ms": predicted.steps_s[1] * 1e3,
        "barrier_two_ms": barrier.steps_s[1] * 1e3,
        "update_ms": update * 1e3,
        "measured_over_predicted": medians[2] / predicted.steps_s[1],
    }
    print(
        f"   {name:<6} one {figures['one_step_ms']:8.1f}ms  two {figures['two_steps_ms']:8.1f}ms "
        f"({medians[2] / medians[1]:.3f}x)  predicted two {figures['predicted_two_ms']:8.1f}ms "
        f"(barrier {figures['barrier_two_ms']:.1f}ms)  measured/predicted {figures['measured_over_predicted']:.3f}"
    )
    sys.stdout.flush()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2, help="pipeline devices (default 2)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    parser.add_argument("--layers", type=int, default=2, help="layers per stage (default 2)")
    parser.add_argument("--microbatch", type=int, default=64, help="rows per microbatch (default 64)")
    parser.add_argument("--repeat", type=int, default=15, help="timed rounds (default 15)")
    args = parser.parse_args()
    _configure(args.pp)
    import jax

    print(
        f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} cores"
    )
    print(
        f"pp={args.pp}, {args.microbatches} microbatches of {args.microbatch} rows, {args.layers} x {args.width} per stage"
    )
    figures: dict[str, Any] = {"pp": args.pp, "microbatches": args.microbatches}
    for name in ("zb_h1", "zbv"):
        found = _measure(name, args.pp, args.microbatches, args.width, args.layers, args.microbatch, args.repeat)
        figures.update({f"{name}_{key}": round(value, 4) for key, value in found.items()})
    record("bench_steady_steps", figures)


if __name__ == "__main__":
    main()
