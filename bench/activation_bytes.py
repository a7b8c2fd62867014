"""What a transformer layer keeps for its backward, per microbatch: the planner's count
against the compiled stage programs', on this machine's first device.

For the built-in Llama and GPT blocks, in fp32 and bf16, under each recompute mode
(``none``, ``selective``, ``full`` and the named remat policies ``save_dots``,
``save_qkv_proj``, ``save_mlp_inputs``) and with written-out or fused attention, it compiles the
forward of the middle stage of a 3-stage pipeline (no embedding, no head: only its layers)
and reads what XLA's memory analysis says it keeps for the backward
(:meth:`pipedsl.executor.stages.stage_program.StageProgram.kept`, which compiles only the
forward), per layer, against
the planner's bytes per layer and microbatch under the ``pipedsl`` framework
(:meth:`pipedsl.simulator.transformer.Shapes.layer_activation_bytes`). Fused attention off
a GPU is ``jax.nn.dot_product_attention``'s XLA implementation, which writes its scores out
and keeps them in fp32: no FlashAttention to the planner, and ``Plan.fp32_scores``. Under ``full`` recomputation the stage is one checkpoint: its forward keeps
nothing of its own (its input is kept by reference), and the planner counts that input;
under a named policy each block is one checkpoint, which keeps its input and what the policy
saves, the first block's input being the stage's (kept by reference).

On an accelerator the blocks are the accelerator check's (hidden 1024, FFN 2816 for Llama
and 4096 for GPT, 16 heads and 4 KV heads, 1024 tokens, 2 sequences a microbatch, 2 layers
a stage); on CPU a toy of the same form (``--size real`` forces the large one). Per schedule (``1f1b``, ``interleaved_1f1b``, ``zb_h1``, ``zb_h2``, ``zbv``), the same
blocks cut into four stages (the embedding on the first, the head on the last), compiled once
and shared by every schedule: each device's peak of residual bytes under the schedule's
lowered program, from what the compiled ``F`` keeps and what the compiled ``I`` leaves for
``W`` (:func:`pipedsl.executor.stages.held.peak_held_bytes`), against the planner's peak
(:meth:`pipedsl.simulator.pipelines.Pipelines.peak_residual_bytes` of the ``pipedsl``
framework's bytes per stage, :func:`pipedsl.simulator.stages.stage_residual` and
:func:`~pipedsl.simulator.stages.stage_weight_residual`), the fullest device's of each.
Nothing is run, only compiled. Prints tables and appends the run to
``bench/results/activation_bytes.jsonl`` (or ``$PIPEDSL_RESULTS_DIR``) with the platform
and device kind; exits 1 where a case is more than 10% off.

    python bench/activation_bytes.py [--size auto|real|toy] [--kinds llama,gpt] [--only layers|schedules] [--no-record]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

STAGES = 3
"""Stages of the pipeline whose middle stage is compiled (it holds neither embedding nor head)."""
TOLERANCE = 0.10
"""The largest relative difference between the planner's bytes and the compiled programs'."""


@dataclass(frozen=True, slots=True)
class Size:
    """The blocks' shapes: widths in elements, ``seq`` in tokens, ``microbatch`` in sequences."""

    hidden: int
    llama_ffn: int
    heads: int
    kv_heads: int
    seq: int
    vocab: int
    layers: int
    microbatch: int


REAL = Size(hidden=1024, llama_ffn=2816, heads=16, kv_heads=4, seq=1024, vocab=8192, layers=2, microbatch=2)
TOY = Size(hidden=64, llama_ffn=128, heads=4, kv_heads=2, seq=32, vocab=32, layers=2, microbatch=2)


@dataclass(frozen=True, slots=True)
class Case:
    """One block, precision, recompute mode and attention."""

    kind: str
    precision: str
    recompute: str
    fused: bool

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.precision}-{self.recompute}" + ("-fused" if self.fused else "")


POLICIES = ("save_dots", "save_qkv_proj", "save_mlp_inputs")
"""The named remat policies, each block checkpointed with what it saves."""

CASES = tuple(
    Case(kind, precision, recompute, fused)
    for kind in ("llama", "gpt")
    for precision in ("fp32", "bf16")
    for recompute, fused in (
        ("none", False), ("none", True), ("selective", False), ("full", False), *((p, False) for p in POLICIES),
    )
)  # fmt: skip


SCHEDULE_STAGES = 4
"""Stages of the pipeline every schedule runs: 4 devices of one stage, or 2 of two."""
MICROBATCHES = 8
"""Microbatches of every schedule's step."""
SCHEDULES = (("1f1b", 4, 1), ("interleaved_1f1b", 2, 2), ("zb_h1", 4, 1), ("zb_h2", 4, 1), ("zbv", 2, 2))
"""(schedule, pp, vpp): each runs :data:`SCHEDULE_STAGES` stages."""
SCHEDULE_CASES = tuple(
    Case(kind, precision, "none", False) for kind in ("llama", "gpt") for precision in ("fp32", "bf16")
)
"""The blocks and precisions priced per schedule."""


