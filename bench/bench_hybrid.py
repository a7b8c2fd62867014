"""Hybrid and SPMD plans of the demo transformer on eight CPU devices, on one executor.

1. Predicted against measured: this machine is calibrated once (``pipedsl.cli.machine``),
   the demo transformer's plans are searched on it, and the best SPMD plan, the best
   hybrid plan (data or tensor parallel stage meshes in a pipeline) and the best SPMD
   plan at each other tensor axis that it splits into are run for real: the predicted
   step time against the median measured training step (Adam; timed in turn so that
   load drifts hit them all alike), and how many pairs of plans it orders as measured.
   As in the demo, the calibration's steps are timed again in turn with the plans and
   fitted again, and each plan is priced at that machine ("predicted") and as the
   search priced it ("searched").
2. Overhead: the executor's ``dp=8`` SPMD step (``value_and_grad``, ``pp = 1``: one stage
   over the whole mesh, gradient accumulation over the microbatches) against one
   ``jax.jit`` of the same step (the microbatch loop of ``value_and_grad`` in one
   program, batch sharded over eight devices): target within 1.3x. ``dp=4 tp=2``,
   ``dp=8 zero=3`` and a ``pp=2`` hybrid with ``dp=2 x tp=2`` meshes are timed beside it.

The model is the demo's transformer (4 layers, hidden 128, 4 heads, sequence 64, vocab
512; ``executor/models.py``) with its Megatron specs.

    python bench/bench_hybrid.py [--batch 64] [--microbatches 4] [--repeat 5] [--skip-plans]
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Any

from timing import interleaved_medians, record

DEVICES = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-plans", action="store_true", help="only the overhead part (2)")
    args = parser.parse_args()
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    if not args.skip_plans:
        predicted_against_measured(args.repeat)
    overhead(args)


def _train(plan: Any) -> Any:
    """A function that runs one training step of ``plan`` (a ranked plan) and returns its
    new state, carrying the state from call to call."""
    import jax
    import optax

    from pipedsl.cli.workload import DEMO, DEMO_MODEL
    from pipedsl.executor import Pipeline

    schedule = plan.schedule_of()
    model = DEMO.build(schedule.num_stages)
    key = jax.random.PRNGKey(0)
    batch = model.batch(jax.random.fold_in(key, 1), plan.global_batch)
    params = model.init_stages(key)
    specs = model.param_specs(params) if plan.tp > 1 else None
    pipe = Pipeline(
        model.stages, loss=model.loss, schedule=schedule, options=plan.run_options(DEMO_MODEL), param_specs=specs
    )
    optimizer = optax.adam(3e-3)
    state: list[Any] = [params, None]

    def step() -> Any:
        state[0], state[1], _ = pipe.train_step(state[0], state[1], batch, optimizer=optimizer)
        return state[0]

    return step


def predicted_against_measured(repeat: int) -> None:
    """Part 1 of the module docstring."""
    from pipedsl.cli.demo import (
        calibrated_search,
        demo_calibration_steps,
        pairs_agreeing,
        plans_to_run,
        repriced,
        runnable_plans,
    )
    from pipedsl.cli.machine import recalibrated
    from pipedsl.cli.workload import DEMO_MODEL

    with demo_calibration_steps(DEVICES) as steps:
        calibration, frame = calibrated_search(steps)
        print(f"this machine: {calibration.describe()}")
        chosen = [p for p in plans_to_run(frame, DEVICES, top=2) if p.kind in ("spmd", "hybrid")]
        for plan in runnable_plans(frame, DEVICES):
            if plan.kind == "spmd" and all(plan.tp != p.tp for p in chosen if p.kind == "spmd"):
                chosen.append(plan)
        plans = {f"{p.kind} {p.label()}": p for p in chosen}
        runs = {name: _train(plan) for name, plan in plans.items()}
        times = interleaved_medians(runs | {"calibration": steps.timed_round}, repeat)
        during = recalibrated(calibration, DEMO_MODEL, steps.take())
    print(f"this machine during the runs: {during.describe()}")
    print(f"best SPMD and hybrid plans, and the best SPMD plan at each tensor axis, of {len(frame)} ranked")
    print(f"(medians of {repeat} training steps)")
    predicted = repriced(list(plans.values()), during.cluster)
    for (name, plan), price in zip(plans.items(), predicted, strict=True):
        assert plan.planned_s is not None  # every searched plan has its step time
        measured = times[name]
        print(
            f"   {name:<52} predicted {price * 1e3:8.1f} ms, measured {measured * 1e3:8.1f} ms "
            f"({price / measured - 1.0:+.1%}; searched {plan.planned_s * 1e3:.1f} ms, {plan.planned_s / measured - 1.0:+.1%})"
        )
    measured = [times[name] for name in plans]
    untied = [0.0] * len(measured)  # medians alone: every pair is ordered
    same, pairs = pairs_agreeing(predicted, measured, untied)
    searched, _ = pairs_agreeing([p.planned_s or 0.0 for p in plans.values()], measured, untied)
    print(f"   {same} of {pairs} pairs of plans ordered as measured (the search's prices: {searched})")
    errors = [
        f"{name} {price / times[name] - 1.0:+.1%} (searched {(plan.planned_s or 0.0) / times[name] - 1.0:+.1%})"
        for (name, plan), price in zip(plans.items(), predicted, strict=True)
    ]
    record("bench_hybrid_plans", {"plans": "; ".join(errors), "pairs_in_order": f"{same} of {pairs}",
                                  "searched_pairs_in_order": f"{searched} of {pairs}"})  # fmt: skip


def overhead(args: argparse.Namespace) -> None:
    """Part 2 of the module docstring."""

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pipedsl.executor import Pipeline, RunOptions
    from pipedsl.executor.models import transformer
    from pipedsl.library import library_path, load

    m = args.microbatches
    one = transformer(num_stages=1, vocab=512, dim=128, heads=4, seq=64, layers_per_stage=4)
    two = transformer(num_stages=2, vocab=512, dim=128, heads=4, seq=64, layers_per_stage=2)
    key = jax.random.PRNGKey(0)
    batch = one.batch(jax.random.fold_in(key, 1), args.batch)
    p1, p2 = one.init_stages(key), two.init_stages(key)
    gpipe = load(library_path("gpipe"), pp=1, microbatches=m)
    one_f = load(library_path("1f1b"), pp=2, microbatches=m)

    def plan(model: Any, schedule: Any, params: Any, **mesh: int) -> Pipeline:
        return Pipeline(
            model.stages, loss=model.loss, schedule=schedule, options=RunOptions(**mesh),
            param_specs=model.param_specs(params),
        )  # fmt: skip

    plans = {
        "spmd dp=8": (plan(one, gpipe, p1, dp=8), p1),
        "spmd dp=4 tp=2": (plan(one, gpipe, p1, dp=4, tp=2), p1),
        "spmd dp=8 zero=3": (plan(one, gpipe, p1, dp=8, zero=3), p1),
        "hybrid 1f1b pp=2 dp=2 tp=2": (plan(two, one_f, p2, dp=2, tp=2), p2),
    }
    fns = {name: partial(pipe.value_and_grad, params, batch) for name, (pipe, params) in plans.items()}

    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
    split = NamedSharding(mesh, PartitionSpec(None, "data"))
    stage = one.stages[0]

    @partial(jax.jit, out_shardings=NamedSharding(mesh, PartitionSpec()))
    def spmd_step(params: Any, xs: jax.Array, ts: jax.Array) -> tuple[jax.Array, Any]:
        def loss(p: Any) -> jax.Array:
            total = 0.0
            for i in range(m):
                total = total + one.loss(stage(p[0], xs[i]), ts[i]) / m
            return total

        return jax.value_and_grad(loss)(params)

    per = args.batch // m
    xs = jax.device_put(np.asarray(batch[0]).reshape(m, per, -1), split)
    ts = jax.device_put(np.asarray(batch[1]).reshape(m, per, -1), split)
    replicated = jax.device_put(p1, NamedSharding(mesh, PartitionSpec()))
    fns["one jax.jit, dp=8"] = partial(spmd_step, replicated, xs, ts)

    times = interleaved_medians(fns, args.repeat)
    print(f"demo transformer on {DEVICES} CPU devices, batch {args.batch}, {m} microbatches (medians of {args.repeat})")
    for name, t in times.items():
        print(f"   {name:<28} {t * 1e3:8.1f} ms")
    ratio = times["spmd dp=8"] / times["one jax.jit, dp=8"]
    print(f"   executor dp=8 / one jax.jit dp=8: {ratio:.2f}x (target <= 1.3x)")
    record(
        "bench_hybrid_overhead", {**{f"{name}_ms": t * 1e3 for name, t in times.items()}, "executor_over_jit": ratio}
    )


if __name__ == "__main__":
    main()
