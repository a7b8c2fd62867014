"""The executor's checks on this machine's accelerator: one GPU or one TPU chip is enough.

Each check runs on its own and reports ``ok``, ``FAIL`` or ``error`` (an exception is
printed and the next check runs):

- ``fp32`` / ``bf16``: a 2-stage 1F1B pipeline of the Llama model, both stages sharing one
  device, against ``jax.value_and_grad`` of the unsplit model on it (bf16 against a bf16
  one-device step); fp32 with full-precision matrix products on both sides (no TF32 on a
  GPU, no single bf16 pass on a TPU);
- ``step-time``: a training step (Adam) of the pipeline against one ``jax.jit`` of the same
  step, median seconds of a few steps each, and their ratio; the two losses after the same
  steps agree (bf16's tolerance on an accelerator);
- ``recompute-<mode>``: gradients under each recompute mode against the reference, and the
  activation bytes the compiled forward keeps per microbatch (XLA's memory analysis)
  against the planner's count of what the compiled stage keeps, for the same shapes;
- ``fused-attention``: ``jax.nn.dot_product_attention`` against the written-out attention
  (bf16 on an accelerator), and on a GPU whether cuDNN's kernel is in the compiled program;
- ``peak-memory``: the device's peak bytes in use over a step against the compiled stage
  programs' analysis and the planner's count;
- ``hybrid``: with two or more devices, a dp x tp x pp plan over them against one device.

Where the time goes is compiling: on one TPU v5e chip a stage program or a reference of
this size takes tens of seconds, and running it a fraction of one. So every program is
compiled once: the checks share their references and pipelines (``fp32`` and
``recompute-none`` run the same pipeline), and before the checks run the large programs
(the references, the training step's ``jax.jit``, each pipeline's stage programs)
compile in parallel threads (``--compile-threads``) into a compilation cache of this run,
which the pipelines' first steps then read: their actions are dispatched apart, so they
run those very programs. ``step-time`` runs its pipeline as the executor does by default
(both stages' step as one program, compiled as the check warms up) and checks that its
loss follows the ``jax.jit``'s. Each check's seconds and the part spent compiling are in
the table.

Prints one table and writes one JSON line of results (``--out``, default
``out/accel_check/results.json``), with the platform and the device kind; ``--results
FOLDER`` also appends the run to ``FOLDER/accel_check.jsonl`` (``bench/results``). On a
machine without a GPU or TPU it runs the same checks at toy sizes on 8 forced CPU devices
(the CPU dry run of the tests). Needs neither Ray nor the simulator's search:
``python bench/accel_check.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipedsl.executor.devices import cpu_fallback_note, request_devices

request_devices(8)  # CPU only, and only when JAX is not imported yet

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import pipedsl  # noqa: E402
from pipedsl.executor import Pipeline, RunOptions  # noqa: E402
from pipedsl.executor.models import BuiltinModel, llama, reference_stages  # noqa: E402
from pipedsl.results import Figure, append_result  # noqa: E402
from pipedsl.run_options import Fuse, Precision, RecomputeMode  # noqa: E402

if TYPE_CHECKING:
    from pipedsl.executor.stages.stage_program import StageMemory

ACCELERATORS = ("gpu", "tpu")
"""The JAX platforms that run the checks at :data:`ACCELERATOR_SIZE`; any other runs the toy one."""


@dataclass(frozen=True, slots=True)
class Size:
    """The model and batch of the checks (widths in elements, ``seq`` in tokens)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    seq: int
    vocab: int
    layers_per_stage: int
    microbatches: int
    microbatch_size: int