def _model(size: Size, case: Case, stages: int) -> Any:
    """The planner's model of ``case``'s block over ``stages`` stages of ``size.layers`` layers."""
    from pipedsl.simulator.hardware import Model

    llama = case.kind == "llama"
    return Model(
        name=case.kind, layers=stages * size.layers, hidden=size.hidden,
        ffn_hidden=size.llama_ffn if llama else 4 * size.hidden, heads=size.heads,
        kv_heads=size.kv_heads if llama else None, seq_len=size.seq, vocab=size.vocab,
        dtype_bytes=4 if case.precision == "fp32" else 2, gated_ffn=llama, biases=not llama,
        learned_positions=not llama, tied_embeddings=False, dropout=False,
    )  # fmt: skip


def planned_layer_bytes(size: Size, case: Case) -> float:
    """The planner's bytes of one layer for one microbatch (the ``pipedsl`` framework's count)."""
    from pipedsl.simulator.hardware import load_cluster
    from pipedsl.simulator.plan import Plan
    from pipedsl.simulator.transformer import Shapes

    model = _model(size, case, STAGES)
    plan = Plan(
        pp=STAGES, microbatch_size=size.microbatch, global_batch=size.microbatch * STAGES, schedule="1f1b",
        recompute=case.recompute, flash_attention=False, fp32_scores=case.fused, framework="pipedsl",
    )  # fmt: skip
    return Shapes(model, load_cluster("h200"), plan).layer_activation_bytes(plan.recompute)


def compiled_layer_bytes(size: Size, case: Case, device: Any) -> float:
    """What the compiled forward of the middle stage keeps for its backward, per layer and
    microbatch, every pipeline device on ``device``."""
    return compiled_stages(size, case, device, STAGES)[1].kept() / size.layers


def compiled_stages(size: Size, case: Case, device: Any, stages: int) -> tuple[Any, ...]:
    """The compiled stage programs of ``case``'s block cut into ``stages`` stages, every
    pipeline device on ``device``."""
    import jax

    from pipedsl.executor import Pipeline, RunOptions
    from pipedsl.executor.models import llama, transformer
    from pipedsl.library import library_path, load

    if case.kind == "llama":
        m = llama(
            num_stages=stages, hidden=size.hidden, ffn_hidden=size.llama_ffn, heads=size.heads,
            kv_heads=size.kv_heads, seq_len=size.seq, vocab=size.vocab, layers_per_stage=size.layers,
            fused_attention=case.fused,
        )  # fmt: skip
    else:
        m = transformer(
            num_stages=stages, vocab=size.vocab, dim=size.hidden, heads=size.heads, seq=size.seq,
            layers_per_stage=size.layers, fused_attention=case.fused,
        )  # fmt: skip
    schedule = load(library_path("1f1b"), pp=stages, microbatches=stages)
    with jax.default_device(device):
        params = m.init_stages(jax.random.PRNGKey(0))
        batch = m.batch(jax.random.PRNGKey(1), size.microbatch * stages)
    pipe = Pipeline(
        m.stages, loss=m.loss, schedule=schedule, devices=[device] * schedule.num_devices,
        options=RunOptions(recompute=case.recompute, precision=case.precision),  # type: ignore[arg-type]
    )  # fmt: skip
    try:
        return pipe.compile(params, batch)
    finally:
        pipe.close()


def compiled_schedule_peaks(programs: tuple[Any, ...], schedule: str, pp: int, vpp: int) -> tuple[int, ...]:
    """Per device, the executor's peak of residual bytes under ``schedule`` (``pp`` devices,
    ``vpp`` stages each) from the compiled stage ``programs``."""
    from pipedsl import Policy, synthesize
    from pipedsl.executor.stages.held import peak_held_bytes
    from pipedsl.library import library_path, load, parameters
    from pipedsl.program import lower
    from pipedsl.simulator.costs import CostModel

    path = library_path(schedule)
    given = {"pp": pp, "microbatches": MICROBATCHES} | ({"vpp": vpp} if "vpp" in parameters(path) else {})
    loaded = load(path, **given)
    # A policy's order is synthesised against the default costs, as the planner's is.
    order = synthesize(loaded, CostModel()) if isinstance(loaded, Policy) else loaded
    return peak_held_bytes(lower(order), dict(enumerate(programs)))


