"""``pipedsl run``: train a built-in model under a schedule on this machine's devices.

``pipedsl run FILE -p pp=4 -p microbatches=8 --model mlp --steps 10`` trains a built-in
model (:mod:`pipedsl.executor.models`) on a fixed synthetic batch under the schedule,
printing the loss and the measured time of every step; ``--timeline out.json`` also
records one more step and saves its measured timeline (draw it with ``pipedsl plot``).
``--dp D --tp T --zero Z`` make every pipeline device a ``D x T`` mesh of JAX devices
(``--cp C`` adds a ``"context"`` axis that splits the transformers' sequences;
``--reduce-once`` reduces ZeRO 2 and 3's gradients once per step);
``--plan RANK --plans plans.csv`` runs a plan that ``pipedsl search`` ranked (its schedule,
degrees, microbatches and ZeRO stage) on the built-in transformer.

Ctrl-C is taken between steps, where no XLA call is in flight (:mod:`pipedsl.cli.interrupts`):
one during the first step, which compiles the stages, ends the run once that step is done;
a second one ends it at once.

JAX is imported only when the command runs, never when the parser is built, so
``pipedsl check`` stays fast. On CPU the command gives JAX ``pp x dp x cp x tp`` devices
by setting ``XLA_FLAGS`` before the import.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pipedsl.cli.checkpoints import Checkpointing, add_checkpoint_options, training_settings
from pipedsl.cli.common import EXIT_OK, add_param_option, load_schedule, option_error
from pipedsl.cli.interrupts import take_interrupt
from pipedsl.cli.outputs import FORCE_HELP, TIMELINE, check_output_file
from pipedsl.cli.planned import SPMD_SCHEDULE, PlannedRun, read_plan
from pipedsl.errors import PipedslError
from pipedsl.executor.devices import request_devices
from pipedsl.executor.model_sizes import block_parameters
from pipedsl.ir import Schedule
from pipedsl.run_options import FUSE_MODES, RECOMPUTE_MODES, RunOptions, RunOptionsError
from pipedsl.validate import validate
from pipedsl.words import byte_size, plural

__all__ = ["register"]

_INT64 = 2**63
# Adam keeps, for every parameter, its gradient and two moments: four copies in all.
_COPIES_FOR_ADAM = 4
_FP32_BYTES = 4
# Local devices a run makes at most without --force: this many a core, and never fewer
# than _MIN_DEVICES (the examples' and tests' meshes of up to 8 on a 2-core machine).
_DEVICES_PER_CORE = 4
_MIN_DEVICES = 8


_PLAN_SETS = {
    "dp": "--dp",
    "fsdp": "--fsdp",
    "tp": "--tp",
    "cp": "--cp",
    "zero": "--zero",
    "microbatch_size": "--microbatch-size",
    "model": "--model",
    "width": "--width",
    "layers_per_stage": "--layers-per-stage",
}
"""What ``--plan`` sets (the plan's degrees and batch, and the model it runs, scaled down),
as the option that would set it otherwise."""

_DEFAULTS: dict[str, int | str | None] = {
    "dp": 1, "fsdp": None, "tp": 1, "cp": 1, "zero": 0, "microbatch_size": 8, "model": "mlp", "width": 64, "layers_per_stage": 2,
}  # fmt: skip
"""The values of :data:`_PLAN_SETS`'s options when neither they nor ``--plan`` are given."""


def _check_args(args: argparse.Namespace) -> None:
    """Refuse option values that cannot train, and combinations of options that mean
    nothing, before any work."""
    if args.remat and args.recompute not in (None, "full"):
        raise PipedslError(f"--remat is --recompute full, which --recompute {args.recompute} contradicts: give one")
    if args.remat:
        args.recompute = "full"
    if args.address is not None and args.backend != "ray":
        raise PipedslError("--address names a Ray cluster; use it with --backend ray")
    if args.shared_devices and args.backend == "ray":
        raise PipedslError(
            "--shared-devices puts every pipeline device on this process's devices: use it with --backend local"
        )
    if args.ticks is not None and args.shared_devices:
        raise PipedslError(
            "--ticks says how pipeline devices of their own run a step; with --shared-devices, --fuse ticks runs"
            " the same program with each pipeline device's part of a tick in turn"
        )
    if args.fuse is not None and not args.shared_devices and args.plan is None:
        raise PipedslError(
            "--fuse says how pipeline devices that share their devices run a step: give --shared-devices too"
        )
    if args.plan is None:
        for name, value in _DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        args.recompute = args.recompute or "none"
        args.precision = args.precision or "fp32"
        _check_model_options(args)
    for option, value in (
        ("--steps", args.steps),
        ("--microbatch-size", args.microbatch_size),
        ("--width", args.width),
        ("--layers-per-stage", args.layers_per_stage),
    ):
        if value is not None and value < 1:
            raise PipedslError(f"{option} must be at least 1, got {value}")
    if not -_INT64 <= args.seed < _INT64:
        raise PipedslError(f"--seed must be a 64-bit integer, from {-_INT64} to {_INT64 - 1}; got {args.seed}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise PipedslError(f"--lr must be a finite number above 0, got {args.lr}")
    if args.timeline is not None:
        check_output_file(
            args.timeline, option="--timeline", writes=TIMELINE, reads=(args.file, args.plans), force=args.force
        )


def _check_model_options(args: argparse.Namespace) -> None:
    """Refuse options that change nothing of the model or the mesh ``args`` ask for."""
    if args.model == "mlp":
        for option, given in (
            ("--fused-attention", args.fused_attention),
            ("--recompute selective", args.recompute == "selective"),
        ):
            if given:
                raise PipedslError(
                    f"{option} acts on attention, which the mlp model has none of: give --model transformer or llama"
                )


def _memory_bytes() -> int:
    """This machine's memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_device_count(args: argparse.Namespace, devices: int) -> None:
    """Refuse, before JAX makes them, more local devices than this machine holds: on a CPU
    every device is a host device with its own threads and buffers, and past
    :data:`_DEVICES_PER_CORE` a core the run measures nothing but their contention (and
    thousands of them take minutes and gigabytes to start). ``--force`` runs them anyway."""
    cores = os.cpu_count() or 1
    most = max(_MIN_DEVICES, _DEVICES_PER_CORE * cores)
    if args.backend != "local" or args.force or devices <= most:
        return
    raise PipedslError(
        f"{devices:,} devices (pp x dp x cp x tp) are more than this machine holds: {plural(cores, 'core')} and"
        f" {byte_size(_memory_bytes())} of memory run at most {most} ({_DEVICES_PER_CORE} a core); give smaller"
        " degrees, run on a cluster (--backend ray, docs/cluster.md), or pass --force"
    )


def _check_fits(jax: Any, model: Any, *, devices: int, replicas: int, what: str) -> None:
    """Refuse a model whose parameters and Adam state, once per data-parallel replica,
    cannot fit in the memory of this machine (or of ``devices`` accelerators).

    The parameters are counted from the model's sizes (:attr:`BuiltinModel.parameters`),
    all fp32 (bf16 keeps fp32 master weights): nothing is built, so the answer is as quick
    for a million layers as for two.
    """
    param_bytes = model.parameters * _FP32_BYTES
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        available, where = stats["bytes_limit"] * devices, f"{devices} {device.platform} devices"
    else:
        available, where = _memory_bytes(), "this machine's memory"
    _refuse_unless_fits(param_bytes, replicas=replicas, available=available, where=where, what=what)


def _check_tensor_layout(jax: Any, model: Any, key: Any, *, tp: int, marked: bool) -> None:
    """Refuse ``tp > 1`` for a model whose parameter specs split nothing over the tensor
    axis: every tensor-parallel device would hold and compute a whole copy of it, which
    costs ``tp`` times the devices for no speed or memory gained.

    The specs are read from the parameters' shapes (``jax.eval_shape``, which allocates nothing).
    """
    if tp == 1:
        return
    from jax.sharding import PartitionSpec

    shapes = jax.eval_shape(model.init_function if marked else model.init_stages, key)
    specs = jax.tree_util.tree_leaves(model.param_specs(shapes), is_leaf=lambda leaf: isinstance(leaf, PartitionSpec))
    if not any(isinstance(spec, PartitionSpec) and any(axis is not None for axis in spec) for spec in specs):
        raise PipedslError(
            f"--tp {tp}: model {model.name} gives no tensor-parallel layout of its parameters, so every one of"
            f" the {tp} tensor-parallel devices would hold a whole copy; give --model transformer or llama, or --tp 1"
        )


def _describe(schedule: Schedule) -> str:
    params = ", ".join(f"{k}={v}" for k, v in schedule.params)
    return f"{schedule.name}({params})" if params else schedule.name


def _model(
    args: argparse.Namespace, schedule: Schedule, planned: PlannedRun | None, options: RunOptions
) -> tuple[Any, str]:
    """The built-in model to train and its shape in words; a ranked plan runs its model
    (scaled down to run here: :mod:`pipedsl.cli.scaled`), saying so."""
    from pipedsl.executor.models import MODELS

    if planned is not None:
        from pipedsl.cli.scaled import scaled_model

        scaled = scaled_model(
            planned.model, num_stages=schedule.num_stages, tp=planned.tp, fused_attention=planned.flash_attention
        )
        if scaled.note is not None:
            print(scaled.note)
        return scaled.model, scaled.shape
    layers = f"{args.layers_per_stage} layers per stage"
    sizes = _block_sizes(args, options.tp)
    where = {"num_stages": schedule.num_stages, "layers_per_stage": args.layers_per_stage, **sizes}
    if args.model == "mlp":
        return MODELS["mlp"](**where), f"width {args.width}, {layers}"
    fused = args.fused_attention
    if args.model == "llama":
        model = MODELS["llama"](**where, vocab=64, fused_attention=fused)
        return model, f"hidden {args.width}, {sizes['heads']} heads / {sizes['kv_heads']} kv, {layers}"
    return MODELS["transformer"](**where, fused_attention=fused), f"dim {args.width}, {layers}"


def _block_sizes(args: argparse.Namespace, tp: int) -> dict[str, int]:
    """The sizes of a block of ``args.model``, as its factory takes them: the llama has two
    query heads per key/value head, every split ``tp``-way, and a feed-forward 4 x wide."""
    if args.model == "mlp":
        return {"width": args.width}
    if args.model == "llama":
        return {"hidden": args.width, "ffn_hidden": 4 * args.width, "heads": 2 * tp, "kv_heads": tp}
    return {"dim": args.width}


def _check_host_memory(args: argparse.Namespace, schedule: Schedule, options: RunOptions) -> None:
    """Refuse, before JAX starts, a model whose blocks alone need more memory than this
    machine has (where a CPU run keeps them; ``--force`` leaves the check to the
    accelerators' memory, :func:`_check_fits`). Plain arithmetic, however many layers."""
    if args.force:
        return
    blocks = schedule.num_stages * args.layers_per_stage
    parameters = blocks * block_parameters(args.model, _block_sizes(args, options.tp))
    shape = f"width {args.width}, {args.layers_per_stage} layers per stage"
    _refuse_unless_fits(
        parameters * _FP32_BYTES,
        replicas=options.dp,
        available=_memory_bytes(),
        where="this machine's memory",
        what=f"model {args.model} ({shape})",
    )


def _refuse_unless_fits(param_bytes: int, *, replicas: int, available: int, where: str, what: str) -> None:
    needed = _COPIES_FOR_ADAM * param_bytes * replicas
    if needed > available:
        raise PipedslError(
            f"{what} has {byte_size(param_bytes)} of parameters; training it with Adam needs at least"
            f" {byte_size(needed)} (parameters, gradients and two moments), more than the"
            f" {byte_size(available)} of {where}; use a smaller --width or --layers-per-stage"
        )


def _spmd_schedule(args: argparse.Namespace) -> Schedule:
    """``--spmd``'s schedule: one stage over every device, each microbatch's forward and at
    once its backward (:data:`~pipedsl.cli.planned.SPMD_SCHEDULE` at ``pp = 1``), as the
    planner prices an SPMD plan; ``-p microbatches=M`` is the one parameter it takes."""
    if args.file is not None or args.plan is not None:
        raise PipedslError("--spmd runs no pipeline schedule: give it without a FILE or --plan")
    others = sorted(set(args.params) - {"microbatches"})
    if others:
        raise PipedslError(f"--spmd takes only -p microbatches=M (one stage, no pipeline); drop -p {others[0]}")
    schedule = load_schedule(SPMD_SCHEDULE, {"pp": 1, **args.params}, max_actions=args.max_actions)
    validate(schedule)
    return schedule


def _planned(args: argparse.Namespace) -> tuple[Schedule, PlannedRun | None]:
    """The schedule to run and, with ``--plan``, the plan it comes from (which then sets
    the microbatches and their size and the model; :func:`_run_options` takes its options)."""
    if args.spmd:
        return _spmd_schedule(args), None
    if args.plan is None:
        if args.plans is not None:
            raise PipedslError("--plans names the plans file of --plan RANK; give --plan too")
        if args.file is None:
            raise PipedslError("give a schedule FILE, --spmd, or --plan RANK --plans plans.csv")
        schedule = load_schedule(args.file, args.params, max_actions=args.max_actions)
        validate(schedule)
        return schedule, None
    if args.file is not None or args.params:
        raise PipedslError("--plan sets the schedule and its parameters; give no FILE or -p with it")
    if args.plans is None:
        raise PipedslError("--plan RANK needs --plans FILE.csv, the ranking that pipedsl search --csv wrote")
    planned = read_plan(args.plans, args.plan)
    sets: dict[str, int | str | None] = {
        "dp": planned.dp, "fsdp": planned.fsdp or planned.dp, "tp": planned.tp, "cp": planned.cp, "zero": planned.zero,
        "microbatch_size": planned.microbatch_size,
        "model": None, "width": None, "layers_per_stage": None,
    }  # fmt: skip
    given = [name for name in _PLAN_SETS if getattr(args, name) is not None]
    clash = [name for name in given if sets[name] is None or getattr(args, name) != sets[name]]
    if clash:
        said = ", ".join(
            f"{_PLAN_SETS[n]} {getattr(args, n)} (the plan {'has ' + str(sets[n]) if sets[n] is not None else 'runs its own model, scaled down'})"
            for n in clash
        )
        raise PipedslError(
            f"--plan {args.plan} sets the degrees, the batch and the model; {said} would change the plan:"
            " drop the option, or run the schedule with FILE and your own options"
        )
    for name in ("microbatch_size", "model", "width", "layers_per_stage"):
        setattr(args, name, sets[name])
    if planned.not_run is not None:
        raise PipedslError(f"--plan {args.plan} ({planned.label()}) {planned.not_run}. Run another plan of the ranking")
    changes: list[str] = []
    if args.recompute is not None and args.recompute != planned.recompute:
        changes.append(f"--recompute {args.recompute} (the plan recomputes {planned.recompute})")
    if args.sequence_parallel and not (planned.sequence_parallel and planned.tp > 1):
        changes.append("--sequence-parallel (the plan runs without it)")
    if args.fused_attention and not planned.flash_attention:
        changes.append("--fused-attention (the plan runs without it)")
    if args.precision is not None:
        changes.append("--precision (the plan runs in its model's own)")
    if changes:
        raise PipedslError(
            f"--plan {args.plan} sets how the model computes; {', '.join(changes)} would change the plan: drop it"
        )
    if args.reduce_once and not planned.reduce_once:
        raise PipedslError(
            f"--plan {args.plan} reduces its gradients as it was priced; --reduce-once would change the plan: drop it"
        )
    if args.shared_devices and not planned.shared_devices:
        raise PipedslError(
            f"--plan {args.plan} gives each pipeline device devices of its own; --shared-devices would change the"
            " plan: drop it"
        )
    args.fused_attention = planned.flash_attention
    args.shared_devices = planned.shared_devices
    return planned.schedule_of(), planned


def _run_options(args: argparse.Namespace, planned: PlannedRun | None) -> RunOptions:
    """How the pipeline runs, made here and nowhere else: a ranked plan's options as it was
    priced (its model's precision included), else the command line's, an option that cannot
    run refused by its flag."""
    if planned is not None:
        from pipedsl.cli.scaled import priced_model

        options = planned.run_options(priced_model(planned.model))
        return dataclasses.replace(options, fuse=args.fuse or "loop", ticks=args.ticks == "on")
    try:
        return RunOptions(
            dp=args.dp, fsdp=args.fsdp, tp=args.tp, cp=args.cp, zero=args.zero, reduce_once=args.reduce_once,
            recompute=args.recompute, precision=args.precision, sequence_parallel=args.sequence_parallel,
            fuse=args.fuse or "loop", ticks=args.ticks == "on",
        )  # fmt: skip
    except RunOptionsError as err:
        raise option_error(err) from None


def _cmd_run(args: argparse.Namespace) -> int:
    _check_args(args)
    try:
        return _train(args)
    except Exception as err:
        # A runtime error of JAX's (out of memory above all) as one line of ours, not
        # XLA's traceback; anything else is not ours to reword.
        jax = sys.modules.get("jax")
        if jax is None or not isinstance(err, jax.errors.JaxRuntimeError):
            raise
        lines = str(err).strip().splitlines() or [type(err).__name__]
        hint = ""
        if "RESOURCE_EXHAUSTED" in str(err):
            hint = "; the model does not fit: use a smaller --width, --layers-per-stage or --microbatch-size"
        raise PipedslError(f"JAX failed: {lines[0][:300]}{hint}") from None


def _train(args: argparse.Namespace) -> int:
    schedule, planned = _planned(args)
    options = _run_options(args, planned)
    _check_mesh(args, options)
    if args.shared_devices and schedule.num_devices == 1:
        raise PipedslError("--shared-devices shares devices between pipeline devices: give a schedule with pp above 1")
    devices = options.mesh_size * (1 if args.shared_devices else schedule.num_devices)
    _check_device_count(args, devices)
    if planned is None:
        _check_host_memory(args, schedule, options)
    # Before anything imports JAX (reading a checkpoint does): the devices it is to make.
    request_devices(devices)
    keeping = _checkpointing(args, schedule, dp=options.dp)
    if planned is not None:
        print(f"plan {planned.rank} of {args.plans}: {planned.label()}")

    import jax
    import optax

    from pipedsl.cli.health import nonfinite_origin
    from pipedsl.executor.devices import cpu_fallback_note

    if args.backend == "ray" and "JAX_PLATFORMS" not in os.environ:
        # The driver only builds host arrays (parameters, the batch) for the actors: on a
        # GPU node it must not take a GPU's memory from them (JAX would preallocate most
        # of it). A setting of this process's JAX, not the environment the actors inherit.
        jax.config.update("jax_platforms", "cpu")
    elif args.backend == "local":
        note = cpu_fallback_note(jax.devices()[0].platform)
        if note is not None:
            print(note, file=sys.stderr)

    model, shape = _model(args, schedule, planned, options)
    key = jax.random.PRNGKey(args.seed)
    _check_fits(jax, model, devices=devices, replicas=options.dp, what=f"model {model.name} ({shape})")
    _check_tensor_layout(jax, model, key, tp=options.tp, marked=args.marked)
    batch_size = args.microbatch_size * schedule.num_microbatches * options.dp
    batch = model.batch(jax.random.fold_in(key, 1), batch_size)
    _check_sequence(batch, options.cp)
    pipe, params = _build_pipeline(args, schedule, model, key, options)
    optimizer = optax.adam(args.lr)
    platform = jax.devices()[0].platform if args.backend == "local" else "Ray process"
    print(_run_line(args, options, schedule, platform, model.name, shape, batch_size, devices=devices))
    if planned is not None:
        print(_configuration(pipe, schedule, model))
    # Read and checked against this run's model and optimizer before anything else is
    # said of it: a checkpoint of another model is refused even when no step is left.
    params, opt_state, first = keeping.restore(pipe, params, batch, optimizer)
    if first > args.steps:
        print(
            f"nothing left to do: {args.checkpoint} holds step {first - 1} and --steps is {args.steps};"
            f" give --steps above {first - 1} to train on"
        )
        return EXIT_OK
    if args.resume:
        print(f"resumed from {args.checkpoint} after step {first - 1}")
    print(f"{'step':>5}  {'loss':>12}  {'time':>10}")
    times: list[float] = []
    skips = args.backend == "local"  # where a step's update can be skipped on the devices
    for step in range(first, args.steps + 1):
        # A safe point: the last step's results have all been read (its loss, printed).
        take_interrupt()
        # To find where a non-finite loss came from, the parameters that entered the step:
        # on the local backend its devices skip a non-finite step's update, so they still
        # hold them; a Ray world applies it (the update donates what a step returned), so a
        # copy is fetched first.
        before = params if args.allow_nonfinite or skips else pipe.gather(params)
        start = time.perf_counter()
        params, opt_state, loss = pipe.train_step(
            params, opt_state, batch, optimizer=optimizer, skip_nonfinite=skips and not args.allow_nonfinite
        )
        # The step returns once it is dispatched; its time runs until its loss is computed.
        value = float(loss)
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        note = "  (includes tracing and compilation)" if step == 1 else ""
        print(f"{step:>5}  {value:>12.6f}  {elapsed * 1e3:>7.1f} ms{note}")
        if step == first and args.ticks is not None:
            print(_ticks_line(pipe))
        if not args.allow_nonfinite and not math.isfinite(value):
            entered = pipe.gather(params) if skips else before
            raise nonfinite_origin(pipe, model, entered, batch, step=step, marked=args.marked)
        keeping.after_step(pipe, step, last=step == args.steps)
    take_interrupt()
    if len(times) > 1:
        print(f"median step time (steps {first + 1}-{args.steps}): {statistics.median(times[1:]) * 1e3:.1f} ms")
    if args.checkpoint is not None:
        print(f"checkpoint of step {max(first - 1, args.steps)} in {args.checkpoint}")
    if args.timeline is not None:
        _write_timeline(pipe, params, batch, args.timeline)
    return EXIT_OK


def _check_mesh(args: argparse.Namespace, options: RunOptions) -> None:
    """Refuse context parallelism where the model or the backend has no context axis,
    before any device is made."""
    if options.cp > 1 and args.model == "mlp":
        raise PipedslError("--cp splits every sequence over a context axis: give --model transformer or llama")
    if options.cp > 1 and args.backend == "ray":
        raise PipedslError(f"--cp {options.cp} runs on the local backend only: drop --backend ray, or give --cp 1")


def _check_sequence(batch: Any, cp: int) -> None:
    """Refuse a context-parallel degree that does not split the batch's sequences (the
    executor would keep them whole on every context device instead)."""
    import jax

    tokens = jax.tree_util.tree_leaves(batch)[0]
    if cp > 1 and tokens.shape[1] % cp:
        raise PipedslError(
            f"--cp {cp} must divide the model's sequence of {tokens.shape[1]} tokens: give a --cp that does"
        )


def _checkpointing(args: argparse.Namespace, schedule: Schedule, *, dp: int) -> Checkpointing:
    """The run's checkpoint options (``dp`` replicas), checked against the settings of a
    checkpoint it resumes (its model and optimizer are checked when it is read)."""
    settings = training_settings(
        seed=args.seed,
        lr=args.lr,
        microbatches=schedule.num_microbatches,
        microbatch_size=args.microbatch_size,
        dp=dp,
    )
    return Checkpointing.from_args(args, settings)


def _run_line(
    args: argparse.Namespace,
    options: RunOptions,
    schedule: Schedule,
    platform: str,
    model: str,
    shape: str,
    batch_size: int,
    *,
    devices: int,
) -> str:
    """The run's first line: schedule, the devices it uses in all and how they make its
    pipeline devices' meshes, model, batch."""
    form = "marked function" if args.marked else "explicit stages"
    meshes = ""
    if options.mesh_size > 1:
        pipeline = plural(schedule.num_devices, "pipeline device")
        shape, axes = (
            (f"{options.dp} x {options.tp}", "dp x tp")
            if options.cp == 1
            else (f"{options.dp} x {options.cp} x {options.tp}", "dp x cp x tp")
        )
        once = ", reduced once per step" if options.reduce_once else ""
        groups = (
            f", sharded in {options.replicas} groups of {options.fsdp} (replicas across)"
            if options.fsdp is not None
            else ""
        )
        meshes = f" ({pipeline}, each a {shape} mesh: {axes}, zero {options.zero}{groups}{once})"
    if args.shared_devices:
        how = {
            "loop": "one program looping over the microbatches",
            "unrolled": "one program of every action",
            "ticks": "one program of the tick table, each pipeline device's part in turn",
        }
        step = how.get(options.fuse, "every action apart")
        pronoun = "it" if devices == 1 else "them"
        meshes += f" ({plural(schedule.num_devices, 'pipeline device')} share {pronoun}; each step runs as {step})"
    replicas = f" x {options.dp} replicas" if options.dp > 1 else ""
    return (
        f"run {_describe(schedule)}: {plural(schedule.num_stages, 'stage')} on"
        f" {plural(devices, platform + ' device')}{meshes}; model {model} ({shape}, {form}); "
        f"batch {batch_size} = {plural(schedule.num_microbatches, 'microbatch')} of {args.microbatch_size}{replicas}"
    )


def _ticks_line(pipe: Any) -> str:
    """How the steps ran, for a run that gave ``--ticks``: as one program, or why not."""
    if pipe.ticked:
        return "      (each step runs as one program over the pipeline devices, tick by tick)"
    if pipe.options.ticks:
        return (
            "      (each step runs its tasks apart: one program over the pipeline devices needs each to be one"
            " device of its own, no parameter used by two stages and no stage that calls back into Python)"
        )
    return "      (each step runs its tasks apart)"


def _configuration(pipe: Any, schedule: Schedule, model: Any) -> str:
    """What the pipeline runs, read back from it: the plan's columns, as a search row
    names them."""
    options = pipe.options
    vpp = schedule.num_stages // schedule.num_devices
    return (
        f"configuration: schedule={schedule.name} dp={options.dp} tp={options.tp} cp={options.cp} "
        f"pp={schedule.num_devices} vpp={vpp} microbatches={schedule.num_microbatches} zero={options.zero} "
        f"{f'fsdp={options.fsdp} ' if options.fsdp is not None else ''}"
        f"reduce_once={str(options.reduce_once).lower()} recompute={options.recompute} "
        f"sequence_parallel={str(options.sequence_parallel).lower()} "
        f"flash_attention={str(model.fused_attention).lower()} precision={options.precision}"
    )


def _build_pipeline(
    args: argparse.Namespace, schedule: Schedule, model: Any, key: Any, options: RunOptions
) -> tuple[Any, Any]:
    """The pipeline ``args`` ask for (backend, explicit stages or marked function), run as
    ``options`` say, and its initial parameters."""
    from pipedsl.executor.pipeline import Pipeline

    # On Ray, the actors (and a local instance pipedsl started) stop when the process exits.
    backend: Any = args.backend
    if args.backend == "ray":
        from pipedsl.executor.ray.cluster import RayConfig

        backend = RayConfig(address=args.address)
    params = model.init_function(key) if args.marked else model.init_stages(key)
    specs = model.param_specs(params) if options.tp > 1 else None
    devices = None
    if args.shared_devices:
        import jax

        # Every pipeline device the same first dp x cp x tp devices.
        devices = jax.devices()[: options.mesh_size] * schedule.num_devices
    where = {"options": options, "backend": backend, "param_specs": specs, "devices": devices}
    if args.marked:
        return Pipeline.from_function(model.model_fn, loss=model.loss, schedule=schedule, **where), params
    return Pipeline(model.stages, loss=model.loss, schedule=schedule, **where), params


def _write_timeline(pipe: Any, params: Any, batch: Any, path: str) -> None:
    """Record one more step and save its measured timeline to ``path``."""
    result = pipe.step(params, batch, record=True)
    assert result.timeline is not None  # asked for with record=True
    try:
        result.timeline.save(path)
    except OSError as err:
        raise PipedslError(f"{path}: cannot write: {err.strerror or err}") from None
    timeline = result.timeline
    print(
        f"timeline of one recorded step written to {path}: {len(timeline)} events, "
        f"makespan {timeline.makespan * 1e3:.1f} ms, bubble {timeline.bubble_ratio():.1%} "
        "(recording waits for every action, so it runs slower than the steps above)"
    )


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
            "  pipedsl run schedules/1f1b.sched -p pp=2 --backend ray [--address HOST:PORT]\n"
            "  pipedsl run 1f1b -p pp=2 --model transformer --dp 2 --tp 2 --zero 1\n"
            "  pipedsl run 1f1b -p pp=2 --model llama --cp 2 --tp 2                       # context parallel\n"
            "  pipedsl run --spmd -p microbatches=4 --model transformer --dp 8             # SPMD data parallel\n"
            "  pipedsl run --plan 1 --plans out/plans.csv                                   # a plan search ranked\n"
            "  pipedsl run 1f1b -p pp=2 --steps 100 --checkpoint ckpt --checkpoint-every 10 [--resume]"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.set_defaults(handler=_cmd_run)
    run.add_argument(
        "file", metavar="FILE", nargs="?", help="a .sched, .csv or .json schedule (or give --spmd or --plan)"
    )
    run.add_argument(
        "--spmd",
        action="store_true",
        help="no pipeline: one stage over every device (data, tensor and context parallel), as the planner's SPMD"
        " plans run; -p microbatches=M accumulates M microbatches per step (default 8)",
    )
    add_param_option(run)
    run.add_argument("--model", choices=("mlp", "transformer", "llama"), help="the built-in model (default mlp)")
    run.add_argument("--marked", action="store_true", help="split one marked function instead of explicit stages")
    run.add_argument("--steps", type=int, default=5, metavar="N", help="training steps (default 5)")
    run.add_argument("--microbatch-size", type=int, metavar="B", help="examples per microbatch (default 8)")
    run.add_argument("--width", type=int, metavar="W", help="MLP width or transformer model dim (default 64)")
    run.add_argument("--layers-per-stage", type=int, metavar="L", help="layers per stage (default 2)")
    run.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    run.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data (default 0)")
    run.add_argument(
        "--remat",
        action="store_true",
        help="recompute each stage's forward in its backward (the same as --recompute full)",
    )
    run.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        help="what the backward recomputes: none, selective (the attention core), full, or a named remat policy"
        " rerunning each block from what it saves: save_dots (the products' outputs), save_qkv_proj (Q, K, V and"
        " the output projection), save_mlp_inputs (the feed-forward's input) (default none)",
    )
    run.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        help="bf16: bf16 compute and activations, fp32 master weights and gradient accumulation (default fp32)",
    )
    run.add_argument(
        "--sequence-parallel", action="store_true", help="with --tp, split norms' activations along the sequence"
    )
    run.add_argument(
        "--fused-attention",
        action="store_true",
        help="jax.nn.dot_product_attention (cuDNN on GPUs) in the transformers",
    )
    run.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="where devices run: local (JAX devices of this process) or ray (a jax.distributed world of Ray "
        "processes, see docs/cluster.md); default local",
    )
    run.add_argument(
        "--address",
        metavar="ADDR",
        help="with --backend ray, the Ray cluster to join (default: $RAY_ADDRESS, else a local instance on 127.0.0.1)",
    )
    run.add_argument("--dp", type=int, metavar="D", help="data-parallel degree inside each pipeline device (default 1)")
    run.add_argument(
        "--tp", type=int, metavar="T", help="tensor-parallel degree inside each pipeline device (default 1)"
    )
    run.add_argument(
        "--cp",
        type=int,
        metavar="C",
        help="context-parallel degree inside each pipeline device: the transformers' sequences split over C (default 1)",
    )
    run.add_argument("--zero", type=int, metavar="Z", help="ZeRO stage over the data axis, 0-3 (default 0)")
    run.add_argument(
        "--fsdp",
        type=int,
        metavar="N",
        help="shard the ZeRO state in groups of N of the dp devices, the dp/N groups replicas of one another whose"
        " gradient shards are all-reduced across them (FSDP in a slice or node, data parallelism across; default: one"
        " group of all dp)",
    )
    run.add_argument(
        "--reduce-once",
        action="store_true",
        help="with --zero 2 or 3, accumulate the gradients unreduced and reduce them once per step",
    )
    run.add_argument(
        "--shared-devices",
        action="store_true",
        help="put every pipeline device on the same dp x cp x tp devices (all stages on one chip): a step then "
        "runs as one program (see --fuse)",
    )
    run.add_argument(
        "--fuse",
        choices=FUSE_MODES,
        help="with --shared-devices, the step as one program that loops over the microbatches (loop, the "
        "default), one program of every action (unrolled), the one program of devices of their own with each "
        "device's part of a tick in turn (ticks), or every action apart (off)",
    )
    run.add_argument(
        "--ticks",
        choices=("on", "off"),
        help="where every pipeline device is one device of its own, each step as one program over them, tick by"
        " tick (on), or every task dispatched apart (off, the default: faster on every platform measured)",
    )
    run.add_argument(
        "--plan",
        type=int,
        metavar="RANK",
        help="run the plan of this rank in --plans (schedule, degrees, microbatches)",
    )
    run.add_argument("--plans", metavar="PLANS.csv", help="the ranking pipedsl search --csv (or demo) wrote")
    run.add_argument(
        "--timeline", type=Path, metavar="OUT.json", help="save the measured timeline of one recorded step"
    )
    run.add_argument(
        "--force",
        action="store_true",
        help=f"{FORCE_HELP}; and make more local devices than this machine holds ({_DEVICES_PER_CORE} a core)",
    )
    add_checkpoint_options(run)
    run.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="train on after a NaN or infinite loss (by default the run stops there, naming the step and stage)",
    )