ACCELERATOR_SIZE = Size(
    hidden=1024,
    ffn=2816,
    heads=16,
    kv_heads=4,
    seq=1024,
    vocab=8192,
    layers_per_stage=1,
    microbatches=4,
    microbatch_size=2,
)
"""The size on every accelerator: the widths, sequence and vocabulary of a real model, one
layer a stage. A stage unrolls its layers, so what XLA compiles (nearly all of the check's
time) grows with them, and one layer already holds every shape and operation of the block."""
TOY_SIZE = Size(
    hidden=32, ffn=64, heads=4, kv_heads=2, seq=16, vocab=64, layers_per_stage=1, microbatches=2, microbatch_size=2
)


@dataclass(slots=True)
class Row:
    """One line of the table; ``seconds`` the check's wall time, ``compile_s`` the seconds
    XLA spent compiling (or reading compiled programs from the cache) meanwhile, summed
    over the threads that compiled."""

    check: str
    status: str
    value: str
    detail: str
    seconds: float = 0.0
    compile_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Variant:
    """One pipeline of the checks: the same model, schedule and device, these options.
    The gradient checks dispatch each action apart (``fuse="off"``): their stage programs
    are the ones compiled ahead (and analysed); ``step-time`` runs the step as the executor
    does by default, one program for both stages (``"loop"``)."""

    precision: Precision
    recompute: RecomputeMode = "none"
    fused: bool = False
    fuse: Fuse = "off"


@dataclass(frozen=True, slots=True)
class Ahead:
    """A large program a check runs, to compile before the checks: ``"reference"``, the
    unsplit model's ``jax.value_and_grad``; ``"train"``, the training step's ``jax.jit``;
    ``"stage"``, ``F`` and ``B`` of stage ``stage`` of ``variant``'s pipeline."""

    kind: Literal["reference", "train", "stage"]
    precision: Precision
    variant: Variant | None = None
    stage: int | None = None


@dataclass(slots=True)
class CompileClock:
    """Seconds and count of XLA compilations (cache reads included) in this process, from
    ``jax.monitoring``'s backend-compile events, whatever thread compiled."""

    seconds: float = 0.0
    count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def listen(self) -> None:
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event: str, duration_secs: float, **_: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with self._lock:
                self.seconds += duration_secs
                self.count += 1


def _model(size: Size, *, fused: bool = False, stages: int = 2) -> BuiltinModel:
    return llama(
        num_stages=stages, hidden=size.hidden, ffn_hidden=size.ffn, heads=size.heads, kv_heads=size.kv_heads,
        seq_len=size.seq, vocab=size.vocab, layers_per_stage=size.layers_per_stage, fused_attention=fused,
    )  # fmt: skip


def _bf16(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), tree)


@contextlib.contextmanager
def _scope(precision: Precision) -> Iterator[None]:
    """Where programs of ``precision`` are traced, compiled and run: fp32 with full-precision
    matrix products (JAX's default is TF32 on a GPU and one bf16 pass on a TPU), on both
    sides of each comparison; bf16 as it runs. Set for the whole process, not only this
    thread (``jax.default_matmul_precision`` is per thread): the local backend runs a step's
    programs on a thread of its own."""
    if precision == "bf16":
        yield
        return
    before = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]  # a flag JAX reads this way
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", before)


def _reference_program(m: BuiltinModel, params: Any, batch: Any, precision: Precision) -> Any:
    """``jax.value_and_grad`` of the unsplit model, compiled for these shapes (in the
    caller's :func:`_scope`); called as ``program(params, inputs, targets)``."""
    fn = reference_stages(m)
    cast = _bf16 if precision == "bf16" else (lambda p: p)
    return jax.jit(jax.value_and_grad(lambda p, x, t: m.loss(fn(cast(p), x), t))).lower(params, *batch).compile()


def _relative(actual: Any, expected: Any) -> float:
    """L2 distance over all leaves, over the norm of ``expected`` (in float64 on the host)."""
    num = den = 0.0
    pairs = zip(jax.tree_util.tree_leaves(jax.device_get(actual)), jax.tree_util.tree_leaves(expected), strict=True)
    for a, e in pairs:
        e64 = np.ravel(np.asarray(e, np.float64))
        d = np.ravel(np.asarray(a, np.float64)) - e64
        num += float(np.dot(d, d))
        den += float(np.dot(e64, e64))
    return float(np.sqrt(num) / max(np.sqrt(den), 1e-30))


