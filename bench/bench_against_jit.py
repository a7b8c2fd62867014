"""The pipelined training step against one ``jax.jit`` of the same step, on one device.

Every pipeline device of every plan shares this machine's first JAX device (one TPU chip,
one GPU, or one CPU device), so a plan's step runs the same FLOPs on the same shapes as
the jits and what it takes beyond them is the executor's own cost. Per plan it prints:

- the pipelined ``train_step`` (Adam, bf16 compute on fp32 master weights) in a loop of
  ``--steps`` steps waited for once at the end, as a training loop runs it (so the host
  dispatches step k+1 while step k runs), seconds per step, median of ``--rounds``;
- the same against the *accumulating jit*: one ``jax.jit`` that runs the same
  microbatches in a ``lax.scan``, accumulates their gradients and applies Adam (the
  limit without any executor: 1.0x), and against the *whole jit*: one ``jax.jit`` of the
  step over the whole batch at once;
- the host time of one ``train_step`` call (how long Python takes to dispatch a step:
  below the step time, the device never waits for the host);
- the first step's wall time (tracing and compiling) against the jits', and the second
  step's apart (were a program compiled again for it, it would show there, not in the steps);
- the executor's own cost per action: a step of near-empty stages (``h * w``, 1F1B,
  pp=2, 16 microbatches) over its F and B actions;
- ``--fuse`` says how the plans' steps run (:mod:`pipedsl.executor.local.fused`): ``loop``
  (the default: one program that loops over the microbatches, each through every stage),
  ``unrolled`` (one program of every action), or the pipeline devices kept apart on the
  one device, as on devices of their own: ``ticks`` (the one program over the stage axis
  that devices of their own run, :mod:`pipedsl.executor.local.ticked`, with each device's
  part of every tick run in turn: its loops of at most one trip and padded stacks, its
  permutes as copies) or ``off`` (every task dispatched as a program of its own, :mod:`pipedsl.tasks`,
  and every value copied between them); with the host's microseconds per action (the
  host time of one step over the schedule's actions);
- with ``--cluster FILE`` (what ``pipedsl calibrate`` wrote on this machine), each plan's
  step as the planner predicts it there, against the measured one;
- with ``--cache``, the first step of the first plan in a new process, twice: with an empty
  persistent compilation cache, then with the one the first filled (both before this
  process opens the device, which one process at a time may hold on a TPU), each with
  the seconds it spent tracing, lowering and in XLA's compiler or the cache's reads; and
  the same of the accumulating jit, what JAX alone takes.

On an accelerator the model is the issue's Llama (hidden 1024, FFN 2816, 16 heads and 4
KV heads, 512 tokens, vocabulary 8192, 8 layers, 8 sequences a step in 8 microbatches);
on CPU a toy of the same shape (``--size real`` forces the large one). The results are
appended to ``bench/results/bench_against_jit.jsonl`` with the platform and device kind.

    python bench/bench_against_jit.py [--plans 1f1b-pp4,gpipe-pp4,...] [--steps 10] [--rounds 5] [--cache] [--fuse loop|unrolled|off] [--cluster FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Plan:
    """A schedule and how the model's layers are cut for it."""

    schedule: str
    pp: int
    vpp: int
    layers_per_stage: int

    @property
    def name(self) -> str:
        return f"{self.schedule}-pp{self.pp}" + (f"-vpp{self.vpp}" if self.vpp > 1 else "")


PLANS = {
    p.name: p
    for p in (
        Plan("1f1b", 4, 1, 2),
        Plan("gpipe", 4, 1, 2),
        Plan("zb_h1", 4, 1, 2),
        Plan("interleaved_1f1b", 4, 2, 1),
        Plan("1f1b", 2, 1, 4),
    )
}


