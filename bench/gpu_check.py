"""The executor's checks on this machine's accelerators: one GPU is enough.

Each check runs on its own and reports ``ok``, ``FAIL`` or ``error`` (an exception is
printed and the next check runs):

- ``fp32`` / ``bf16``: a 2-stage 1F1B pipeline of the Llama model, both stages sharing one
  device, against ``jax.value_and_grad`` of the unsplit model on it (bf16 against a bf16
  one-device step);
- ``step-time``: a training step (Adam) of the pipeline against one ``jax.jit`` of the same
  step, median seconds of a few steps each, and their ratio;
- ``recompute-<mode>``: gradients under each recompute mode against the reference, and the
  activation bytes the compiled forward keeps per microbatch (XLA's memory analysis)
  against the planner's Korthikanti count for the same shapes;
- ``fused-attention``: ``jax.nn.dot_product_attention`` (cuDNN on a GPU in bf16) against
  the written-out attention, and whether cuDNN's kernel is in the compiled program;
- ``peak-memory``: the device's peak bytes in use over a step against the compiled stage
  programs' analysis and the planner's count;
- ``hybrid``: with two or more devices, a dp x tp x pp plan over them against one device.

Prints one table and writes one JSON line of results (``--out``, default
``out/gpu_check/results.json``). On a machine without a GPU it runs the same checks at toy
sizes on 8 forced CPU devices (the CPU dry run of the tests). Needs neither Ray nor the
simulator's search: ``python bench/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedsl.executor.devices import cpu_fallback_note, request_devices

request_devices(8)  # CPU only, and only when JAX is not imported yet

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import pipedsl  # noqa: E402
from pipedsl.executor import Pipeline  # noqa: E402
from pipedsl.executor.models import BuiltinModel, llama, reference_stages  # noqa: E402


@dataclass(frozen=True, slots=True)
class Size:
    """The model and batch of the checks."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    seq: int
    vocab: int
    layers_per_stage: int
    microbatches: int
    microbatch_size: int


GPU_SIZE = Size(
    hidden=1024,
    ffn=2816,
    heads=16,
    kv_heads=4,
    seq=1024,
    vocab=8192,
    layers_per_stage=2,
    microbatches=4,
    microbatch_size=2,
)
TOY_SIZE = Size(
    hidden=32, ffn=64, heads=4, kv_heads=2, seq=16, vocab=64, layers_per_stage=1, microbatches=2, microbatch_size=2
)


@dataclass(slots=True)
class Row:
    check: str
    status: str
    value: str
    detail: str


def _model(size: Size, *, fused: bool = False, stages: int = 2) -> BuiltinModel:
    return llama(
        num_stages=stages, hidden=size.hidden, ffn_hidden=size.ffn, heads=size.heads, kv_heads=size.kv_heads,
        seq_len=size.seq, vocab=size.vocab, layers_per_stage=size.layers_per_stage, fused_attention=fused,
    )  # fmt: skip


def _bf16(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), tree)


def _reference(m: BuiltinModel, params: Any, batch: Any, precision: str) -> tuple[float, Any]:
    fn = reference_stages(m)
    cast = _bf16 if precision == "bf16" else (lambda p: p)
    loss, grads = jax.jit(jax.value_and_grad(lambda p, x, t: m.loss(fn(cast(p), x), t)))(params, *batch)
    return float(loss), grads


def _relative(actual: Any, expected: Any) -> float:
    """L2 distance over all leaves, over the norm of ``expected``."""
    a = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree_util.tree_leaves(jax.device_get(actual))])
    e = np.concatenate(
        [np.ravel(np.asarray(v, np.float64)) for v in jax.tree_util.tree_leaves(jax.device_get(expected))]
    )
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