def planned_schedule_peaks(size: Size, case: Case, schedule: str, pp: int, vpp: int) -> tuple[int, ...]:
    """Per device, the planner's peak of residual bytes under ``schedule`` for ``case``'s
    block cut into :data:`SCHEDULE_STAGES` stages (the ``pipedsl`` framework's bytes)."""
    from pipedsl.simulator.hardware import load_cluster
    from pipedsl.simulator.pipelines import Pipelines
    from pipedsl.simulator.plan import Plan
    from pipedsl.simulator.stages import split_layers, stage_residual, stage_weight_residual
    from pipedsl.simulator.transformer import Shapes

    model = _model(size, case, SCHEDULE_STAGES)
    plan = Plan(
        pp=pp, vpp=vpp, microbatch_size=size.microbatch, global_batch=size.microbatch * MICROBATCHES,
        schedule=schedule, recompute=case.recompute, flash_attention=False, fp32_scores=case.fused,
        framework="pipedsl",
    )  # fmt: skip
    shapes = Shapes(model, load_cluster("h200"), plan)
    layers = split_layers(model, SCHEDULE_STAGES, None)
    residual = stage_residual(shapes, layers)
    pipelines = Pipelines()
    return pipelines.peak_residual_bytes(pipelines.key(plan), residual, stage_weight_residual(shapes, layers, residual))


def error(compiled: float, planned: float, case: Case, size: Size) -> float:
    """The planner's bytes over the compiled ones, less 1. Under ``full`` recomputation the
    compiled forward keeps nothing and the planner counts the stage's input per layer:
    compared as the input's bytes against that count. Under a named policy each block keeps
    its input, the first block's being the stage's, kept by reference (not in the compiled
    forward's outputs): the compiled bytes per layer are counted with that input's share."""
    kept_input = size.microbatch * size.seq * size.hidden * (4 if case.precision == "fp32" else 2)
    if case.recompute == "full":
        return planned / kept_input - 1 if compiled == 0 else float("inf")
    if case.recompute in POLICIES:
        return planned / (compiled + kept_input / size.layers) - 1
    return planned / compiled - 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("auto", "real", "toy"), default="auto", help="real on accelerators")
    parser.add_argument("--kinds", default="llama,gpt", help="comma-separated blocks: llama, gpt (default both)")
    parser.add_argument("--only", choices=("layers", "schedules"), help="one of the two tables (default both)")
    parser.add_argument("--no-record", action="store_true", help="print only, append nothing to bench/results")
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - {"llama", "gpt"}:
        parser.error(f"--kinds takes llama and gpt, got {args.kinds!r}")

    import jax

    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    size = REAL if args.size == "real" or (args.size == "auto" and accelerator) else TOY
    kind_name = str(getattr(device, "device_kind", device.platform))
    print(f"jax {jax.__version__}, {device.platform} ({kind_name}), {'real' if size is REAL else 'toy'} size: {size}")
    print(f"\n{'case':<28} {'compiled MiB':>13} {'planned MiB':>12} {'error':>8}", flush=True)
    figures: dict[str, Any] = {
        "platform": device.platform,
        "device_kind": kind_name,
        "size": "real" if size is REAL else "toy",
    }
    off = 0
    for case in (c for c in CASES if c.kind in kinds and args.only != "schedules"):
        compiled, planned = compiled_layer_bytes(size, case, device), planned_layer_bytes(size, case)
        err = error(compiled, planned, case, size)
        off += abs(err) > TOLERANCE
        figures |= {
            f"{case.name}_compiled_bytes": compiled,
            f"{case.name}_planned_bytes": planned,
            f"{case.name}_error": err,
        }
        print(f"{case.name:<28} {compiled / 2**20:13.2f} {planned / 2**20:12.2f} {err:+8.1%}", flush=True)
    if args.only != "schedules":
        print(f"\n{off} case(s) more than {TOLERANCE:.0%} off (full: the planner's count against the stage's input)")
    if args.only != "layers":
        print(
            f"\n{'schedule: fullest device':<36} {'compiled MiB':>13} {'planned MiB':>12} {'error':>8} {'worst device':>13}"
        )
        for case in (c for c in SCHEDULE_CASES if c.kind in kinds):
            programs = compiled_stages(size, case, device, SCHEDULE_STAGES)
            for schedule, pp, vpp in SCHEDULES:
                compiled_peaks = compiled_schedule_peaks(programs, schedule, pp, vpp)
                planned_peaks = planned_schedule_peaks(size, case, schedule, pp, vpp)
                compiled, planned = max(compiled_peaks), max(planned_peaks)
                err = planned / compiled - 1
                worst = max((p / c - 1 for p, c in zip(planned_peaks, compiled_peaks, strict=True)), key=abs)
                off += abs(err) > TOLERANCE or abs(worst) > TOLERANCE
                name = f"{case.name}-{schedule}"
                figures |= {
                    f"{name}_compiled_peak": compiled,
                    f"{name}_planned_peak": planned,
                    f"{name}_peak_error": err,
                    f"{name}_worst_device_error": worst,
                }
                print(
                    f"{name:<36} {compiled / 2**20:13.3f} {planned / 2**20:12.3f} {err:+8.1%} {worst:+13.1%}",
                    flush=True,
                )
        print(f"\n{off} case(s) more than {TOLERANCE:.0%} off in all")
    if not args.no_record:
        from timing import record

        record("activation_bytes", figures)
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
