"""Measure the executor on this machine's CPU devices.

Seven measurements, each printed as a small table:

1. I/W split: (I + W) / B on a middle stage of 4 GELU layers 512 wide (docs/design.md's
   example), against the two separately jitted halves of one vjp that re-derive the
   cotangent chain;
2. interpreter overhead: a step of a tiny model, where compute is negligible, divided by
   its number of actions and of instructions;
3. step times of GPipe, 1F1B and ZB-H1 on the benchmark model, each beside the step the
   simulator predicts when given the per-action times measured on recorded steps (medians,
   :func:`pipedsl.simulator.calibration.timelines.fit_costs`), and the makespan and bubble of the
   median recorded step;
4. the pipelined step against one ``jax.jit`` of the same microbatch loop on one device;
5. the executor's own cost per action on both backends in one run: a step of compute-free
   stages (2 stages, 1F1B, 16 microbatches of one row of a 4-wide one-layer MLP) over its
   F and B actions, fixed per-step costs included; the local backend on two CPU devices of
   this process and the Ray backend on two processes of a local instance (127.0.0.1 only),
   each with its tasks apart and as one program over the pipeline devices (``ticks``,
   ``rayticks``), in turns of four steps each, the first of a turn not timed (these steps
   return gradients, so they wait for the devices); then the same for 1F1B and
   ZB-H1 at pp=4 over 8 microbatches (a CPU device, or a Ray process, per pipeline device),
   with the programs each device dispatches per step (its tasks, :mod:`pipedsl.tasks`, and
   the update) against its actions, and the host microseconds per step; then training
   steps of both at pp=4 on both backends, as one SPMD program over the pipeline
   devices (:mod:`pipedsl.executor.local.ticked`) and as tasks apart: programs per device,
   host microseconds until ``train_step`` returns (per step and per action), and the step
   time of steps dispatched back to back;
6. a stage's forward and backward apart (as a pipeline runs them: ``jax.vjp``'s forward
   returns its residuals, a second program takes them back) against one program of both
   (as the SPMD step runs them), on the demo transformer's first stage of two (embedding
   and two layers, 8 sequences of 64 tokens per device) over a data-parallel mesh of 4
   devices (``--only apart``; 2 when run with the others), as the demo's ``dp=4 pp=2``
   plans run it: the cost model prices both alike, so what apart costs more is what
   pipelines come out fast by on CPU;
7. the demo transformer at pp=4 (a layer a stage), 1F1B over 8 microbatches of 4
   sequences, a CPU device per pipeline device, trained with Adam as the tasks apart (the
   default) and as one program over the pipeline devices, in fp32 and in
   bf16: the first step and the step of steps back to back (``--only one-program``).

The benchmark model is an MLP of ``--width`` wide GELU layers, ``--layers`` per stage, with
``--microbatch``-row microbatches: each stage action takes milliseconds on CPU.
``--cores N`` pins the process to N cores: with one core, (I + W) / B compares the work
of the halves with that of B; with more, XLA also runs B's weight matmuls beside its
input-gradient chain on other cores, an overlap two separate programs cannot have.

    python bench/bench_executor.py [--pp 2] [--microbatches 8] [--cores N] [--only split|per-action|apart|one-program]
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import Any

from timing import interleaved_medians, medians_with_recordings, record, wall_and_cpu_medians


def _configure(pp: int, cores: int | None) -> None:
    flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={pp}"]
    os.environ["XLA_FLAGS"] = " ".join(f for f in flags if f)
    if cores is not None:
        # Before JAX starts its thread pools, which inherit the affinity.
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])


def bench_split(width: int, layers: int, microbatch: int, repeat: int) -> None:
    import jax
    import jax.numpy as jnp

    from pipedsl.executor import Pipeline
    from pipedsl.executor.models import mlp
    from pipedsl.library import library_path, load

    schedule = load(library_path("zb_h1"), pp=3, microbatches=3)
    model = mlp(num_stages=3, width=width, layers_per_stage=layers)
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    batch = model.batch(key, 3 * microbatch)
    devices = [jax.devices()[0]] * 3
    prog = Pipeline(model.stages, loss=model.loss, schedule=schedule, devices=devices).compile(params, batch)[1]
    device = devices[0]
    p = jax.device_put(tuple(jax.tree_util.tree_leaves(params[1])), device)
    x = (jax.device_put(batch[0][:microbatch], device),)
    ct = (jax.device_put(jnp.ones((microbatch, width), jnp.float32) * 1e-3, device),)
    _, residuals, _ = prog.forward(p, x, (), None)
    _, handoff = prog.backward_input(residuals, ct)
    split = prog.split
    state = {"acc": prog.zero_grads()}

    # The approach the split replaces: keep jax.vjp's residuals, then jit the two halves
    # of its pullback separately; W's half re-derives the cotangent chain.
    stage_fn = model.stages[1]
    _, pullback = jax.jit(lambda q, h: jax.vjp(stage_fn, q, h))(params[1], x[0])
    naive_input = jax.jit(lambda pb, c: pb(c)[1])
    naive_weight = jax.jit(lambda pb, c: pb(c)[0])
    naive_full = jax.jit(lambda pb, c: pb(c))

    def run_b() -> Any:
        out, state["acc"] = prog.backward(residuals, ct, state["acc"])
        return out, state["acc"]

    def run_w() -> Any:
        state["acc"] = prog.backward_weight(handoff, state["acc"])
        return state["acc"]

    t = interleaved_medians(
        {
            "F": lambda: prog.forward(p, x, (), None),
            "B": run_b,
            "I": lambda: prog.backward_input(residuals, ct),
            "W": run_w,
            "B vjp": lambda: naive_full(pullback, ct[0]),
            "I vjp": lambda: naive_input(pullback, ct[0]),
            "W vjp": lambda: naive_weight(pullback, ct[0]),
        },
        repeat,
    )
    full, half_i, half_w = split.counts()
    print(f"\n1. I/W split: middle stage of {layers} GELU layers x {width} wide, microbatch {microbatch} rows")
    print(f"   dot_general in B / I / W: {full['dot_general']} / {half_i['dot_general']} / {half_w['dot_general']}")
    print(f"   F {t['F'] * 1e3:7.2f} ms   B {t['B'] * 1e3:7.2f} ms")
    print(f"   I {t['I'] * 1e3:7.2f} ms   W {t['W'] * 1e3:7.2f} ms   (I+W)/B = {(t['I'] + t['W']) / t['B']:.3f}")
    naive = (t["I vjp"] + t["W vjp"]) / t["B vjp"]
    print(
        f"   two jitted halves of one vjp: B {t['B vjp'] * 1e3:.2f} ms, I {t['I vjp'] * 1e3:.2f} ms, "
        f"W {t['W vjp'] * 1e3:.2f} ms, (I+W)/B = {naive:.3f}"
    )
    iw = (t["I"] + t["W"]) / t["B"]
    record("bench_executor_split", {"B_ms": t["B"] * 1e3, "I_ms": t["I"] * 1e3, "W_ms": t["W"] * 1e3,
                                    "iw_over_b": iw, "vjp_halves_iw_over_b": naive})  # fmt: skip


def bench_apart(repeat: int) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pipedsl.cli.workload import DEMO

    devices = min(4, len(jax.devices()))
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    model = DEMO.build(2)
    key = jax.random.PRNGKey(0)
    params = jax.device_put(model.init_stages(key)[0], NamedSharding(mesh, PartitionSpec()))
    tokens = jax.device_put(
        model.batch(jax.random.fold_in(key, 1), 8 * devices)[0], NamedSharding(mesh, PartitionSpec("data"))
    )
    stage = model.stages[0]
    forward = jax.jit(stage)
    forward_apart = jax.jit(lambda p, x: jax.vjp(lambda q: stage(q, x), p))
    out, pullback = forward_apart(params, tokens)
    cotangent = jnp.ones_like(out)
    backward_apart = jax.jit(lambda pb, c: pb(c))
    both = jax.jit(lambda p, x, c: jax.vjp(lambda q: stage(q, x), p)[1](c))
    t = interleaved_medians(
        {
            "forward": lambda: forward(params, tokens),
            "F apart": lambda: forward_apart(params, tokens),
            "B apart": lambda: backward_apart(pullback, cotangent),
            "F+B one program": lambda: both(params, tokens, cotangent),
        },
        repeat,
    )
    kept = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(pullback))
    apart = t["F apart"] + t["B apart"]
    print(
        f"\n6. forward and backward apart against one program: demo transformer, first of 2 stages, {devices} devices"
    )
    print(f"   forward alone {t['forward'] * 1e3:.2f} ms; forward keeping its residuals {t['F apart'] * 1e3:.2f} ms "
          f"({kept / devices / 1e6:.1f} MB per device in {len(jax.tree_util.tree_leaves(pullback))} arrays, "
          "parameters included)")  # fmt: skip
    print(f"   apart: F {t['F apart'] * 1e3:.2f} + B {t['B apart'] * 1e3:.2f} = {apart * 1e3:.2f} ms; "
          f"one program {t['F+B one program'] * 1e3:.2f} ms; apart / one = {apart / t['F+B one program']:.2f}")  # fmt: skip
    record("bench_executor_apart", {
        "forward_ms": t["forward"] * 1e3, "forward_apart_ms": t["F apart"] * 1e3,
        "backward_apart_ms": t["B apart"] * 1e3, "one_program_ms": t["F+B one program"] * 1e3,
        "devices": devices, "residual_mb_per_device": kept / devices / 1e6, "apart_over_one": apart / t["F+B one program"],
    })  # fmt: skip


def bench_overhead(repeat: int) -> None:
    import jax
    import numpy as np

    from pipedsl.executor import Pipeline
    from pipedsl.executor.models import mlp
    from pipedsl.library import library_path, load

    model = mlp(num_stages=2, width=4, layers_per_stage=1)
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    counts, instructions, steps = [], [], {}
    for microbatches in (4, 16, 64):
        schedule = load(library_path("1f1b"), pp=2, microbatches=microbatches)
        batch = model.batch(key, microbatches)
        counts.append(schedule.num_actions)
        pipe = Pipeline(model.stages, loss=model.loss, schedule=schedule)
        steps[microbatches] = partial(pipe.value_and_grad, params, batch)
        instructions.append(pipe.program.num_instructions)
    times = wall_and_cpu_medians(steps, repeat)
    print("\n2. interpreter overhead: 1F1B pp=2, one-row microbatches of a 4-wide one-layer MLP (compute negligible)")
    wall = [times[m][0] for m in (4, 16, 64)]
    cpu = [times[m][1] for m in (4, 16, 64)]
    for c, t, u in zip(counts, wall, cpu, strict=True):
        print(f"   {c:4d} actions: step {t * 1e3:6.2f} ms wall, {u * 1e3:6.2f} ms CPU")
    # Step time = fixed cost per step + cost per action: a least-squares line.
    per_action, fixed = np.polyfit(counts, wall, 1)
    cpu_per_action = np.polyfit(counts, cpu, 1)[0]
    per_instruction = np.polyfit(instructions, wall, 1)[0]
    print(
        f"   fit: {fixed * 1e3:.2f} ms per step + {per_action * 1e6:.0f} us per action wall, "
        f"{cpu_per_action * 1e6:.0f} us CPU (= {per_instruction * 1e6:.0f} us wall per instruction)"
    )
    record("bench_executor_overhead", {"per_step_ms": fixed * 1e3, "per_action_us": per_action * 1e6,
                                       "per_action_cpu_us": cpu_per_action * 1e6})  # fmt: skip


def bench_schedules(pp: int, microbatches: int, width: int, layers: int, microbatch: int, repeat: int) -> None:
    import jax
    import jax.numpy as jnp

    from pipedsl.executor import Pipeline
    from pipedsl.executor.models import mlp, reference_stages
    from pipedsl.library import library_path, load
    from pipedsl.simulator import simulate
    from pipedsl.simulator.calibration.timelines import fit_costs

    model = mlp(num_stages=pp, width=width, layers_per_stage=layers)
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    batch = model.batch(key, microbatches * microbatch)
    print(
        f"\n3. step times: pp={pp}, {microbatches} microbatches of {microbatch} rows, "
        f"{layers} GELU layers x {width} wide per stage"
    )
    print(f"   {'schedule':<8} {'measured':>10} {'simulated':>10} {'sim/meas':>9} {'recorded':>10} {'bubble':>7}")
    names = ("gpipe", "1f1b", "zb_h1")
    schedules = {name: load(library_path(name), pp=pp, microbatches=microbatches) for name in names}
    pipes = {name: Pipeline(model.stages, loss=model.loss, schedule=sched) for name, sched in schedules.items()}
    single = reference_stages(model)

    @jax.jit
    def one_device(p: Any, xs: jax.Array, ts: jax.Array) -> tuple[jax.Array, Any]:
        # The same microbatch loop on one device: the mean loss and gradients.
        total, grads = 0.0, jax.tree_util.tree_map(jnp.zeros_like, p)
        for m in range(microbatches):
            loss, g = jax.value_and_grad(lambda q: model.loss(single(q, xs[m]), ts[m]))(p)
            total = total + loss / microbatches
            grads = jax.tree_util.tree_map(lambda a, b: a + b / microbatches, grads, g)
        return total, grads

    device = jax.devices()[0]
    xs = jax.device_put(batch[0].reshape(microbatches, microbatch, width), device)
    ts = jax.device_put(batch[1].reshape(microbatches, microbatch, width), device)
    p1 = jax.device_put(params, device)
    # Every variant in turn, repeatedly, so that a change in the machine's load hits all;
    # each schedule's recorded steps (for the simulator's costs) alternate with its timed ones.
    timed = {name: partial(pipe.value_and_grad, params, batch) for name, pipe in pipes.items()}
    timed["jit"] = partial(one_device, p1, xs, ts)
    steps, recorded = medians_with_recordings(timed, pipes, params, batch, repeat)
    base = steps.pop("jit")
    for name, pipe in pipes.items():
        timelines = recorded[name]
        timeline = sorted(timelines, key=lambda tl: tl.makespan)[len(timelines) // 2]
        sim = simulate(pipe.program, fit_costs(timelines, num_stages=pipe.schedule.num_stages).cost_model())
        print(
            f"   {name:<8} {steps[name] * 1e3:8.1f}ms {sim.makespan * 1e3:8.1f}ms {sim.makespan / steps[name]:9.3f} "
            f"{timeline.makespan * 1e3:8.1f}ms {timeline.bubble_ratio():7.1%}"
        )

    best = min(steps, key=steps.__getitem__)
    print(f"\n4. one jax.jit of the same microbatch loop on one device: {base * 1e3:.1f} ms")
    for name, t in steps.items():
        print(f"   {name:<8} pipelined / single jit = {t / base:.3f}{'   (best)' if name == best else ''}")
    figures = {f"{name}_ms": t * 1e3 for name, t in steps.items()}
    record("bench_executor_schedules", {**figures, "one_jit_ms": base * 1e3, "pp": pp, "microbatches": microbatches})


_BURST = 4
"""Steps of a backend per turn in measurement 5 (the first of each not timed)."""


def _backends_step(model: Any, schedule: Any, params: Any, batch: Any, repeat: int) -> dict[str, float]:
    """Seconds of one ``value_and_grad`` step of ``schedule`` on the local backend (tasks
    apart, and one program over the pipeline devices) and on Ray (medians). The two backends take turns, so that a change in the machine's load hits
    both; a few steps a turn, timed after the first, as a training loop runs them back to back."""
    from pipedsl.executor import Pipeline, RayConfig, RunOptions

    # "local" and "ray": the tasks apart; "ticks" and "rayticks": one program over the
    # pipeline devices (on Ray every process dispatching it on its shards).
    ray = RayConfig(step_timeout=300, start_timeout=120)
    backends: dict[str, Any] = {
        "local": ("local", RunOptions(ticks=False)),
        "ticks": ("local", RunOptions(ticks=True)),
        "ray": (ray, RunOptions(ticks=False)),
        "rayticks": (ray, RunOptions(ticks=True)),
    }
    pipes = {
        b: Pipeline(model.stages, loss=model.loss, schedule=schedule, backend=v, options=o)
        for b, (v, o) in backends.items()
    }
    try:
        times = interleaved_medians(
            {b: partial(pipe.value_and_grad, params, batch) for b, pipe in pipes.items()},
            max(repeat // _BURST, 1),
            burst=_BURST,
        )
        for b, pipe in pipes.items():
            if pipe.ticked != b.endswith("ticks"):
                raise SystemExit(f"{schedule.name}: the {b} pipeline ran the other path")
        return times
    finally:
        for pipe in pipes.values():
            pipe.close()


def bench_per_action(repeat: int) -> None:
    import jax

    from pipedsl.executor.models import mlp
    from pipedsl.library import library_path, load

    model = mlp(num_stages=2, width=4, layers_per_stage=1)
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    schedule = load(library_path("1f1b"), pp=2, microbatches=16)
    batch = model.batch(key, 16)
    actions = schedule.num_actions
    times = _backends_step(model, schedule, params, batch, repeat)
    load_now = os.getloadavg()[0]
    print("\n5. the executor's own cost per action: 2 stages, 1F1B, 16 microbatches, compute-free stages")
    figures: dict[str, float] = {}
    for name, step in times.items():
        print(
            f"   {name:<8} step {step * 1e3:6.2f} ms over {actions} F and B actions: {step / actions * 1e6:5.0f} us per action"
        )
        figures[f"{name}_per_action_us"] = step / actions * 1e6
    print(f"   (load average {load_now:.1f})")
    record("bench_executor_per_action", figures)
    bench_dispatch(repeat)


def bench_dispatch(repeat: int) -> None:
    """Measurement 5's second part: 1F1B and ZB-H1 at pp=4, 8 microbatches, each pipeline
    device a CPU device (local) or a process (Ray), compute-free stages."""
    import jax

    from pipedsl.executor import Pipeline, RayConfig, RunOptions
    from pipedsl.executor.models import mlp
    from pipedsl.library import library_path, load
    from pipedsl.program import Compute
    from pipedsl.tasks import device_tasks
    from pipedsl.ticks import tick_table

    model = mlp(num_stages=4, width=4, layers_per_stage=1)
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    batch = model.batch(key, 8)
    print("\n   pp=4, 8 microbatches, compute-free stages, a CPU device (local) or a process (Ray) per pipeline device")
    print(
        f"   {'schedule':<8} {'backend':<8} {'actions/dev':>11} {'programs/dev':>12} {'host us/step':>12} {'us/action':>9}"
    )
    figures: dict[str, float] = {}
    for name in ("1f1b", "zb_h1"):
        schedule = load(library_path(name), pp=4, microbatches=8)
        program = Pipeline(model.stages, loss=model.loss, schedule=schedule).program
        # Per device: its tasks and one program for the update (or for what a step starts with).
        programs = [len(device_tasks(d)) + 1 for d in program.devices]
        actions = [sum(isinstance(i, Compute) for i in d.instructions) for d in program.devices]
        times = _backends_step(model, schedule, params, batch, repeat)
        for backend, step in times.items():
            per_action = step / schedule.num_actions
            programs_here = [1] if backend.endswith("ticks") else programs
            print(
                f"   {name:<8} {backend:<8} {max(actions):>11} {max(programs_here):>12} {step * 1e6:>12.0f} "
                f"{per_action * 1e6:>9.0f}"
            )
            figures |= {
                f"{name}_{backend}_programs_per_device": max(programs_here),
                f"{name}_{backend}_host_us_per_step": step * 1e6,
                f"{name}_{backend}_per_action_us": per_action * 1e6,
            }
        figures |= {f"{name}_programs_per_device": max(programs), f"{name}_actions_per_device": max(actions)}
    print(f"   (load average {os.getloadavg()[0]:.1f})")
    print(
        "\n   training steps: one SPMD program over the pipeline devices (ticks; on Ray, rayticks: every process"
        " dispatching it) against the tasks apart (tasks; on Ray, ray: RunOptions(ticks=False), the default);"
        " host us/step is the time train_step takes to return with no step"
        f" in flight, step us the time per step of {_TRAIN_STEPS} steps back to back, waited for"
    )
    print(
        f"   {'schedule':<8} {'path':<8} {'ticks':>5} {'programs/dev':>12} {'host us/step':>12} {'us/action':>9}"
        f" {'step us':>8}"
    )
    for name in ("1f1b", "zb_h1"):
        schedule = load(library_path(name), pp=4, microbatches=8)
        program = Pipeline(model.stages, loss=model.loss, schedule=schedule).program
        ticks = tick_table(schedule).num_ticks
        ray = RayConfig(step_timeout=300, start_timeout=120)
        paths = {
            "ticks": ("local", RunOptions(ticks=True)),
            "tasks": ("local", RunOptions(ticks=False)),
            "rayticks": (ray, RunOptions(ticks=True)),
            "ray": (ray, RunOptions(ticks=False)),
        }
        apart = max(len(device_tasks(d)) + 1 for d in program.devices)
        programs = {p: 1 if p.endswith("ticks") else apart for p in paths}
        pipes = {
            p: Pipeline(model.stages, loss=model.loss, schedule=schedule, backend=b, options=o)
            for p, (b, o) in paths.items()
        }
        timed = _train_steps(pipes, params, batch, repeat)
        for path, (ran_ticked, _, host, step) in timed.items():
            if ran_ticked != path.endswith("ticks"):
                raise SystemExit(f"{name}: the {path} pipeline ran the other path")
            print(
                f"   {name:<8} {path:<8} {ticks if path.endswith('ticks') else '':>5} {programs[path]:>12}"
                f" {host * 1e6:>12.0f} {host / schedule.num_actions * 1e6:>9.1f} {step * 1e6:>8.0f}"
            )
            figures |= {
                f"{name}_train_{path}_programs_per_device": programs[path],
                f"{name}_train_{path}_host_us_per_step": host * 1e6,
                f"{name}_train_{path}_host_us_per_action": host / schedule.num_actions * 1e6,
                f"{name}_train_{path}_step_us": step * 1e6,
            }
        figures[f"{name}_ticks"] = ticks
    print(f"   (load average {os.getloadavg()[0]:.1f})")
    record("bench_executor_dispatch", figures)


_TRAIN_STEPS = 10
"""Training steps dispatched back to back per timed run of measurement 5's last table."""