class Checks:
    """Every check over one device (and, for ``hybrid``, all of them)."""

    def __init__(self, size: Size, devices: list[Any]) -> None:
        self.size = size
        self.devices = devices
        self.device = devices[0]
        self.schedule = pipedsl.load(pipedsl.library_path("1f1b"), pp=2, microbatches=size.microbatches)
        self.m = _model(size)
        key = jax.random.PRNGKey(0)
        with jax.default_device(self.device):
            self.params = self.m.init_stages(key)
            self.batch = self.m.batch(jax.random.fold_in(key, 1), size.microbatches * size.microbatch_size)
        self.results: dict[str, Any] = {}
        self.gpu = self.device.platform == "gpu"
        # fp32 on a GPU: full-precision matrix products (no TF32) for both sides.
        self.fp32_tol = 1e-4 if self.gpu else 1e-5

    def pipeline(self, m: BuiltinModel | None = None, **options: Any) -> Pipeline:
        m = m or self.m
        # Both pipeline devices on the one device: the stages share it.
        return Pipeline(m.stages, loss=m.loss, schedule=self.schedule, devices=[self.device, self.device], **options)

    def against_reference(self, name: str, precision: str, tol: float, **options: Any) -> Row:
        ref_loss, ref_grads = _reference(self.m, self.params, self.batch, precision)
        result = self.pipeline(precision=precision, **options).step(self.params, self.batch)
        err = _relative(result.grads, ref_grads)
        loss_err = abs(float(result.loss) - ref_loss) / abs(ref_loss)
        ok = err < tol and loss_err < tol
        self.results[name] = {"grad_rel_error": err, "loss_rel_error": loss_err, "tolerance": tol}
        return Row(
            name, "ok" if ok else "FAIL", f"{err:.2e}", f"gradient L2 error (loss {loss_err:.1e}), tolerance {tol:g}"
        )

    def fp32(self) -> Row:
        return self.against_reference("fp32", "fp32", self.fp32_tol)

    def bf16(self) -> Row:
        return self.against_reference("bf16", "bf16", 2e-2)

    def step_time(self) -> Row:
        optimizer = optax.adam(1e-4)
        pipe = self.pipeline(precision="bf16" if self.gpu else "fp32")
        fn = reference_stages(self.m)
        cast = _bf16 if self.gpu else (lambda p: p)

        @jax.jit
        def one_jit(params: Any, state: Any, x: Any, t: Any) -> Any:
            loss, grads = jax.value_and_grad(lambda p: self.m.loss(fn(cast(p), x), t))(params)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        def timed(step: Callable[[], Any], rounds: int = 5) -> float:
            step()  # compile
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                jax.block_until_ready(step())
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        held: list[Any] = [self.params, None]

        def pipe_step() -> Any:
            held[0], held[1], loss = pipe.train_step(held[0], held[1], self.batch, optimizer=optimizer)
            return held[0], loss

        with jax.default_device(self.device):
            jit_held = [jax.tree_util.tree_map(jnp.copy, self.params), optimizer.init(self.params)]

        def jit_step() -> Any:
            jit_held[0], jit_held[1], loss = one_jit(jit_held[0], jit_held[1], *self.batch)
            return jit_held[0], loss

        t_pipe, t_jit = timed(pipe_step), timed(jit_step)
        self.results["step_time"] = {"pipeline_s": t_pipe, "one_jit_s": t_jit, "ratio": t_pipe / t_jit}
        return Row(
            "step-time",
            "ok",
            f"{t_pipe / t_jit:.2f}x",
            f"pipeline {t_pipe * 1e3:.1f} ms, one jax.jit {t_jit * 1e3:.1f} ms",
        )

    def recompute(self, mode: str) -> Row:
        ref_loss, ref_grads = _reference(self.m, self.params, self.batch, "fp32")
        pipe = self.pipeline(recompute=mode)
        err = _relative(pipe.step(self.params, self.batch).grads, ref_grads)
        kept = [p.memory().kept for p in pipe.compile(self.params, self.batch)]
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
        """The planner's activation bytes of one layer of these shapes per microbatch
        (Korthikanti et al.'s count of 16-bit values, :mod:`pipedsl.simulator.transformer`),
        doubled: these runs keep fp32 values. Without FlashAttention, as these checks run."""
        from pipedsl.simulator.hardware import Model, load_cluster
        from pipedsl.simulator.plan import Plan
        from pipedsl.simulator.transformer import Shapes

        z = self.size
        model = Model(
            name="gpu-check", layers=2 * z.layers_per_stage, hidden=z.hidden, ffn_hidden=z.ffn, heads=z.heads,
            kv_heads=z.kv_heads, seq_len=z.seq, vocab=z.vocab, dtype_bytes=2, gated_ffn=True, biases=False,
            learned_positions=False, tied_embeddings=False,
        )  # fmt: skip
        plan = Plan(
            pp=2, microbatch_size=z.microbatch_size, global_batch=z.microbatches * z.microbatch_size, schedule="1f1b",
            recompute=mode, flash_attention=False, sequence_parallel=False,
        )  # fmt: skip
        return 2 * Shapes(model, load_cluster("h200"), plan).layer_activation_bytes(plan.recompute)

    def fused_attention(self) -> Row:
        precision = "bf16" if self.gpu else "fp32"
        fused = _model(self.size, fused=True)
        ref_loss, ref_grads = _reference(self.m, self.params, self.batch, precision)
        pipe = self.pipeline(fused, precision=precision)
        err = _relative(pipe.step(self.params, self.batch).grads, ref_grads)
        hlo = pipe.compile(self.params, self.batch)[0].compiled_hlo()
        cudnn = "cudnn" in (hlo["F"] + hlo["B"]).lower()
        tol = 2e-2 if precision == "bf16" else self.fp32_tol
        self.results["fused_attention"] = {"grad_rel_error": err, "cudnn": cudnn, "precision": precision}
        ok = err < tol and (cudnn or not self.gpu)
        kernel = "cuDNN's fused kernel" if cudnn else "XLA's attention (no cuDNN kernel)"
        return Row(
            "fused-attention", "ok" if ok else "FAIL", f"{err:.2e}", f"{precision}, {kernel}, against plain attention"
        )

    def peak_memory(self) -> Row:
        stats_before = self.device.memory_stats() or {}
        pipe = self.pipeline()
        jax.block_until_ready(pipe.step(self.params, self.batch).grads)
        stats = self.device.memory_stats() or {}
        memories = [p.memory() for p in pipe.compile(self.params, self.batch)]
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
        ref_loss, ref_grads = _reference(m, self.params, batch, "fp32")
        pipe = Pipeline(
            m.stages, loss=m.loss, schedule=schedule, dp=dp, tp=tp, param_specs=m.param_specs(self.params),
            devices=self.devices[: pp * dp * tp], recompute="selective", sequence_parallel=tp > 1,
        )  # fmt: skip
        err = _relative(pipe.step(self.params, batch).grads, ref_grads)
        self.results["hybrid"] = {"dp": dp, "tp": tp, "pp": pp, "grad_rel_error": err}
        ok = err < self.fp32_tol
        return Row(
            "hybrid", "ok" if ok else "FAIL", f"{err:.2e}", f"dp={dp} tp={tp} pp={pp}, selective, sequence parallel"
        )