@dataclass(frozen=True, slots=True)
class Size:
    """The Llama model and batch of the measurements (8 layers over every plan)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    seq: int
    vocab: int
    microbatches: int
    microbatch_size: int


REAL = Size(hidden=1024, ffn=2816, heads=16, kv_heads=4, seq=512, vocab=8192, microbatches=8, microbatch_size=1)
TOY = Size(hidden=64, ffn=128, heads=4, kv_heads=2, seq=32, vocab=256, microbatches=8, microbatch_size=1)
LAYERS = 8
JIT = "accumulating jit"
"""The jit that ``--cache`` also times in a new process: what JAX alone takes there."""


def _bf16(tree: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), tree)


def _model(size: Size, plan: Plan) -> Any:
    from pipedsl.executor.models import llama

    return llama(
        num_stages=plan.pp * plan.vpp, hidden=size.hidden, ffn_hidden=size.ffn, heads=size.heads,
        kv_heads=size.kv_heads, seq_len=size.seq, vocab=size.vocab, layers_per_stage=plan.layers_per_stage,
    )  # fmt: skip


def _loop(step: Callable[[], Any], steps: int, *, done: Callable[[], None] | None = None) -> float:
    """Seconds per step of ``steps`` calls waited for once at the end (on their last result,
    then on ``done``: a pipeline's last update)."""
    import jax

    start = time.perf_counter()
    out = None
    for _ in range(steps):
        out = step()
    jax.block_until_ready(out)
    if done is not None:
        done()
    return (time.perf_counter() - start) / steps


def _waited(step: Callable[[], Any]) -> float:
    """Wall seconds of one call, waited for (the first call's include tracing and compiling)."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(step())
    return time.perf_counter() - start


def _jits(size: Size, device: Any, optimizer: Any) -> dict[str, tuple[Callable[[], Any], Callable[[], None]]]:
    """The whole jit and the accumulating jit, each as (step, release)."""
    import jax
    import jax.numpy as jnp
    import optax

    from pipedsl.executor.models import reference_stages

    m = _model(size, PLANS["1f1b-pp4"])
    fn = reference_stages(m)
    key = jax.random.PRNGKey(0)
    count, per = size.microbatches, size.microbatch_size

    def loss_of(p: Any, x: Any, t: Any) -> Any:
        return m.loss(fn(_bf16(p), x), t)

    def whole(params: Any, state: Any, x: Any, t: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_of)(params, x, t)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    def accumulating(params: Any, state: Any, x: Any, t: Any) -> Any:
        xs = x.reshape((count, per, *x.shape[1:]))
        ts = t.reshape((count, per, *t.shape[1:]))

        def one(carry: Any, batch: Any) -> Any:
            total, acc = carry
            loss, grads = jax.value_and_grad(loss_of)(params, *batch)
            return (total + loss, jax.tree_util.tree_map(jnp.add, acc, grads)), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        (total, acc), _ = jax.lax.scan(one, (jnp.zeros((), jnp.float32), zeros), (xs, ts))
        grads = jax.tree_util.tree_map(lambda g: g / count, acc)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, total / count

    out: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {}
    for name, body in (("whole jit", whole), ("accumulating jit", accumulating)):
        with jax.default_device(device):
            params = m.init_stages(key)
            batch = m.batch(jax.random.fold_in(key, 1), count * per)
            held = [params, optimizer.init(params)]
        jitted = jax.jit(body, donate_argnums=(0, 1))

        def step(jitted: Any = jitted, held: list[Any] = held, batch: Any = batch) -> Any:
            held[0], held[1], loss = jitted(held[0], held[1], *batch)
            return loss

        out[name] = (step, held.clear)
    return out


def _pipeline_step(size: Size, plan: Plan, device: Any, optimizer: Any, *, fuse: str) -> tuple[Any, Callable[[], Any]]:
    """A plan's pipeline (every pipeline device on ``device``) and its step."""
    import jax

    from pipedsl.executor import Pipeline, RunOptions
    from pipedsl.library import library_path, load

    params = {"pp": plan.pp, "microbatches": size.microbatches} | ({"vpp": plan.vpp} if plan.vpp > 1 else {})
    schedule = load(library_path(plan.schedule), **params)
    m = _model(size, plan)
    key = jax.random.PRNGKey(0)
    with jax.default_device(device):
        init = m.init_stages(key)
        batch = m.batch(jax.random.fold_in(key, 1), size.microbatches * size.microbatch_size)
    pipe = Pipeline(
        m.stages,
        loss=m.loss,
        schedule=schedule,
        options=RunOptions(precision="bf16", fuse=fuse),
        devices=[device] * schedule.num_devices,
    )
    held: list[Any] = [init, None]

    def step() -> Any:
        held[0], held[1], loss = pipe.train_step(held[0], held[1], batch, optimizer=optimizer)
        if fuse == "ticks" and not pipe.ticked:
            raise SystemExit(f"{plan.name}: the one program over the stage axis does not take this plan")
        return loss

    return pipe, step


def predicted_step_s(size: Size, plan: Plan, cluster: Any) -> float:
    """The planner's seconds of ``plan``'s step on ``cluster`` (a
    :class:`~pipedsl.simulator.Cluster` that ``pipedsl calibrate`` wrote on this machine):
    every pipeline device on one device, bf16, plain attention, fp32 gradients, as
    :func:`_pipeline_step` runs it."""
    from pipedsl.simulator import Model
    from pipedsl.simulator.estimate import estimate
    from pipedsl.simulator.plan import Plan as PlannedPlan

    model = Model(
        name="bench-llama", layers=LAYERS, hidden=size.hidden, ffn_hidden=size.ffn, heads=size.heads,
        kv_heads=size.kv_heads, seq_len=size.seq, vocab=size.vocab, dtype_bytes=2, gated_ffn=True, biases=False,
        learned_positions=False, tied_embeddings=False, dropout=False,
    )  # fmt: skip
    planned = PlannedPlan(
        pp=plan.pp, vpp=plan.vpp, schedule=plan.schedule, microbatch_size=size.microbatch_size,
        global_batch=size.microbatches * size.microbatch_size, shared_devices=True, flash_attention=False,
        dp_overlap=0.0, reduce_bytes=4, framework="pipedsl",
    )  # fmt: skip
    return estimate(model, cluster, planned).step_time_s


def _per_action(device: Any, steps: int, rounds: int, *, fuse: str) -> float:
    """Seconds of executor cost per F or B action: near-empty stages, 1F1B, pp=2, 16 microbatches."""
    import jax
    import jax.numpy as jnp
    import optax

    from pipedsl.executor import Pipeline, RunOptions
    from pipedsl.library import library_path, load

    def scale(w: Any, h: Any) -> Any:
        return h * w

    def mse(y: Any, t: Any) -> Any:
        return jnp.mean((y - t) ** 2)

    schedule = load(library_path("1f1b"), pp=2, microbatches=16)
    pipe = Pipeline([scale, scale], loss=mse, schedule=schedule, devices=[device] * 2, options=RunOptions(fuse=fuse))
    with jax.default_device(device):
        held: list[Any] = [[jnp.ones((4,)), jnp.ones((4,))], None]
        batch = (jnp.ones((16, 4)), jnp.zeros((16, 4)))
    optimizer = optax.sgd(1e-3)

    def step() -> Any:
        held[0], held[1], loss = pipe.train_step(held[0], held[1], batch, optimizer=optimizer)
        return loss

    _waited(step)
    per_step = statistics.median(_loop(step, steps, done=pipe.block_until_ready) for _ in range(rounds))
    pipe.close()
    return per_step / schedule.num_actions


def _host_time(step: Callable[[], Any]) -> float:
    """Seconds the host spends in one call (the step itself then runs on)."""
    import jax

    start = time.perf_counter()
    out = step()
    took = time.perf_counter() - start
    jax.block_until_ready(out)
    return took


_PHASES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
"""JAX's compile events a first step's seconds are told apart by: tracing to jaxprs, lowering
to StableHLO, and XLA's compile or the persistent cache's read (a hit's seconds count here)."""


def _first_phases(step: Callable[[], Any]) -> dict[str, float]:
    """The first call's wall seconds (``first_step_s``), the seconds of it spent in each of
    :data:`_PHASES`, and how many programs the persistent cache gave (``cache_hits``) or
    compiled (``cache_misses``); what is left of the wall time is Python's own work and
    running the step. Listens to ``jax.monitoring`` for the rest of the process."""
    import jax

    phases = dict.fromkeys((*_PHASES.values(), "cache_hits", "cache_misses"), 0.0)

    def duration(event: str, seconds: float, **_: Any) -> None:
        if event in _PHASES:
            phases[_PHASES[event]] += seconds

    def happened(event: str, **_: Any) -> None:
        if event.startswith("/jax/compilation_cache/cache_"):
            name = event.rsplit("/", 1)[1]
            if name in phases:
                phases[name] += 1

    jax.monitoring.register_event_duration_secs_listener(duration)
    jax.monitoring.register_event_listener(happened)
    return {"first_step_s": _waited(step)} | phases


def _second_process(plan: str, size: str, cache: str, *, fuse: str) -> dict[str, float]:
    """The first step of ``plan`` in a new process using the cache folder ``cache``:
    :func:`_first_phases`'s figures."""
    env = dict(os.environ, PIPEDSL_COMPILATION_CACHE=cache)
    command = [sys.executable, __file__, "--first-step-of", plan, "--size", size, "--fuse", fuse]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=True)
    return {k: float(v) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {', '.join(PLANS)}")
    parser.add_argument("--size", choices=("auto", "real", "toy"), default="auto", help="real on accelerators")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed loop (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="timed loops per figure (default 5)")
    parser.add_argument("--cache", action="store_true", help="time a second process's first step on the cache")
    parser.add_argument(
        "--fuse",
        choices=("loop", "unrolled", "ticks", "off"),
        default="loop",
        help="how the plans' steps run: one program looping over the microbatches (default), one program of "
        "every action, the one program of devices of their own with each device's part of a tick in turn, or "
        "every action apart",
    )
    parser.add_argument(
        "--cluster",
        help="a cluster file that pipedsl calibrate wrote on this machine: print each plan's predicted step",
    )
    parser.add_argument("--no-record", action="store_true", help="print only, append nothing to bench/results")
    parser.add_argument("--first-step-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    unknown = [p for p in plans if p not in PLANS]
    if unknown:
        parser.error(f"unknown plans {unknown}; choose from {', '.join(PLANS)}")
    cluster = None
    if args.cluster:
        from pipedsl.errors import PipedslError
        from pipedsl.simulator import load_cluster

        try:  # before minutes of compiling, not after
            cluster = load_cluster(args.cluster)
        except PipedslError as err:
            parser.error(str(err))

    # Before this process opens the devices: one process at a time may hold a TPU chip.
    cache: dict[str, tuple[dict[str, float], ...]] = {}
    if args.cache:
        for name in (plans[0], JIT):
            with tempfile.TemporaryDirectory() as folder:
                cache[name] = tuple(_second_process(name, args.size, folder, fuse=args.fuse) for _ in range(2))

    import jax
    import optax

    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    size = REAL if args.size == "real" or (args.size == "auto" and accelerator) else TOY
    size_name = "real" if size is REAL else "toy"
    optimizer = optax.adam(1e-4)
    if args.first_step_of:
        if args.first_step_of == JIT:
            from pipedsl.executor.compilation_cache import enable_compilation_cache

            enable_compilation_cache()  # as a pipeline turns it on
            step, _ = _jits(size, device, optimizer)[JIT]
        else:
            _, step = _pipeline_step(size, PLANS[args.first_step_of], device, optimizer, fuse=args.fuse)
        print(json.dumps(_first_phases(step)))
        return
    kind = getattr(device, "device_kind", device.platform)
    print(f"jax {jax.__version__}, {device.platform} ({kind}), {size_name} size: {size}")
    sys.stdout.flush()

    figures: dict[str, Any] = {
        "platform": device.platform,
        "device_kind": str(kind),
        "size": size_name,
        "dispatch": args.fuse,
        "complete": False,  # until every figure asked for is in
    }
    # A run that `timeout` cuts short (compiling a plan can take minutes) records the
    # plans it measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        jit_times: dict[str, float] = {}
        print(
            f"\n{'step':<22} {'first step':>11} {'per step':>10} {'host':>9} {'/ accum.':>9} {'/ whole':>8} {'host/act':>8}"
        )
        for name, (step, release) in _jits(size, device, optimizer).items():
            first = _waited(step)
            per = statistics.median(_loop(step, args.steps) for _ in range(args.rounds))
            host = statistics.median(_host_time(step) for _ in range(3))
            release()
            jit_times[name] = per
            key = name.split()[0]
            figures |= {f"{key}_jit_step_ms": per * 1e3, f"{key}_jit_first_s": first}
            print(f"{name:<22} {first:10.1f}s {per * 1e3:8.2f}ms {host * 1e3:7.2f}ms")
            sys.stdout.flush()
        for name in plans:
            pipe, step = _pipeline_step(size, PLANS[name], device, optimizer, fuse=args.fuse)
            first = _waited(step)
            # The second step, apart from the rounds: a program compiled again for it (the
            # optimizer state as the first step left it) would otherwise be timed as steps.
            second = _waited(step)
            per = statistics.median(_loop(step, args.steps, done=pipe.block_until_ready) for _ in range(args.rounds))
            host = statistics.median(_host_time(step) for _ in range(3))
            pipe.close()
            accum, whole = per / jit_times["accumulating jit"], per / jit_times["whole jit"]
            figures |= {
                f"{name}_step_ms": per * 1e3,
                f"{name}_host_ms": host * 1e3,
                f"{name}_host_us_per_action": host / pipe.schedule.num_actions * 1e6,
                f"{name}_vs_accumulating": accum,
                f"{name}_vs_whole": whole,
                f"{name}_first_s": first,
                f"{name}_second_s": second,
                f"{name}_first_vs_jit": first / figures["accumulating_jit_first_s"],
            }
            said = ""
            if cluster is not None:
                predicted = predicted_step_s(size, PLANS[name], cluster)
                figures |= {f"{name}_predicted_ms": predicted * 1e3, f"{name}_predicted_error": predicted / per - 1}
                said = f"   predicted {predicted * 1e3:.2f}ms ({predicted / per - 1:+.1%})"
            per_action = host / pipe.schedule.num_actions * 1e6
            print(
                f"{name:<22} {first:10.1f}s {per * 1e3:8.2f}ms {host * 1e3:7.2f}ms {accum:8.2f}x {whole:7.2f}x"
                f" {per_action:6.0f}us{said}"
            )
            sys.stdout.flush()
            # The next plan's parameters and optimizer state are made before this plan's
            # would be dropped with its step: drop them first, or a chip runs out of memory.
            del pipe, step
        per_action = _per_action(device, args.steps * 4, args.rounds, fuse=args.fuse)
        figures["per_action_us"] = per_action * 1e6
        print(f"\nexecutor cost per action (h * w stages, 1f1b pp=2, 16 microbatches): {per_action * 1e6:.0f} us")
        if cache:
            print(f"\nfirst step in a new process (s)  {'wall':>6} {'trace':>6} {'lower':>6} {'XLA':>6} {'read':>5}")
            for name, runs in cache.items():
                prefix = "cache" if name != JIT else "jit_cache"
                for label, key, run in (("empty cache", "cold", runs[0]), ("cache filled", "warm", runs[1])):
                    figures |= {f"{prefix}_{key}_first_s": run["first_step_s"]} | {
                        f"{prefix}_{key}_{field}": run[field]
                        for field in ("trace_s", "lower_s", "compile_s", "cache_hits")
                    }
                    print(
                        f"{name + ', ' + label:<32} {run['first_step_s']:6.1f} {run['trace_s']:6.1f} {run['lower_s']:6.1f} "
                        f"{run['compile_s']:6.1f} {run['cache_hits']:3.0f}/{run['cache_hits'] + run['cache_misses']:.0f}"
                    )
            print(
                "   (trace: to jaxprs; lower: to StableHLO; XLA: compiling or reading the persistent cache; read: programs "
                "the cache gave of those it was asked for; the rest of the wall time is Python and the step itself)"
            )
        figures["complete"] = True
    finally:
        if not args.no_record:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from timing import record

            record("bench_against_jit", figures)


if __name__ == "__main__":
    main()