class Checks:
    """Every check over one device (and, for ``hybrid``, all of them), each program
    built, compiled and run once however many checks read it."""

    def __init__(self, size: Size, devices: list[Any]) -> None:
        self.size = size
        self.devices = devices
        self.device = devices[0]
        self.schedule = pipedsl.load(pipedsl.library_path("1f1b"), pp=2, microbatches=size.microbatches)
        self.m = _model(size)
        key = jax.random.PRNGKey(0)
        # One program each for the parameters and the batch, not one per random draw.
        with jax.default_device(self.device):
            self.params = jax.jit(self.m.init_stages)(key)
            batch = jax.jit(self.m.batch, static_argnums=1)
            self.batch = batch(jax.random.fold_in(key, 1), size.microbatches * size.microbatch_size)
        self.results: dict[str, Any] = {}
        self.accelerator = self.device.platform in ACCELERATORS
        # At this size on an accelerator, sums run in other orders than on the host.
        self.fp32_tol = 1e-4 if self.accelerator else 1e-5
        self.step_precision: Precision = "bf16" if self.accelerator else "fp32"
        self.optimizer = optax.adam(1e-4)
        self._pipelines: dict[Variant, Pipeline] = {}
        self._programs: dict[Variant, tuple[Any, ...]] = {}
        self._memories: dict[tuple[Variant, int], StageMemory] = {}
        self._gradients: dict[Variant, tuple[float, Any]] = {}
        self._reference_programs: dict[Precision, Any] = {}
        self._references: dict[Precision, tuple[float, Any]] = {}
        self._train: Any = None

    # -- what the checks share ------------------------------------------------------

    def pipeline(self, v: Variant) -> Pipeline:
        """The pipeline of ``v``, both pipeline devices on the one device (the stages share it)."""
        if v not in self._pipelines:
            m = _model(self.size, fused=True) if v.fused else self.m
            self._pipelines[v] = Pipeline(
                m.stages, loss=m.loss, schedule=self.schedule, devices=[self.device, self.device],
                options=RunOptions(precision=v.precision, recompute=v.recompute, fuse=v.fuse),
            )  # fmt: skip
        return self._pipelines[v]

    def programs(self, v: Variant) -> tuple[Any, ...]:
        """The stage programs of ``v``'s pipeline (traced, compiled when first run or analysed)."""
        if v not in self._programs:
            with _scope(v.precision):
                self._programs[v] = self.pipeline(v).compile(self.params, self.batch)
        return self._programs[v]

    def memory(self, v: Variant, stage: int) -> StageMemory:
        """XLA's memory analysis of stage ``stage`` of ``v`` (compiles its ``F`` and ``B``)."""
        if (v, stage) not in self._memories:
            with _scope(v.precision):
                self._memories[v, stage] = self.programs(v)[stage].memory()
        return self._memories[v, stage]

    def gradients(self, v: Variant) -> tuple[float, Any]:
        """(loss, gradients) of one step of ``v``'s pipeline."""
        if v not in self._gradients:
            with _scope(v.precision):
                result = self.pipeline(v).step(self.params, self.batch)
                self._gradients[v] = (float(result.loss), result.grads)
        return self._gradients[v]

    def reference_program(self, precision: Precision) -> Any:
        if precision not in self._reference_programs:
            with _scope(precision):
                self._reference_programs[precision] = _reference_program(self.m, self.params, self.batch, precision)
        return self._reference_programs[precision]

    def reference(self, precision: Precision) -> tuple[float, Any]:
        """(loss, gradients on the host) of ``jax.value_and_grad`` of the unsplit model."""
        if precision not in self._references:
            loss, grads = self.reference_program(precision)(self.params, *self.batch)
            self._references[precision] = (float(loss), jax.device_get(grads))
        return self._references[precision]

    def train_program(self) -> Any:
        """One ``jax.jit`` of the training step (Adam) of the unsplit model, compiled:
        ``(params, opt_state, inputs, targets) -> (params, opt_state, loss)``."""
        if self._train is None:
            fn = reference_stages(self.m)
            cast = _bf16 if self.step_precision == "bf16" else (lambda p: p)
            optimizer = self.optimizer

            def one_jit(params: Any, state: Any, x: Any, t: Any) -> Any:
                loss, grads = jax.value_and_grad(lambda p: self.m.loss(fn(cast(p), x), t))(params)
                updates, state = optimizer.update(grads, state, params)
                return optax.apply_updates(params, updates), state, loss

            with _scope(self.step_precision), jax.default_device(self.device):
                state = jax.eval_shape(optimizer.init, self.params)
                self._train = jax.jit(one_jit).lower(self.params, state, *self.batch).compile()
        return self._train

    # -- compiling ahead -------------------------------------------------------------

    def needs(self, name: str) -> list[Ahead]:
        """The large programs check ``name`` runs."""

        def pipeline(v: Variant) -> list[Ahead]:
            return [Ahead("stage", v.precision, v, s) for s in range(self.schedule.num_stages)]

        p = self.step_precision
        if name in ("fp32", "bf16"):
            precision: Precision = "fp32" if name == "fp32" else "bf16"
            return [Ahead("reference", precision), *pipeline(Variant(precision))]
        if name == "step-time":
            # Its pipeline's step, one program, compiles as the check warms up.
            return [Ahead("train", p)]
        if name.startswith("recompute-"):
            mode: Any = name.removeprefix("recompute-")
            return [Ahead("reference", "fp32"), *pipeline(Variant("fp32", mode))]
        if name == "fused-attention":
            return [Ahead("reference", p), *pipeline(Variant(p, fused=True))]
        if name == "peak-memory":
            return pipeline(Variant("fp32"))
        return []  # hybrid: its own shapes and meshes, compiled when it runs

    def compile_ahead(self, names: Sequence[str], *, threads: int) -> int:
        """Compile the large programs of the checks ``names``, ``threads`` at a time; return
        how many. The stage programs go through XLA's memory analysis, so their compiled
        ``F`` and ``B`` land in the compilation cache that the pipelines' first steps read.
        One precision at a time, as :func:`_scope` sets it for the whole process."""
        jobs = list(dict.fromkeys(job for name in names for job in self.needs(name)))
        for precision in ("fp32", "bf16"):
            group = [job for job in jobs if job.precision == precision]
            with _scope(precision):
                for job in group:
                    if job.variant is not None:
                        self.programs(job.variant)  # traced here, one at a time: tracing shares the model
                # The whole-model programs first: they are the longest compiles.
                group.sort(key=lambda job: job.kind == "stage")
                with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
                    list(pool.map(self._compile, group))
        return len(jobs)

    def _compile(self, job: Ahead) -> None:
        if job.kind == "reference":
            self.reference_program(job.precision)
        elif job.kind == "train":
            self.train_program()
        else:
            assert job.variant is not None and job.stage is not None  # a stage job names both
            self.memory(job.variant, job.stage)

    # -- the checks ------------------------------------------------------------------

    def against_reference(self, name: str, v: Variant, tol: float) -> Row:
        ref_loss, ref_grads = self.reference(v.precision)
        loss, grads = self.gradients(v)
        err = _relative(grads, ref_grads)
        loss_err = abs(loss - ref_loss) / abs(ref_loss)
        ok = err < tol and loss_err < tol
        self.results[name] = {"grad_rel_error": err, "loss_rel_error": loss_err, "tolerance": tol}
        return Row(
            name, "ok" if ok else "FAIL", f"{err:.2e}", f"gradient L2 error (loss {loss_err:.1e}), tolerance {tol:g}"
        )

    def fp32(self) -> Row:
        return self.against_reference("fp32", Variant("fp32"), self.fp32_tol)

    def bf16(self) -> Row:
        return self.against_reference("bf16", Variant("bf16"), 2e-2)

    def step_time(self, *, rounds: int = 5) -> Row:
        """Median seconds of ``rounds`` steps each, after one that compiles what is left."""
        optimizer = self.optimizer
        pipe = self.pipeline(Variant(self.step_precision, fuse="loop"))
        one_jit = self.train_program()

        def timed(step: Callable[[], Any]) -> tuple[float, float]:
            """(median seconds of a step, the last step's loss)."""
            step()
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                _, loss = jax.block_until_ready(step())
                times.append(time.perf_counter() - start)
            return statistics.median(times), float(loss)

        # One program for the copy and the optimizer state, not one per leaf and operation.
        # Both steps donate what they hold, so each starts from a copy of the parameters.
        with jax.default_device(self.device):
            start = jax.jit(lambda p: [jax.tree_util.tree_map(jnp.copy, p), optimizer.init(p)])
            jit_held = start(self.params)
            held: list[Any] = [start(self.params)[0], None]

        def pipe_step() -> Any:
            held[0], held[1], loss = pipe.train_step(held[0], held[1], self.batch, optimizer=optimizer)
            pipe.block_until_ready()  # a step returns once it is queued; its time runs to its update's end
            return held[0], loss

        def jit_step() -> Any:
            jit_held[0], jit_held[1], loss = one_jit(jit_held[0], jit_held[1], *self.batch)
            return jit_held[0], loss

        with _scope(self.step_precision):
            (t_pipe, pipe_loss), (t_jit, jit_loss) = timed(pipe_step), timed(jit_step)
        # The same steps from the same parameters: the losses agree to the precision's tolerance.
        loss_err = abs(pipe_loss - jit_loss) / abs(jit_loss)
        tol = 2e-2 if self.step_precision == "bf16" else self.fp32_tol
        self.results["step_time"] = {
            "pipeline_s": t_pipe, "one_jit_s": t_jit, "ratio": t_pipe / t_jit, "loss_rel_error": loss_err,
        }  # fmt: skip
        return Row(
            "step-time",
            "ok" if loss_err < tol else "FAIL",
            f"{t_pipe / t_jit:.2f}x",
            f"{self.step_precision}, pipeline {t_pipe * 1e3:.1f} ms, one jax.jit {t_jit * 1e3:.1f} ms, "
            f"losses {loss_err:.1e} apart after {rounds + 1} steps",
        )

    def recompute(self, mode: RecomputeMode) -> Row:
        v = Variant("fp32", mode)
        _, ref_grads = self.reference("fp32")
        err = _relative(self.gradients(v)[1], ref_grads)
        kept = [self.memory(v, s).kept for s in range(self.schedule.num_stages)]
        predicted = self._planned_layer_bytes(mode) * self.size.layers_per_stage
        self.results[f"recompute_{mode}"] = {
            "grad_rel_error": err,
            "kept_bytes": kept,
            "planned_layer_bytes": predicted,
        }
        ok = err < self.fp32_tol
        return Row(
            f"recompute-{mode}", "ok" if ok else "FAIL", f"{err:.2e}",
            f"kept per microbatch {kept[0] / 2**20:.2f} MiB (stage 0), planner {predicted / 2**20:.2f} MiB for its layers",
        )  # fmt: skip

    def _planned_layer_bytes(self, mode: str) -> float:
        """The planner's activation bytes of one layer of these shapes per microbatch, as the
        executor's compiled fp32 stage keeps them (the ``pipedsl`` framework's count,
        :mod:`pipedsl.simulator.activations`). Without FlashAttention, as these checks run."""
        from pipedsl.simulator.hardware import Model, load_cluster
        from pipedsl.simulator.plan import Plan
        from pipedsl.simulator.transformer import Shapes

        z = self.size
        model = Model(
            name="accel-check", layers=2 * z.layers_per_stage, hidden=z.hidden, ffn_hidden=z.ffn, heads=z.heads,
            kv_heads=z.kv_heads, seq_len=z.seq, vocab=z.vocab, dtype_bytes=4, gated_ffn=True, biases=False,
            learned_positions=False, tied_embeddings=False, dropout=False,
        )  # fmt: skip
        plan = Plan(
            pp=2, microbatch_size=z.microbatch_size, global_batch=z.microbatches * z.microbatch_size, schedule="1f1b",
            recompute=mode, flash_attention=False, sequence_parallel=False, framework="pipedsl",
        )  # fmt: skip
        return Shapes(model, load_cluster("h200"), plan).layer_activation_bytes(plan.recompute)

    def fused_attention(self) -> Row:
        precision = self.step_precision
        v = Variant(precision, fused=True)
        _, ref_grads = self.reference(precision)
        err = _relative(self.gradients(v)[1], ref_grads)
        gpu = self.device.platform == "gpu"
        # cuDNN's kernel is a GPU's; elsewhere XLA writes the attention out itself.
        cudnn = False
        if gpu:
            with _scope(precision):
                hlo = self.programs(v)[0].compiled_hlo()
            cudnn = "cudnn" in (hlo["F"] + hlo["B"]).lower()
        tol = 2e-2 if precision == "bf16" else self.fp32_tol
        self.results["fused_attention"] = {"grad_rel_error": err, "cudnn": cudnn, "precision": precision}
        ok = err < tol and (cudnn or not gpu)
        kernel = "cuDNN's fused kernel" if cudnn else ("no cuDNN kernel" if gpu else "XLA's attention")
        return Row(
            "fused-attention", "ok" if ok else "FAIL", f"{err:.2e}", f"{precision}, {kernel}, against plain attention"
        )

    def peak_memory(self) -> Row:
        stats_before = self.device.memory_stats() or {}
        v = Variant("fp32")
        self.gradients(v)
        stats = self.device.memory_stats() or {}
        memories = [self.memory(v, s) for s in range(self.schedule.num_stages)]
        params = sum(m.params for m in memories)
        # Both stages on the device: parameters and their fp32 accumulators, and 1F1B's
        # in-flight microbatches (2 on stage 0, 1 on stage 1), plus a backward's scratch.
        inflight = (min(2, self.size.microbatches), 1)
        analysed = 2 * params + sum(m.kept * k for m, k in zip(memories, inflight, strict=True))
        analysed += max(m.backward_temp for m in memories)
        layer = self._planned_layer_bytes("none") * self.size.layers_per_stage
        planned = 2 * params + layer * sum(inflight)
        peak = stats.get("peak_bytes_in_use")
        self.results["peak_memory"] = {"peak_bytes_in_use": peak, "analysed_bytes": analysed, "planned_bytes": planned,
                                       "before_bytes_in_use": stats_before.get("bytes_in_use")}  # fmt: skip
        if peak is None:
            return Row(
                "peak-memory",
                "ok",
                "n/a",
                f"no device memory stats here; analysed {analysed / 2**20:.1f} MiB, planner {planned / 2**20:.1f} MiB",
            )
        return Row(
            "peak-memory", "ok", f"{peak / 2**20:.0f} MiB",
            f"device peak; compiled analysis {analysed / 2**20:.0f} MiB, planner {planned / 2**20:.0f} MiB (weights, gradients, 1F1B's activations)",
        )  # fmt: skip

    def hybrid(self) -> Row:
        n = len(self.devices)
        if n < 2:
            return Row("hybrid", "skip", "-", "one device: no dp x tp x pp plan")
        pp = 2
        tp = 2 if n >= 4 else 1
        dp = max(1, n // (pp * tp)) if n >= 8 else 1
        tp = min(tp, n // pp)
        m = self.m
        schedule = pipedsl.load(pipedsl.library_path("1f1b"), pp=pp, microbatches=self.size.microbatches)
        size = self.size.microbatches * self.size.microbatch_size * dp
        with jax.default_device(self.device):
            batch = m.batch(jax.random.PRNGKey(3), size)
        pipe = Pipeline(
            m.stages, loss=m.loss, schedule=schedule, param_specs=m.param_specs(self.params),
            devices=self.devices[: pp * dp * tp],
            options=RunOptions(dp=dp, tp=tp, recompute="selective", sequence_parallel=tp > 1),
        )  # fmt: skip
        with _scope("fp32"):
            _, ref_grads = _reference_program(m, self.params, batch, "fp32")(self.params, *batch)
            err = _relative(pipe.step(self.params, batch).grads, jax.device_get(ref_grads))
        self.results["hybrid"] = {"dp": dp, "tp": tp, "pp": pp, "grad_rel_error": err}
        ok = err < self.fp32_tol
        return Row(
            "hybrid", "ok" if ok else "FAIL", f"{err:.2e}", f"dp={dp} tp={tp} pp={pp}, selective, sequence parallel"
        )


CHECKS = (
    "fp32",
    "bf16",
    "step-time",
    "recompute-none",
    "recompute-selective",
    "recompute-full",
    "fused-attention",
    "peak-memory",
    "hybrid",
)
"""The checks, in the order they run."""


def _check(checks: Checks, name: str) -> Callable[[], Row]:
    """The method of ``checks`` that runs the check ``name`` (one of :data:`CHECKS`)."""
    if name.startswith("recompute-"):
        mode: Any = name.removeprefix("recompute-")
        return lambda: checks.recompute(mode)
    method: Callable[[], Row] = getattr(checks, name.replace("-", "_"))
    return method


@contextlib.contextmanager
def _compilation_cache() -> Iterator[None]:
    """JAX's persistent compilation cache in a folder of this run, every program in it:
    a program compiled ahead (or analysed) is read back, not compiled again, by the step
    that first runs it. Set before the first compile; the folder goes when the run ends."""
    with tempfile.TemporaryDirectory(prefix="accel_check-") as folder:
        jax.config.update("jax_compilation_cache_dir", folder)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        yield


def _timed(name: str, clock: CompileClock, run: Callable[[], Row]) -> Row:
    """``run()``'s row, with its seconds and the part of them spent compiling; a failure
    is printed and becomes an ``error`` row, so that the next check runs."""
    start, compiling = time.perf_counter(), clock.seconds
    try:
        row = run()
    except Exception as err:
        traceback.print_exc()
        row = Row(name, "error", "-", f"{type(err).__name__}: {err}".splitlines()[0][:200])
    row.seconds = time.perf_counter() - start
    row.compile_s = clock.seconds - compiling
    return row


def _print_row(r: Row, width: int) -> None:
    print(
        f"{r.check:<{width}}  {r.status:<6} {r.value:>10} {r.seconds:>6.1f} {r.compile_s:>8.1f}  {r.detail}", flush=True
    )


def _figures(line: dict[str, Any]) -> dict[str, Figure]:
    """The run as flat figures for ``bench/results``: the machine's platform and device,
    the whole run's seconds, and per check its result, seconds and main number."""
    figures: dict[str, Figure] = {k: line[k] for k in ("platform", "device_kind", "devices", "jax")}
    figures["total_s"] = line["seconds"]
    figures["compile_s"] = line["compile_seconds"]
    for name, status in line["checks"].items():
        key = name.replace("-", "_")
        figures[key] = status
        figures[f"{key}_s"] = line["times"][name]["seconds"]
        numbers = line["results"].get(key, {})
        for field_name in ("grad_rel_error", "ratio", "peak_bytes_in_use"):
            if isinstance(numbers.get(field_name), int | float):
                figures[f"{key}_{field_name}"] = numbers[field_name]
    return figures


def _run(names: Sequence[str], size: Size, devices: list[Any], *, threads: int) -> tuple[list[Row], Checks | None]:
    """Set up, compile ahead (with ``threads`` > 0) and run the checks ``names``, printing
    each row as it ends: the rows, and the checks (None when the set-up failed)."""
    clock = CompileClock()
    clock.listen()
    width = max(len(name) for name in ("compile-ahead", *names))
    print(f"\n{'check':<{width}}  {'result':<6} {'value':>10} {'s':>6} {'compile':>8}  detail", flush=True)
    made: list[Checks] = []

    def setup() -> Row:
        made.append(Checks(size, devices))
        return Row("setup", "ok", "-", "the model's parameters and a batch on the device")

    def ahead() -> Row:
        count = made[0].compile_ahead(names, threads=threads)
        return Row("compile-ahead", "ok", str(count), f"large programs, {threads} at a time")

    rows = [_timed("setup", clock, setup)]
    _print_row(rows[-1], width)
    if not made:
        return rows, None
    steps = [("compile-ahead", ahead)] if threads > 0 else []
    steps += [(name, _check(made[0], name)) for name in names]
    for name, run in steps:
        rows.append(_timed(name, clock, run))
        _print_row(rows[-1], width)
    return rows, made[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/accel_check/results.json", help="where to write the JSON line of results")
    parser.add_argument("--checks", default="", help="comma-separated names of the checks to run (default: all)")
    parser.add_argument(
        "--results", default=None, metavar="FOLDER",
        help="also append the run to FOLDER/accel_check.jsonl (bench/results keeps the project's)",
    )  # fmt: skip
    parser.add_argument(
        "--compile-threads", type=int, default=min(8, os.cpu_count() or 1),
        help="threads that compile the checks' large programs before they run (0: each as its check first runs it)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    # Named before anything is built, so that a misspelt check is refused at once.
    wanted = [c for c in args.checks.split(",") if c]
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; the checks are {', '.join(CHECKS)}")
    names = [c for c in CHECKS if not wanted or c in wanted]
    accelerators = [d for d in jax.devices() if d.platform in ACCELERATORS]
    devices = accelerators or jax.devices()
    note = cpu_fallback_note(jax.devices()[0].platform)
    if note:
        print(note)
    size = ACCELERATOR_SIZE if accelerators else TOY_SIZE
    kind = getattr(devices[0], "device_kind", devices[0].platform)
    print(f"accel_check: jax {jax.__version__}, {len(devices)} {devices[0].platform} device(s) ({kind}); model {size}")
    started = time.perf_counter()
    with _compilation_cache():
        rows, checks = _run(names, size, devices, threads=args.compile_threads)
    line = {
        "jax": jax.__version__,
        "platform": devices[0].platform,
        "device_kind": kind,
        "devices": len(devices),
        "seconds": round(time.perf_counter() - started, 1),
        "compile_seconds": round(sum(r.compile_s for r in rows), 1),
        "checks": {r.check: r.status for r in rows if r.check in CHECKS},
        "times": {r.check: {"seconds": round(r.seconds, 1), "compile_s": round(r.compile_s, 1)} for r in rows},
        "ray_imported": "ray" in sys.modules,
        "results": checks.results if checks is not None else {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(line, default=str) + "\n", encoding="utf-8")
    print(f"\nresults in {out} ({line['seconds']} s, {line['compile_seconds']} s of it compiling)")
    if args.results is not None:
        command = "python bench/accel_check.py" + (f" --checks {args.checks}" if args.checks else "")
        appended = append_result("accel_check", _figures(line), command=command, folder=args.results)
        print(f"appended to {appended}")
    return 0 if all(r.status in ("ok", "skip") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