def _matmul_precision(precision: str | None) -> Any:
    """``jax.default_matmul_precision(precision)``, or nothing where this JAX lacks it."""
    scope = getattr(jax, "default_matmul_precision", None)
    return scope(precision) if scope is not None and precision is not None else contextlib.nullcontext()


_FULL_PRECISION = {"fp32", "recompute-none", "recompute-selective", "recompute-full", "peak-memory", "hybrid"}


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
        mode = name.removeprefix("recompute-")
        return lambda: checks.recompute(mode)
    method: Callable[[], Row] = getattr(checks, name.replace("-", "_"))
    return method


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/gpu_check/results.json", help="where to write the JSON line of results")
    parser.add_argument("--checks", default="", help="comma-separated names of the checks to run (default: all)")
    args = parser.parse_args(argv)
    # Named before anything is built, so that a misspelt check is refused at once.
    wanted = [c for c in args.checks.split(",") if c]
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; the checks are {', '.join(CHECKS)}")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    devices = gpus or jax.devices()
    note = cpu_fallback_note(jax.devices()[0].platform)
    if note:
        print(note)
    size = GPU_SIZE if gpus else TOY_SIZE
    kind = getattr(devices[0], "device_kind", devices[0].platform)
    print(f"gpu_check: jax {jax.__version__}, {len(devices)} {devices[0].platform} device(s) ({kind}); model {size}")
    started = time.perf_counter()
    rows: list[Row] = []
    try:
        checks = Checks(size, devices)
    except Exception as err:
        traceback.print_exc()
        rows.append(Row("setup", "error", "-", f"{type(err).__name__}: {err}"[:200]))
        checks = None
    if checks is not None:
        for name in CHECKS:
            if wanted and name not in wanted:
                continue
            check = _check(checks, name)
            start = time.perf_counter()
            try:
                # The fp32 checks' matrix products at full precision (no TF32 on GPUs), on both
                # sides of each comparison; the bf16 ones (and the timed step) as they run.
                with _matmul_precision("highest" if name in _FULL_PRECISION else None):
                    row = check()
            except Exception as err:  # a failing check is reported and the next one runs
                traceback.print_exc()
                row = Row(name, "error", "-", f"{type(err).__name__}: {err}".splitlines()[0][:200])
            row.detail += f" [{time.perf_counter() - start:.0f} s]"
            rows.append(row)
            print(f"  {row.check:<20} {row.status:<5} {row.value:>10}  {row.detail}", flush=True)
    print()
    width = max(len(r.check) for r in rows)
    print(f"{'check':<{width}}  {'result':<6} {'value':>10}  detail")
    for r in rows:
        print(f"{r.check:<{width}}  {r.status:<6} {r.value:>10}  {r.detail}")
    line = {
        "jax": jax.__version__,
        "platform": devices[0].platform,
        "device_kind": kind,
        "devices": len(devices),
        "seconds": round(time.perf_counter() - started, 1),
        "checks": {r.check: r.status for r in rows},
        "ray_imported": "ray" in sys.modules,
        "results": checks.results if checks is not None else {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(line, default=str) + "\n", encoding="utf-8")
    print(f"\nresults in {out} ({line['seconds']} s)")
    return 0 if all(r.status in ("ok", "skip") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
