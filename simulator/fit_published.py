"""The estimator against published training runs, and the one fit of its compute model.

``data/published_runs*.csv`` hold measured iteration times (or throughputs) of training
runs with their exact configurations; ``data/README.md`` cites each source. Each row is
marked ``calibrate`` (used to fit the cluster's compute parameters) or ``validate`` (only
reported). :func:`fit` picks ``matmul_efficiency``, ``matmul_half_flops`` and
``kernel_launch_s`` once per GPU type (:func:`gpu_type`; the presets of one chip share
them) on the calibration rows of Megatron-LM runs alone (a row of another framework
calibrates that framework's profile, :func:`fit_framework`), from a fixed grid (:data:`GRID`), minimising their
mean absolute percentage error (the calibration's fitter,
:func:`~pipedsl.simulator.calibration.fitter.grid_search`); nothing is fitted per run. Run ``python -m pipedsl.simulator.fit_published`` to refit, print the table and
write ``data/ACCURACY.md``; ``--check`` evaluates the presets as they are.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipedsl.simulator.calibration.fitter import Step, grid_search
from pipedsl.simulator.calibration.report import Measured, Report, Reproduced
from pipedsl.simulator.collectives import group_of
from pipedsl.simulator.estimate import estimate
from pipedsl.simulator.flops import FlopCount, step_flops
from pipedsl.simulator.frameworks import DEFAULT_FRAMEWORK, LAYER_GRID, Framework, default_framework, framework
from pipedsl.simulator.hardware import Cluster, Model, load_cluster
from pipedsl.simulator.memory import Memory
from pipedsl.simulator.pipelines import Pipelines
from pipedsl.simulator.plan import ContextExchange, Plan, Recompute

__all__ = [
    "DATA",
    "Run",
    "Result",
    "GRID",
    "K_FILL_GRID",
    "load_runs",
    "evaluate",
    "run_cluster",
    "fit",
    "fit_report",
    "fit_network",
    "fit_framework",
    "HELD_OUT",
    "HELD_OUT_GPU",
    "TPU_RUNS",
    "NETWORK_GRID",
    "TORUS_NETWORK_GRID",
    "gpu_type",
    "regimes",
    "accuracy_markdown",
    "main",
]

DATA = Path(__file__).resolve().parent.parent / "data"
"""The folder of published runs (``data/`` at the repository root)."""

GRID = {
    "matmul_efficiency": tuple(round(0.50 + 0.02 * i, 2) for i in range(25)),
    "matmul_half_flops": (0.0, 1e9, 3e9, 1e10, 2e10, 4e10),
    "elementwise_traffic": (1.0, 0.75, 0.5, 0.25),
    "kernel_launch_s": (0.0, 5e-6, 1e-5, 2e-5),
}
"""The values :func:`fit` tries for each compute parameter."""

K_FILL_GRID = {"matmul_k_fill": (0.0, 128.0, 256.0, 512.0, 1024.0)}
"""What :func:`fit` tries, with the compute parameters, for a GPU whose ``matmul_units`` are
given: an output tile's fixed work in units of the contraction's length
(:func:`~pipedsl.simulator.transformer.tile_efficiency`)."""

NETWORK_GRID = {
    "spine_latency_s": (0.0, 1e-5, 3e-5),
    "spine_efficiency": (1.0, 0.8),
    "straggler_cv": (0.0, 0.0025, 0.005, 0.01),
}
"""The values :func:`fit_network` tries for the network tiers and the stragglers
(:mod:`~pipedsl.simulator.network`), after the compute model is fitted."""

TORUS_NETWORK_GRID = {"slice_jitter_s": (0.0, 2e-3, 5e-3, 10e-3, 15e-3, 20e-3, 25e-3, 30e-3, 40e-3)}
"""What :func:`fit_network` tries on a TPU cluster, whose slices have no leaf and spine
tiers: the spread of a slice's time between two meetings of the slices, at which a
multi-slice step waits for the slowest (:func:`~pipedsl.simulator.network.slice_wait_s`)."""

_COUNTS = (
    "layers",
    "hidden",
    "ffn_hidden",
    "heads",
    "seq_len",
    "vocab",
    "gpus",
    "dp",
    "tp",
    "pp",
    "vpp",
    "microbatch_size",
    "global_batch",
)


@dataclass(frozen=True, slots=True)
class Run:
    """One published run: its model, plan, cluster preset, per-stage layers (None for an
    even split), measured seconds per iteration and whether it calibrates."""

    name: str
    source: str
    role: str
    cluster: str
    model: Model
    plan: Plan
    stage_layers: tuple[int, ...] | None
    measured_s: float
    slices: int = 1


@dataclass(frozen=True, slots=True)
class Result:
    """A run with its predicted seconds per iteration; ``error`` is (predicted − measured) / measured."""

    run: Run
    predicted_s: float
    fits: bool

    @property
    def error(self) -> float:
        return (self.predicted_s - self.run.measured_s) / self.run.measured_s


def _measured_seconds(row: dict[str, str], model: Model, plan: Plan) -> float:
    """Seconds per iteration from the reported metric.

    ``tflops_per_gpu`` uses Narayanan et al.'s equation (3), which counts the recomputed
    forward: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per iteration;
    ``palm_tflops_per_gpu`` PaLM's count, (6·N + 12·l·h·s) per token
    (:mod:`~pipedsl.simulator.flops`); ``samples_per_gpu_per_s`` is global batch /
    (GPUs × rate); ``maxtext_mfu_percent`` MaxText's MFU of the chip's peak, of its count
    of FLOPs per chip and step (its ``calculate_training_tflops``: 6·N per token plus
    causal attention's 6·L·heads·head_dim·s per token, N every parameter).
    """
    reported = float(row["reported"])
    metric = row["metric"]
    if metric == "iteration_time_s":
        return reported
    if metric == "maxtext_mfu_percent":
        tokens = plan.global_batch * model.seq_len / plan.gpus
        flops = tokens * (6 * model.num_params + 6 * model.layers * model.q_width * model.seq_len)
        return flops / (reported / 100 * load_cluster(row["cluster"]).peak_flops)
    if metric == "palm_tflops_per_gpu":
        return step_flops(model, plan, FlopCount.PALM) / (plan.gpus * reported * 1e12)
    if metric == "tflops_per_gpu":
        b, s, l, h, v = plan.global_batch, model.seq_len, model.layers, model.hidden, model.vocab
        flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        return flops / (plan.gpus * reported * 1e12)
    if metric == "samples_per_gpu_per_s":
        return plan.global_batch / (plan.gpus * reported)
    raise ValueError(f"{row['run']}: unknown metric {metric!r}")


def _flag(row: dict[str, str], column: str, default: str = "true") -> bool:
    """An optional true/false column; empty or absent means ``default`` (for the model's
    shape the GPT default, true: biases and LayerNorm, learned positions, a tied
    embedding, dropout; a plain feed-forward block, ``gated_ffn`` false)."""
    value = row.get(column) or default
    if value not in ("true", "false"):
        raise ValueError(f"{row['run']}: {column} must be true or false, got {value!r}")
    return value == "true"


def _run(row: dict[str, str]) -> Run:
    n = {k: int(row[k]) for k in _COUNTS}
    model = Model(
        name=row["run"],
        layers=n["layers"],
        hidden=n["hidden"],
        ffn_hidden=n["ffn_hidden"],
        heads=n["heads"],
        kv_heads=int(row.get("kv_heads") or n["heads"]),
        seq_len=n["seq_len"],
        vocab=n["vocab"],
        biases=_flag(row, "biases"),
        learned_positions=_flag(row, "learned_positions"),
        tied_embeddings=_flag(row, "tied_embeddings"),
        gated_ffn=_flag(row, "gated_ffn", "false"),
        dropout=_flag(row, "dropout"),
        head_dim=int(row.get("head_dim") or 0) or None,
        parallel_block=_flag(row, "parallel_block", "false"),
        activation=row.get("activation") or "gelu",
        fp32_logits=_flag(row, "fp32_logits"),
        param_bytes=int(row.get("param_bytes") or 0) or None,
    )
    plan = Plan(
        dp=n["dp"],
        fsdp=int(row.get("fsdp") or 0) or None,
        tp=n["tp"],
        pp=n["pp"],
        vpp=n["vpp"],
        microbatch_size=n["microbatch_size"],
        global_batch=n["global_batch"],
        recompute=Recompute(row["recompute"]),
        sequence_parallel=row["sequence_parallel"] == "true",
        flash_attention=row["flash_attention"] == "true",
        dp_overlap=float(row["dp_overlap"]),
        tp_overlap=float(row.get("tp_overlap") or 0),
        schedule=row["schedule"] or None,
        reduce_bytes=int(row.get("reduce_bytes") or 4),
        zero=int(row.get("zero") or 0),
        cp=int(row.get("cp") or 1),
        cp_exchange=ContextExchange(row.get("cp_exchange") or "ring"),
        reduce_once=_flag(row, "reduce_once", "false"),
        reshard_after_forward=_flag(row, "reshard_after_forward"),
        framework=row.get("framework") or default_framework(load_cluster(row["cluster"])),
    )
    if plan.gpus != n["gpus"]:
        raise ValueError(f"{row['run']}: dp × tp × cp × pp = {plan.gpus}, but the row says {n['gpus']} GPUs")
    if row["role"] not in ("calibrate", "validate"):
        raise ValueError(f"{row['run']}: role must be calibrate or validate, got {row['role']!r}")
    layers = tuple(int(x) for x in row["stage_layers"].split()) or None
    return Run(
        row["run"],
        row["source"],
        row["role"],
        row["cluster"],
        model,
        plan,
        layers,
        _measured_seconds(row, model, plan),
        slices=int(row.get("slices") or 1),
    )


HELD_OUT = "llama3_*.csv"
"""Published runs kept out of the tables and the fit altogether: Llama 3 405B's, a check of
the estimator on a run nothing was fitted on, whose memory the estimator does not find
fitting (``ACCURACY.md`` reports them apart; data/README.md says why)."""

TPU_RUNS = "tpu_runs*.csv"
"""Published TPU runs (MaxText on v5e and v5p slices): their ``calibrate`` rows fit each
chip's compute model and the spread of its slices' step times, their ``validate`` rows are
held out; ``ACCURACY.md`` reports them in a section of their own."""

HELD_OUT_GPU = "heldout_runs*.csv"
"""Published GPU runs held out of every fit (every row ``validate``), added after the GPU
fits and reported apart in ``ACCURACY.md``."""


def load_runs(folder: Path = DATA, pattern: str = "published_runs*.csv") -> list[Run]:
    """Every row of the files matching ``pattern`` in ``folder``, in file order."""
    runs: list[Run] = []
    for path in sorted(folder.glob(pattern)):
        with path.open(newline="") as handle:
            runs.extend(_run(row) for row in csv.DictReader(handle))
    return runs


def evaluate(runs: Iterable[Run], clusters: dict[str, Cluster], pipelines: Pipelines | None = None) -> list[Result]:
    """Predict every run on its cluster (``clusters`` maps preset names to descriptions)."""
    pipelines = pipelines if pipelines is not None else Pipelines(keep_simulations=False)
    results = []
    for run in runs:
        predicted = estimate(
            run.model, run_cluster(run, clusters), run.plan, pipelines=pipelines, stage_layers=run.stage_layers
        )
        results.append(Result(run, predicted.step_time_s, predicted.fits))
    return results


def run_cluster(run: Run, clusters: dict[str, Cluster]) -> Cluster:
    """The cluster ``run`` ran on: its preset from ``clusters``, in its slices (a TPU run
    of several slices joined by DCN)."""
    cluster = clusters[run.cluster]
    return cluster if run.slices == 1 else dataclasses.replace(cluster, slices=run.slices)


def _mape(results: Sequence[Result]) -> float:
    return sum(abs(r.error) for r in results) / len(results) if results else 0.0


def gpu_type(cluster: Cluster) -> str:
    """The chip a preset's GPU is (``A100`` for ``A100-SXM4-40GB``): presets of one chip
    share one fit of the compute model."""
    return cluster.gpu.split("-", 1)[0]


def fit(runs: Sequence[Run], clusters: dict[str, Cluster]) -> tuple[dict[str, Cluster], float]:
    """The grid point (see the module docstring) with the lowest error on the
    calibration runs of ``clusters`` (presets of one GPU type; the error is the mean
    over sources of their mean absolute percentage errors), every preset with it, and
    that error."""
    types = {gpu_type(c) for c in clusters.values()}
    if len(types) != 1:
        raise ValueError(f"fit one GPU type at a time, got {', '.join(sorted(types))}")
    # Runs of another framework calibrate that framework's profile (fit_framework), not the GPU.
    calibration = [
        r
        for r in runs
        if r.role == "calibrate"
        and r.cluster in clusters
        and r.plan.framework == default_framework(clusters[r.cluster])
    ]
    if not calibration:
        raise ValueError(f"no calibration runs for {', '.join(sorted(clusters))}")
    pipelines = Pipelines(keep_simulations=False)
    steps = [_step(run, pipelines) for run in calibration]
    if all(c.torus for c in clusters.values()):
        # On a TPU cluster the slices' spread moves the multi-slice rows as the compute
        # model moves all of them: the two are searched together.
        grid = {**GRID, **TORUS_NETWORK_GRID}
        return grid_search(clusters, grid, ((*_BLOCKS[0], *TORUS_NETWORK_GRID), *_BLOCKS[1:]), steps)
    if all(c.matmul_units for c in clusters.values()):
        # A tile's fixed work trades against the efficiency curve: searched with it.
        grid = {**GRID, **K_FILL_GRID}
        return grid_search(clusters, grid, ((*_BLOCKS[0], *K_FILL_GRID), *_BLOCKS[1:]), steps)
    return grid_search(clusters, GRID, _BLOCKS, steps)


_BLOCKS = (("matmul_efficiency", "matmul_half_flops", "elementwise_traffic"), ("kernel_launch_s",))
"""The grid's fields in the order :func:`fit` searches them: the efficiency curve and the
share of unfused elementwise traffic first (a framework that fuses its elementwise kernels
into the products moves less, and its products look faster for it), at the smallest launch
cost, then the launch cost."""


def fit_network(runs: Sequence[Run], clusters: dict[str, Cluster]) -> tuple[dict[str, Cluster], float]:
    """The :data:`NETWORK_GRID` point with the lowest error on the Megatron-LM calibration
    runs of ``clusters`` (one GPU type, compute model fitted), every preset with it, and
    that error; the first such point of the grid (the smallest terms) when several tie."""
    calibration = [
        r
        for r in runs
        if r.role == "calibrate"
        and r.cluster in clusters
        and r.plan.framework == default_framework(clusters[r.cluster])
    ]
    pipelines = Pipelines(keep_simulations=False)
    steps = [_step(run, pipelines) for run in calibration]
    grid = TORUS_NETWORK_GRID if all(c.torus for c in clusters.values()) else NETWORK_GRID
    return grid_search(clusters, grid, (tuple(grid),), steps)


def fit_framework(runs: Sequence[Run], clusters: dict[str, Cluster], name: str) -> tuple[Framework, float]:
    """Framework ``name``'s profile with the ``layer_s`` of :data:`~pipedsl.simulator.frameworks.LAYER_GRID`
    that has the lowest mean absolute percentage error on that framework's calibration
    runs (on ``clusters`` as fitted), and that error."""
    calibration = [r for r in runs if r.role == "calibrate" and r.plan.framework == name]
    if not calibration:
        raise ValueError(f"no calibration runs for framework {name}")
    pipelines = Pipelines(keep_simulations=False)
    profiles = [dataclasses.replace(framework(name), layer_s=v) for v in LAYER_GRID]

    def error(profile: Framework) -> float:
        priced = [dataclasses.replace(r, plan=dataclasses.replace(r.plan, framework=profile)) for r in calibration]
        return _mape(evaluate(priced, clusters, pipelines))

    errors = [error(p) for p in profiles]
    best = min(range(len(profiles)), key=errors.__getitem__)
    return profiles[best], errors[best]


def _step(run: Run, pipelines: Pipelines) -> Step:
    """``run`` as a calibration step of the fitter: its measured seconds per iteration
    against the estimate on a candidate cluster, grouped by its source."""

    def priced(cluster: Cluster) -> float:
        sliced = run_cluster(run, {run.cluster: cluster})
        return estimate(run.model, sliced, run.plan, pipelines=pipelines, stage_layers=run.stage_layers).step_time_s

    return Step(run.name, run.measured_s, priced, group=run.source, cluster=run.cluster)


def regimes(run: Run, cluster: Cluster) -> tuple[str, ...]:
    """The regimes a run belongs to (a run may be in several)."""
    plan, found = run.plan, []
    if plan.tp > cluster.gpus_per_node:
        found.append("tensor parallel across nodes")
    if plan.dp > 1 and group_of(plan.dp, plan.tp, cluster).nodes > 1:
        found.append("data parallel across nodes")
    if plan.pp >= 16:
        found.append("pipeline depth 16-64")
    if run.model.num_params < 5e9:
        found.append("small model (< 5B)")
    if plan.gpus <= cluster.gpus_per_node:
        found.append("single node")
    if 2 <= plan.gpus <= 4:
        found.append("2-4 GPUs")
    if not found:
        found.append("other")
    return tuple(found)


def _table(groups: dict[str, list[Result]]) -> list[str]:
    lines = ["| group | runs | mean abs. error | worst |", "|---|---:|---:|---:|"]
    for name, results in groups.items():
        worst = max(results, key=lambda r: abs(r.error))
        lines.append(
            f"| {name} | {len(results)} | {100 * _mape(results):.1f}% | {100 * worst.error:+.1f}% ({worst.run.name}) |"
        )
    return lines


def accuracy_markdown(
    results: Sequence[Result],
    clusters: dict[str, Cluster],
    held_out: Sequence[tuple[Result, Memory]] = (),
    sections: Sequence[tuple[str, Sequence[Result]]] = (),
) -> str:
    """``data/ACCURACY.md``: error per source, per role, per regime, and per run; then each
    of ``sections`` (a title and its runs: the TPU runs, the GPU runs held out of every fit)
    by role and per run; then the ``held_out`` runs (:data:`HELD_OUT`) with the memory the
    estimator gives them."""
    by_source: dict[str, list[Result]] = {}
    by_role: dict[str, list[Result]] = {}
    by_regime: dict[str, list[Result]] = {}
    by_gpu: dict[str, list[Result]] = {}
    for r in results:
        by_source.setdefault(r.run.source, []).append(r)
        by_gpu.setdefault(gpu_type(clusters[r.run.cluster]), []).append(r)
        by_role.setdefault(r.run.role, []).append(r)
        for regime in regimes(r.run, clusters[r.run.cluster]):
            by_regime.setdefault(regime, []).append(r)
    lines = [
        "# Accuracy of the estimator on published runs",
        "",
        "Generated by `python -m pipedsl.simulator.fit_published` from `data/published_runs*.csv`",
        "(sources in `data/README.md`). Error = (predicted − measured) / measured seconds per iteration.",
        "",
        "Compute parameters priced (`fit_published` fits them on the `calibrate` rows only; `--check` reports",
        "the presets as they are):",
        "",
    ]
    for name, cluster in sorted(clusters.items()):
        lines.append(
            f"- `{name}`: matmul_efficiency = {cluster.matmul_efficiency:g}, "
            f"matmul_half_flops = {cluster.matmul_half_flops:g}, "
            + (
                f"matmul_units = {cluster.matmul_units}, matmul_k_fill = {cluster.matmul_k_fill:g}, "
                if cluster.matmul_units
                else ""
            )
            + "elementwise_traffic = "
            f"{cluster.elementwise_traffic:g}, kernel_launch_s = {cluster.kernel_launch_s:g}; "
            f"network: leaf_nodes = {cluster.leaf_nodes}, spine_latency_s = {cluster.spine_latency_s:g}, "
            f"spine_efficiency = {cluster.spine_efficiency:g}, "
            + (
                f"slice_jitter_s = {cluster.slice_jitter_s:g}"
                if cluster.torus
                else f"straggler_cv = {cluster.straggler_cv:g}"
            )
        )
    lines += [
        "",
        "Framework profiles priced (`simulator/frameworks.py`; a profile other than megatron's is fitted",
        "on its own framework's `calibrate` rows, which the compute fit leaves out):",
        "",
    ]
    for name in sorted({str(r.run.plan.framework) for r in results}):
        f = framework(name)
        lines.append(
            f"- `{name}`: microbatch_s = {f.microbatch_s:g}, layer_s = {f.layer_s:g}, action_s = {f.action_s:g}"
        )
    lines += ["", "## By role", ""] + _table({**by_role, "all": list(results)})
    lines += ["", "## By source", ""] + _table(by_source)
    lines += ["", "## By GPU type", ""] + _table(by_gpu)
    lines += ["", "## By regime", ""] + _table(by_regime)
    lines += [
        "",
        "## Every run",
        "",
        "| run | source | role | GPUs | dp·tp·pp | measured s | predicted s | error |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for r in results:
        p = r.run.plan
        lines.append(
            f"| {r.run.name} | {r.run.source} | {r.run.role} | {p.gpus} | {p.dp}·{p.tp}·{p.pp} | "
            f"{r.run.measured_s:.3f} | {r.predicted_s:.3f} | {100 * r.error:+.1f}% |"
        )
    for title, section in sections:
        lines += _section(title, section)
    if held_out:
        lines += [
            "",
            "## Held out: Llama 3 405B (Table 4; validation only, in no table above)",
            "",
            "| run | GPUs | dp·tp·cp·pp | measured s | predicted s | error | memory per GPU |",
            "|---|---:|---|---:|---:|---:|---|",
        ]
        for r, memory in held_out:
            p = r.run.plan
            lines.append(
                f"| {r.run.name} | {p.gpus} | {p.dp}·{p.tp}·{p.cp}·{p.pp} | {r.run.measured_s:.3f} | "
                f"{r.predicted_s:.3f} | {100 * r.error:+.1f}% | {memory.text()} |"
            )
    return "\n".join(lines) + "\n"


def _section(title: str, results: Sequence[Result]) -> list[str]:
    """A section of ``ACCURACY.md``: ``results`` by role and by source, then every run."""
    by_role: dict[str, list[Result]] = {}
    by_source: dict[str, list[Result]] = {}
    for r in results:
        by_role.setdefault(r.run.role, []).append(r)
        by_source.setdefault(f"{r.run.source} {r.run.role}", []).append(r)
    lines = ["", f"## {title}", ""] + _table({**by_role, "all": list(results)})
    lines += [""] + _table(by_source)
    lines += [
        "",
        "| run | source | role | devices | slices | dp·fsdp·tp·pp | measured s | predicted s | error | fits |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in results:
        p = r.run.plan
        lines.append(
            f"| {r.run.name} | {r.run.source} | {r.run.role} | {p.gpus} | {r.run.slices} | "
            f"{p.dp}·{p.shard_group}·{p.tp}·{p.pp} | {r.run.measured_s:.3f} | {r.predicted_s:.3f} | "
            f"{100 * r.error:+.1f}% | {'yes' if r.fits else 'no'} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Fit (or with ``--check`` only evaluate) the presets used by the published runs."""
    parser = argparse.ArgumentParser(prog="python -m pipedsl.simulator.fit_published", description=__doc__)
    parser.add_argument("--check", action="store_true", help="evaluate the presets as they are; do not fit")
    parser.add_argument("--out", type=Path, default=DATA / "ACCURACY.md", help="where to write the accuracy table")
    args = parser.parse_args(argv)
    runs = load_runs()
    tpu = load_runs(DATA, TPU_RUNS)
    held_gpu = load_runs(DATA, HELD_OUT_GPU)
    every = [*runs, *tpu, *held_gpu]
    clusters = {name: load_cluster(name) for name in sorted({r.cluster for r in every})}
    if not args.check:
        for kind in sorted({gpu_type(c) for c in clusters.values()}):
            fitted = {n: c for n, c in clusters.items() if gpu_type(c) == kind}
            # The compute model and the network terms each fitted given the other, twice over.
            for _ in range(2):
                fitted, error = fit([*runs, *tpu], fitted)
                fitted, _ = fit_network([*runs, *tpu], fitted)
            clusters.update(fitted)
            c = next(iter(fitted.values()))
            print(
                f"{kind} ({', '.join(fitted)}): matmul_efficiency = {c.matmul_efficiency:g}, "
                f"matmul_half_flops = {c.matmul_half_flops:g}, matmul_k_fill = {c.matmul_k_fill:g}, "
                f"elementwise_traffic = {c.elementwise_traffic:g}, kernel_launch_s = {c.kernel_launch_s:g} "
                f"(calibration error {100 * error:.1f}%); spine_latency_s = {c.spine_latency_s:g}, "
                f"spine_efficiency = {c.spine_efficiency:g}, straggler_cv = {c.straggler_cv:g}, "
                f"slice_jitter_s = {c.slice_jitter_s:g}"
            )
        for name in sorted({str(r.plan.framework) for r in runs} - {DEFAULT_FRAMEWORK}):
            profile, error = fit_framework(runs, clusters, name)
            recorded = framework(name).layer_s
            note = "" if profile.layer_s == recorded else f"; frameworks.py records {recorded:g}: update it"
            print(f"framework {name}: layer_s = {profile.layer_s:g} (calibration error {100 * error:.1f}%{note})")
    held = load_runs(DATA, HELD_OUT)
    held_clusters = {**clusters, **{n: load_cluster(n) for n in {r.cluster for r in held} - set(clusters)}}
    held_out = [
        (result, estimate(r.model, held_clusters[r.cluster], r.plan, stage_layers=r.stage_layers).memory)
        for r, result in zip(held, evaluate(held, held_clusters), strict=True)
    ]
    results = evaluate(runs, clusters)
    tpu_results = evaluate(tpu, clusters)
    for kind in sorted({gpu_type(c) for c in clusters.values()}):
        print(fit_report([*results, *tpu_results], clusters, kind, fitted=not args.check).text())
    sections = (
        ("TPU slices and pods: MaxText's published runs (calibrate rows fit each chip, validate rows held out)",
         tpu_results),
        ("Held out: GPU runs added after the fits (validation only, in no table above)", evaluate(held_gpu, clusters)),
    )  # fmt: skip
    text = accuracy_markdown(results, clusters, held_out, sections)
    args.out.write_text(text)
    print(text)
    return 0


def fit_report(results: Sequence[Result], clusters: dict[str, Cluster], kind: str, *, fitted: bool) -> Report:
    """The compute model of GPU type ``kind`` in the calibration's report form: its three
    parameters and where they came from, and each of its ``calibrate`` rows of
    ``results`` reproduced (the ``validate`` rows are in ``data/ACCURACY.md``)."""
    rows = [r for r in results if r.run.role == "calibrate" and gpu_type(clusters[r.run.cluster]) == kind]
    sources = sorted({r.run.source for r in rows})
    told = (
        f"grid search on {len(rows)} calibrate rows of {', '.join(sources)} (mean over sources of their mean abs. error)"
        if fitted
        else "the preset as it is (--check)"
    )
    c = next(cluster for cluster in clusters.values() if gpu_type(cluster) == kind)
    parameters = (
        Measured("matmul_efficiency", c.matmul_efficiency, "", told),
        Measured("matmul_half_flops", c.matmul_half_flops, "FLOP", told),
        *((Measured("matmul_k_fill", c.matmul_k_fill, "", told),) if c.matmul_units else ()),
        Measured("elementwise_traffic", c.elementwise_traffic, "", told),
        Measured("kernel_launch_s", c.kernel_launch_s, "s", told),
    )
    steps = tuple(Reproduced(f"{r.run.name} ({r.run.source})", r.run.measured_s, r.predicted_s) for r in rows)
    presets = ", ".join(sorted(n for n, cluster in clusters.items() if gpu_type(cluster) == kind))
    return Report(f"{kind} ({presets}): compute model on published runs", "published runs", parameters, steps)


if __name__ == "__main__":
    sys.exit(main())
