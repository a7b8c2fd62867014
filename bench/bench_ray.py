"""Measure the Ray backend against the local backend on this machine's CPU.

Two measurements, each printed as a small table:

1. runtime overhead: 1F1B on a one-layer 4-wide MLP with one-row microbatches (compute
   negligible) at 4, 16 and 64 microbatches, on both backends; a least-squares line
   through the step times gives a fixed cost per step and a cost per action (on Ray
   a step is one call per actor; an action's values move between the actors' JAX
   transfer servers, see :mod:`pipedsl.executor.ray_links`);
2. step times on the benchmark model (GPipe, 1F1B, ZB-H1; ``--width``-wide GELU layers,
   ``--layers`` per stage, ``--microbatch``-row microbatches): the median step on both
   backends, the step the simulator predicts from the per-action and transfer times
   measured on recorded Ray steps (:func:`pipedsl.simulator.calibration.timelines.fit_costs`), and
   the makespan and bubble of the median recorded Ray step (a recorded step sends every
   value as an actor call, to time it to its arrival).

Ray runs on a local instance started here (all on 127.0.0.1), or on ``--address``; its
actors use one CPU each.

    python bench/bench_ray.py [--pp 2] [--microbatches 8] [--repeat 10] [--only overhead]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from timing import interleaved_medians, medians_with_recordings, record


def bench_overhead(devices: Any, repeat: int) -> None:
    import jax
    import numpy as np

    from pipedsl.executor import Pipeline
    from pipedsl.executor.models import mlp
    from pipedsl.library import library_path, load

    model = mlp(num_stages=2, width=4, layers_per_stage=1)
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    counts: list[int] = []
    steps: dict[str, Callable[[], Any]] = {}
    pipes = []
    for microbatches in (4, 16, 64):
        schedule = load(library_path("1f1b"), pp=2, microbatches=microbatches)
        batch = model.batch(key, microbatches)
        counts.append(schedule.num_actions)
        for backend in ("local", "ray"):
            pipe = Pipeline(model.stages, loss=model.loss, schedule=schedule, backend=devices if backend == "ray" else "local")
            pipes.append(pipe)
            steps[f"{backend} {microbatches}"] = partial(pipe.value_and_grad, params, batch)
    times = interleaved_medians(steps, repeat)
    for pipe in pipes:
        pipe.close()
    print("\n1. runtime overhead: 1F1B pp=2, one-row microbatches of a 4-wide one-layer MLP (compute negligible)")
    print(f"   {'actions':>7} {'local':>10} {'ray':>10}")
    for c, m in zip(counts, (4, 16, 64), strict=True):
        print(f"   {c:7d} {times[f'local {m}'] * 1e3:8.2f}ms {times[f'ray {m}'] * 1e3:8.2f}ms")
    figures: dict[str, float] = {}
    for backend in ("local", "ray"):
        per_action, fixed = np.polyfit(counts, [times[f"{backend} {m}"] for m in (4, 16, 64)], 1)
        print(f"   {backend:<5} fit: {fixed * 1e3:6.2f} ms per step + {per_action * 1e6:5.0f} us per action")
        figures |= {f"{backend}_per_step_ms": fixed * 1e3, f"{backend}_per_action_us": per_action * 1e6}
    record("bench_ray_overhead", figures)


def bench_schedules(devices: Any, pp: int, microbatches: int, width: int, layers: int, microbatch: int, repeat: int) -> None:
    import jax

    from pipedsl.executor import Pipeline
    from pipedsl.executor.models import mlp
    from pipedsl.library import library_path, load
    from pipedsl.simulator import simulate
    from pipedsl.simulator.calibration.timelines import fit_costs

    model = mlp(num_stages=pp, width=width, layers_per_stage=layers)
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    batch = model.batch(key, microbatches * microbatch)
    print(
        f"\n2. step times: pp={pp}, {microbatches} microbatches of {microbatch} rows, "
        f"{layers} GELU layers x {width} wide per stage"
    )
    print(
        f"   {'schedule':<8} {'local':>9} {'ray':>9} {'ray/local':>9} {'simulated':>10} {'sim/ray':>8} "
        f"{'recorded':>9} {'bubble':>7}"
    )
    names = ("gpipe", "1f1b", "zb_h1")
    schedules = {name: load(library_path(name), pp=pp, microbatches=microbatches) for name in names}
    local = {name: Pipeline(model.stages, loss=model.loss, schedule=s) for name, s in schedules.items()}
    ray = {name: Pipeline(model.stages, loss=model.loss, schedule=s, backend=devices) for name, s in schedules.items()}
    timed: dict[str, Callable[[], Any]] = {}
    for name in names:
        timed[f"local {name}"] = partial(local[name].value_and_grad, params, batch)
        timed[f"ray {name}"] = partial(ray[name].value_and_grad, params, batch)
    steps, recorded = medians_with_recordings(timed, ray, params, batch, repeat)
    for name in names:
        timelines = recorded[name]
        timeline = sorted(timelines, key=lambda tl: tl.makespan)[len(timelines) // 2]
        program = ray[name].program
        # A Ray send's copy, serialisation and actor call (the recorded transfer time)
        # take the sender's CPU beside its computation: model sends as blocking it.
        costs = fit_costs(timelines, num_stages=pp).cost_model().with_changes(overlap_sends=False)
        sim = simulate(program, costs)
        t_local, t_ray = steps[f"local {name}"], steps[f"ray {name}"]
        print(
            f"   {name:<8} {t_local * 1e3:7.1f}ms {t_ray * 1e3:7.1f}ms {t_ray / t_local:9.2f} "
            f"{sim.makespan * 1e3:8.1f}ms {sim.makespan / t_ray:8.2f} {timeline.makespan * 1e3:7.1f}ms "
            f"{timeline.bubble_ratio():7.1%}"
        )
    fit = fit_costs([tl for name in names for tl in recorded[name]], num_stages=pp)
    print(
        f"   measured on Ray (medians): F {fit.forward[0] * 1e3:.2f} ms, B {(fit.backward or (0.0,))[0] * 1e3:.2f} ms, "
        f"transfer {fit.transfer * 1e3:.2f} ms (stage 0)"
    )
    record("bench_ray_schedules", {f"{n}_{b}_ms": steps[f"{b} {n}"] * 1e3 for n in names for b in ("local", "ray")})
    for pipe in ray.values():
        pipe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2, help="pipeline devices for measurement 2 (default 2)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="layers per stage (default 4)")
    parser.add_argument("--microbatch", type=int, default=128, help="rows per microbatch (default 128)")
    parser.add_argument("--repeat", type=int, default=10, help="timed repetitions per measurement (default 10)")
    parser.add_argument("--address", help="a Ray cluster to use (default: a local instance started here)")
    parser.add_argument("--only", choices=("overhead", "schedules"), help="run one measurement")
    args = parser.parse_args()
    pp = max(args.pp, 2)
    flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={pp}"]
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f)

    import jax

    from pipedsl.executor.ray_cluster import RayConfig, RayDevices

    started = time.perf_counter()
    with RayDevices.start(pp, RayConfig(address=args.address)) as devices:
        print(
            f"jax {jax.__version__}, local backend: {len(jax.devices())} {jax.devices()[0].platform} devices; "
            f"ray: {pp} actors on {', '.join(sorted({str(n) for n in devices.nodes}))} "
            f"(started in {time.perf_counter() - started:.1f} s), {os.cpu_count()} cores"
        )
        sys.stdout.flush()
        if args.only in (None, "overhead"):
            bench_overhead(devices, args.repeat * 5)
        if args.only in (None, "schedules"):
            bench_schedules(devices, pp, args.microbatches, args.width, args.layers, args.microbatch, args.repeat)


if __name__ == "__main__":
    main()
