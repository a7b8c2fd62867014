"""``pipedsl run``: train a built-in model under a schedule on this machine's devices.

``pipedsl run FILE -p pp=4 -p microbatches=8 --model mlp --steps 10`` trains a built-in
model (:mod:`pipedsl.executor.models`) on a fixed synthetic batch under the schedule,
printing the loss and the measured time of every step; ``--timeline out.json`` also
records one more step and saves its measured timeline (draw it with ``pipedsl plot``).

JAX is imported only when the command runs, never when the parser is built, so
``pipedsl check`` stays fast. On CPU the command gives JAX one device per pipeline
device by setting ``XLA_FLAGS`` before the import.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from pipedsl.cli.common import EXIT_OK, add_param_option, load_schedule
from pipedsl.errors import PipedslError
from pipedsl.executor.devices import request_devices
from pipedsl.ir import Schedule

__all__ = ["register"]

def _describe(schedule: Schedule) -> str:
    params = ", ".join(f"{k}={v}" for k, v in schedule.params)
    return f"{schedule.name}({params})" if params else schedule.name


def _cmd_run(args: argparse.Namespace) -> int:
    schedule = load_schedule(args.file, args.params)
    schedule.validate()
    if args.steps < 1 or args.microbatch_size < 1:
        raise PipedslError("--steps and --microbatch-size must be at least 1")
    request_devices(schedule.num_devices)

    import jax
    import optax

    from pipedsl.executor.models import MODELS
    from pipedsl.executor.pipeline import Pipeline

    if args.model == "mlp":
        model = MODELS["mlp"](num_stages=schedule.num_stages, width=args.width, layers_per_stage=args.layers_per_stage)
        shape = f"width {args.width}"
    else:
        model = MODELS["transformer"](
            num_stages=schedule.num_stages, dim=args.width, layers_per_stage=args.layers_per_stage
        )
        shape = f"dim {args.width}"
    key = jax.random.PRNGKey(args.seed)
    batch_size = args.microbatch_size * schedule.num_microbatches
    batch = model.batch(jax.random.fold_in(key, 1), batch_size)
    # On Ray, the actors (and a local instance pipedsl started) stop when the process exits.
    backend: Any = args.backend
    if args.backend == "ray":
        from pipedsl.executor.ray_cluster import RayConfig

        backend = RayConfig(address=args.address)
    elif args.address is not None:
        raise PipedslError("--address names a Ray cluster; use it with --backend ray")
    if args.marked:
        pipe = Pipeline.from_function(model.model_fn, loss=model.loss, schedule=schedule, backend=backend, remat=args.remat)
        params = model.init_function(key)
    else:
        pipe = Pipeline(model.stages, loss=model.loss, schedule=schedule, backend=backend, remat=args.remat)
        params = model.init_stages(key)
    optimizer = optax.adam(args.lr)
    platform = jax.devices()[0].platform if args.backend == "local" else "Ray actor"
    form = "marked function" if args.marked else "explicit stages"
    print(
        f"run {_describe(schedule)}: {schedule.num_stages} stages on {schedule.num_devices} {platform} devices; "
        f"model {model.name} ({shape}, {args.layers_per_stage} layers per stage, {form}); "
        f"batch {batch_size} = {schedule.num_microbatches} microbatches of {args.microbatch_size}"
    )
    print(f"{'step':>5}  {'loss':>12}  {'time':>10}")
    opt_state = None
    times: list[float] = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        params, opt_state, loss = pipe.train_step(params, opt_state, batch, optimizer=optimizer)
        jax.block_until_ready((params, loss))
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        note = "  (includes tracing and compilation)" if step == 1 else ""
        print(f"{step:>5}  {float(loss):>12.6f}  {elapsed * 1e3:>7.1f} ms{note}")
    if len(times) > 1:
        print(f"median step time (steps 2-{args.steps}): {statistics.median(times[1:]) * 1e3:.1f} ms")
    if args.timeline is not None:
        result = pipe.step(params, batch, record=True)
        assert result.timeline is not None  # asked for with record=True
        try:
            result.timeline.save(args.timeline)
        except OSError as err:
            raise PipedslError(f"{args.timeline}: cannot write: {err.strerror or err}") from None
        timeline = result.timeline
        print(
            f"timeline of one recorded step written to {args.timeline}: {len(timeline)} events, "
            f"makespan {timeline.makespan * 1e3:.1f} ms, bubble {timeline.bubble_ratio():.1%} "
            "(recording waits for every action, so it runs slower than the steps above)"
        )
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``run`` to ``pipedsl``'s subcommands."""
    run = subparsers.add_parser(
        "run",
        help="train a built-in model under a schedule on this machine's devices",
        description=(
            "Run FILE for real: compile a built-in model's stages with JAX, interpret every\n"
            "device's lowered program, and train on a fixed synthetic batch with Adam. Prints\n"
            "the loss and the measured time of each step. On CPU each pipeline device is one\n"
            "XLA host device (XLA_FLAGS is set for you). --timeline records one extra step\n"
            "and saves its measured timeline as JSON, which `pipedsl plot` draws."
        ),
        epilog=(
            "examples:\n"
            "  pipedsl run schedules/1f1b.sched -p pp=4 -p microbatches=8 --model mlp --steps 5\n"
            "  pipedsl run schedules/zb_h1.sched -p pp=2 --model transformer --marked --timeline zb.json\n"
            "  pipedsl run schedules/1f1b.sched -p pp=2 --backend ray [--address HOST:PORT]"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.set_defaults(handler=_cmd_run)
    run.add_argument("file", metavar="FILE", help="a .sched, .csv or .json schedule")
    add_param_option(run)
    run.add_argument("--model", choices=("mlp", "transformer"), default="mlp", help="the built-in model (default mlp)")
    run.add_argument("--marked", action="store_true", help="split one marked function instead of explicit stages")
    run.add_argument("--steps", type=int, default=5, metavar="N", help="training steps (default 5)")
    run.add_argument("--microbatch-size", type=int, default=8, metavar="B", help="examples per microbatch (default 8)")
    run.add_argument("--width", type=int, default=64, metavar="W", help="MLP width or transformer model dim (default 64)")
    run.add_argument("--layers-per-stage", type=int, default=2, metavar="L", help="layers per stage (default 2)")
    run.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    run.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data (default 0)")
    run.add_argument("--remat", action="store_true", help="recompute each stage's forward in its backward")
    run.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="where devices run: local (JAX devices of this process) or ray (one Ray actor per device); default local",
    )
    run.add_argument(
        "--address",
        metavar="ADDR",
        help="with --backend ray, the Ray cluster to join (default: $RAY_ADDRESS, else a local instance on 127.0.0.1)",
    )
    run.add_argument("--timeline", type=Path, metavar="OUT.json", help="save the measured timeline of one recorded step")