def _train_steps(
    pipes: dict[str, Any], params: Any, batch: Any, repeat: int, *, optimizer: Any = None
) -> dict[str, tuple[Any, ...]]:
    """Per pipeline, (whether its steps ran as one program over the pipeline devices, seconds
    of its first step (tracing and compiling included), seconds a train_step takes to return
    with no step in flight, seconds per step of :data:`_TRAIN_STEPS` steps back to back,
    waited for), medians over turns that alternate the pipelines; ``optimizer`` SGD unless
    given. With nothing in flight a step that only dispatches returns after its
    host's work; one that waits for the devices inside (the tasks apart, whose receives
    between CPU devices take host arrays) returns when they are done."""
    import time

    import numpy as np
    import optax

    optimizer = optax.sgd(1e-3) if optimizer is None else optimizer
    held = {}
    ticked = {}
    first = {}
    for path, pipe in pipes.items():
        before = time.perf_counter()
        held[path] = pipe.train_step(params, None, batch, optimizer=optimizer)[:2]  # compiles
        pipe.block_until_ready()
        first[path] = time.perf_counter() - before
        ticked[path] = pipe.ticked
    host: dict[str, list[float]] = {p: [] for p in pipes}
    step: dict[str, list[float]] = {p: [] for p in pipes}
    for _ in range(max(repeat // _TRAIN_STEPS, 3)):
        for path, pipe in pipes.items():
            p, state = held[path]
            for _ in range(_TRAIN_STEPS):
                pipe.block_until_ready()
                before = time.perf_counter()
                p, state, _ = pipe.train_step(p, state, batch, optimizer=optimizer)
                host[path].append(time.perf_counter() - before)
            pipe.block_until_ready()
            start = time.perf_counter()
            for _ in range(_TRAIN_STEPS):
                p, state, _ = pipe.train_step(p, state, batch, optimizer=optimizer)
            pipe.block_until_ready()
            step[path].append((time.perf_counter() - start) / _TRAIN_STEPS)
            held[path] = (p, state)
    for pipe in pipes.values():
        pipe.close()
    return {p: (ticked[p], first[p], float(np.median(host[p])), float(np.median(step[p]))) for p in pipes}


def bench_one_program(repeat: int) -> None:
    """Measurement 7: the demo transformer at pp=4 (a layer a stage), 1F1B over 8
    microbatches of 4 sequences, each pipeline device a CPU device, trained with Adam as the
    tasks apart (the default) and as one program over the pipeline devices
    (ticks), in fp32 and in bf16 mixed precision: the first step (tracing and compiling
    included, or reading the persistent compilation cache where it holds the programs:
    ``PIPEDSL_COMPILATION_CACHE=off`` times the compile) and the step of steps back to back."""
    import jax
    import optax

    from pipedsl.cli.workload import DEMO
    from pipedsl.executor import Pipeline, RunOptions
    from pipedsl.executor.compilation_cache import cache_folder
    from pipedsl.library import library_path, load

    schedule = load(library_path("1f1b"), pp=4, microbatches=8)
    model = DEMO.build(4)
    key = jax.random.PRNGKey(0)
    params = model.init_stages(key)
    batch = model.batch(jax.random.fold_in(key, 1), 4 * schedule.num_microbatches)
    print(
        "\n7. the demo transformer at pp=4, 1F1B over 8 microbatches of 4 sequences, a CPU device per pipeline device:"
    )
    cache = "on" if cache_folder() is not None else "off"
    print(
        f"   training steps as the tasks apart and as one program over the pipeline devices (persistent cache {cache})"
    )
    print(f"   {'precision':<9} {'path':<6} {'first step s':>12} {'step ms':>8} {'/ tasks':>8}")
    figures: dict[str, Any] = {"persistent_cache": cache}
    for precision in ("fp32", "bf16"):
        pipes = {
            path: Pipeline(
                model.stages,
                loss=model.loss,
                schedule=schedule,
                options=RunOptions(ticks=path == "ticks", precision=precision),
            )
            for path in ("tasks", "ticks")
        }
        timed = _train_steps(pipes, params, batch, repeat, optimizer=optax.adam(1e-3))
        for path, (ran_ticked, first, _, step) in timed.items():
            if ran_ticked != (path == "ticks"):
                raise SystemExit(f"{precision}: the {path} pipeline ran the other path")
            ratio = step / timed["tasks"][3]
            print(f"   {precision:<9} {path:<6} {first:>12.1f} {step * 1e3:>8.1f} {ratio:>8.2f}")
            figures |= {f"{precision}_{path}_first_s": first, f"{precision}_{path}_step_ms": step * 1e3}
        figures[f"{precision}_ticks_over_tasks"] = timed["ticks"][3] / timed["tasks"][3]
    print(f"   (load average {os.getloadavg()[0]:.1f})")
    record("bench_executor_one_program", figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2, help="pipeline devices for measurements 3 and 4 (default 2)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="layers per stage (default 4)")
    parser.add_argument("--microbatch", type=int, default=128, help="rows per microbatch (default 128)")
    parser.add_argument("--repeat", type=int, default=20, help="timed repetitions per measurement (default 20)")
    parser.add_argument("--cores", type=int, help="pin the process to this many cores (Linux)")
    parser.add_argument(
        "--only",
        choices=("split", "overhead", "schedules", "per-action", "apart", "one-program"),
        help="run one measurement",
    )
    args = parser.parse_args()
    _configure(max(args.pp, 4 if args.only in (None, "apart", "per-action", "one-program") else 2), args.cores)
    # Loopback only, for the Ray instance of measurement 5 (read when ray is imported).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import jax

    print(
        f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices, "
        f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} cores, XLA_FLAGS={os.environ['XLA_FLAGS']!r}"
    )
    sys.stdout.flush()
    if args.only in (None, "split"):
        bench_split(args.width, args.layers, args.microbatch, args.repeat * 5)
    if args.only in (None, "overhead"):
        bench_overhead(args.repeat * 5)
    if args.only in (None, "schedules"):
        bench_schedules(args.pp, args.microbatches, args.width, args.layers, args.microbatch, args.repeat)
    if args.only in (None, "per-action"):
        bench_per_action(args.repeat * 5)
    if args.only in (None, "apart"):
        bench_apart(args.repeat)
    if args.only in (None, "one-program"):
        bench_one_program(args.repeat)


if __name__ == "__main__":
    main()
