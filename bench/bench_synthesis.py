"""Time policy synthesis, and compare its makespans with the zero-bubble paper's scheduler.

1. Timing: ``zb_auto`` synthesised for pp=8, m=32 (768 actions) against unit costs with
   communication, the least CPU time of ``--repeat`` runs, whole and per variant; beside it,
   for scale, one simulation (validate, lower, simulate) of 1F1B of the same size.
2. Comparison (with ``--zb PATH``, a checkout of the ``sail-sg/zero-bubble-pipeline-parallelism``
   repository; skipped without it): over a grid of depths, microbatch counts, unequal F/I/W,
   communication times and in-flight limits, that repository's automatic scheduler
   (``megatron/core/pipeline_parallel/zerobubble/scheduler/zb.py``, ``initial_solution``,
   run from its own file; its imports of torch and pulp are type hints and output helpers
   there, stood in for by empty modules) and pipedsl's ``zb_auto`` policy. Both orders are
   simulated by pipedsl's simulator under the same cost model, so both makespans count from
   the step's start (the other scheduler's own figure leaves out the wait before a stage's
   first forward). Its memory model: F adds one microbatch, its B (pipedsl's I) nothing, W
   frees it; the limit is the in-flight count.
3. Never slower than a written order (always run): each library policy against every explicit
   library order with its placement that keeps its limits (``zbv_auto`` against ``zbv``;
   ``zb_auto`` and ``zb_h2`` against ``1f1b``, ``eager_1f1b``, ``gpipe``, ``zb_h1``), both
   simulated, over pp 4 and 8, 8 to 32 microbatches, W from F/2 to 2F, link latency from 0 to
   F/5, with and without a dispatch per task: the largest ratio of the policy's makespan to
   the written order's (at most 1.0), and how often the policy is strictly faster.

    python bench/bench_synthesis.py [--repeat N] [--zb PATH] [--markdown OUT.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any

from timing import record

from pipedsl.errors import PipedslError
from pipedsl.ir import Action, Kind, Schedule
from pipedsl.library import library_path, load
from pipedsl.policy import Policy
from pipedsl.simulator import CostModel, simulate
from pipedsl.synthesize import synthesize, variants
from pipedsl.validate import validate

_SCHEDULER = "megatron/core/pipeline_parallel/zerobubble/scheduler"


def _best(fn: Any, repeat: int) -> float:
    """The least CPU time (seconds) of ``repeat`` calls: on a machine shared with other work,
    CPU time, unlike wall time, counts only this process's own computing."""
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def timing(repeat: int) -> dict[str, Any]:
    costs = CostModel(forward=1, input_grad=1, weight_grad=1, latency=0.1)
    policy = load(library_path("zb_auto"), pp=8, microbatches=32)
    assert isinstance(policy, Policy)
    one_f_one_b = load(library_path("1f1b"), pp=8, microbatches=32)
    whole = _best(lambda: synthesize(policy, costs), repeat)
    sim = _best(lambda: simulate(one_f_one_b, costs), repeat)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"synthesize zb_auto pp=8 m=32 ({len(variants(policy))} variants): {whole * 1e3:.2f} ms of CPU")
    for variant in variants(policy):
        one = _best(lambda v=variant: synthesize(policy, costs, tries=(v,), library=False), repeat)
        print(f"  {variant}: {one * 1e3:.2f} ms")
    print(f"for scale: simulate 1f1b pp=8 m=32 once: {sim * 1e3:.2f} ms (synthesis / simulation = {whole / sim:.2f})")
    return {"synthesis_cpu_ms": round(whole * 1e3, 3), "simulation_cpu_ms": round(sim * 1e3, 3),
            "synthesis_over_simulation": round(whole / sim, 3)}  # fmt: skip


GUARANTEE_POLICIES = {"zbv_auto": ("zbv",), "zb_auto": ("1f1b", "eager_1f1b", "gpipe", "zb_h1"),
                      "zb_h2": ("1f1b", "eager_1f1b", "gpipe", "zb_h1")}  # fmt: skip


def guarantee() -> dict[str, Any]:
    """Policy / written-order makespans over the grid of the module docstring's part 3."""
    worst: dict[str, float] = {}
    faster = cases = 0
    start = time.perf_counter()
    for pp in (4, 8):
        for m in (8, 12, 16, 24, 32):
            for w in (0.5, 1.0, 1.5, 2.0):
                for latency in (0.0, 0.05, 0.1, 0.2):
                    for dispatch in (0.0, 0.1):
                        costs = CostModel(forward=1, input_grad=1, weight_grad=w, latency=latency, dispatch=dispatch)
                        for name, written in GUARANTEE_POLICIES.items():
                            try:
                                policy = load(library_path(name), pp=pp, microbatches=m)
                            except PipedslError:  # a require line refuses this size
                                continue
                            assert isinstance(policy, Policy)
                            ours = simulate(synthesize(policy, costs), costs).makespan
                            for other in written:
                                try:
                                    order = load(library_path(other), pp=pp, microbatches=m)
                                except PipedslError:
                                    continue
                                assert isinstance(order, Schedule)
                                limit = policy.max_inflight or ()
                                if any(p > n for p, n in zip(validate(order).peak_inflight, limit)):
                                    continue
                                theirs = simulate(order, costs).makespan
                                key = f"{name}/{other}"
                                worst[key] = max(worst.get(key, 0.0), ours / theirs)
                                cases += 1
                                faster += ours < theirs * (1 - 1e-9)
    seconds = time.perf_counter() - start
    print(f"never slower than a written order: {cases} cases, the policy strictly faster in {faster},"
          f" {seconds:.1f} s")  # fmt: skip
    for key, ratio in sorted(worst.items()):
        print(f"  largest {key} makespan ratio: {ratio:.4f}")
    return {"guarantee_cases": cases, "guarantee_strictly_faster": faster,
            **{f"worst_{k.replace('/', '_over_')}": round(v, 6) for k, v in sorted(worst.items())}}  # fmt: skip


def _their_scheduler(repo: Path) -> types.ModuleType:
    """Import ``zb.py`` and its ``graph.py`` from the checkout, by path."""
    for name in ("torch", "pulp"):
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.Tensor = object  # type: ignore[attr-defined]
            sys.modules[name] = stub
    module = None
    for short in ("graph", "zb"):
        full = f"{_SCHEDULER.replace('/', '.')}.{short}"
        spec = importlib.util.spec_from_file_location(full, repo / _SCHEDULER / f"{short}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    assert module is not None
    return module


def _their_order(zb: types.ModuleType, pp: int, m: int, fiw: tuple[float, ...], comm: float, limit: int) -> Schedule:
    f, i, w = (float(x) for x in fiw)
    config = zb.GraphConfig(
        cost_f=[f] * pp, cost_b=[i] * pp, cost_w=[w] * pp, cost_comm=float(comm),
        mem_f=[1.0] * pp, mem_b=[0.0] * pp, mem_w=[-1.0] * pp, max_mem=[float(limit)] * pp,
        n_stages=pp, n_micro=m,
    )  # fmt: skip
    graph = zb.Graph.build_graph(pp, m, config)
    _, order, _ = zb.initial_solution(graph, print_result=False)
    kinds = (Kind.F, Kind.I, Kind.W)
    orders = []
    for stage in range(pp):
        nodes = sorted((order[graph.get_id(k, stage, mb)], k, mb) for k in range(3) for mb in range(m))
        orders.append(tuple(Action(kinds[k], stage, mb) for _, k, mb in nodes))
    return Schedule("zb_paper", pp, pp, m, tuple(range(pp)), tuple(orders))


GRID_FIW = ((1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (3, 2, 1), (1, 2, 2))
GRID_COMM = (0.0, 0.1, 0.2, 0.25, 0.5, 1.0)
"""Communication per hop in units of F: none, small (a tenth to a quarter of F, where a
scheduler must hide the hops inside the warm-up), half and as much as F."""


def compare(repo: Path) -> list[dict[str, Any]]:
    zb = _their_scheduler(repo)
    rows = []
    for pp in (2, 4, 6, 8):
        for m in (pp, 2 * pp, 4 * pp):
            for fiw in GRID_FIW:
                for comm in GRID_COMM:
                    for limit in sorted({pp, (3 * pp) // 2, 2 * pp}):
                        costs = CostModel(forward=fiw[0], input_grad=fiw[1], weight_grad=fiw[2], latency=comm)
                        theirs = simulate(_their_order(zb, pp, m, fiw, comm, limit), costs)
                        policy = load(library_path("zb_auto"), pp=pp, microbatches=m, max_inflight=limit)
                        assert isinstance(policy, Policy)
                        ours = simulate(synthesize(policy, costs), costs)
                        peak = max(d.peak_inflight for d in ours.devices)
                        assert peak <= limit, (pp, m, fiw, comm, limit, peak)
                        rows.append(
                            {"pp": pp, "m": m, "fiw": fiw, "comm": comm, "limit": limit,
                             "theirs": theirs.makespan, "ours": ours.makespan,
                             "their_peak": max(d.peak_inflight for d in theirs.devices), "our_peak": peak}
                        )  # fmt: skip
    return rows


def _verdict(row: dict[str, Any]) -> str:
    if row["ours"] < row["theirs"] - 1e-9:
        return "faster"
    if row["ours"] > row["theirs"] + 1e-9:
        return "slower"
    return "equal"


def report(rows: list[dict[str, Any]]) -> str:
    counts = Counter(_verdict(r) for r in rows)
    lines = [
        f"{len(rows)} cases: pipedsl faster in {counts['faster']}, equal in {counts['equal']},"
        f" slower in {counts['slower']}.",
        "",
        "| F, I, W | comm | cases | faster | equal | slower | largest gain |",
        "|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["fiw"], row["comm"]), []).append(row)
    for (fiw, comm), group in groups.items():
        c = Counter(_verdict(r) for r in group)
        gain = max(r["theirs"] - r["ours"] for r in group)
        lines.append(
            f"| {', '.join(f'{x:g}' for x in fiw)} | {comm:g} | {len(group)} | {c['faster']} | {c['equal']} |"
            f" {c['slower']} | {gain:g} |"
        )
    wins = sorted((r for r in rows if _verdict(r) == "faster"), key=lambda r: r["ours"] / r["theirs"])[:15]
    lines += [
        "",
        "Largest relative gains (makespans in units of F's cost where F = 1):",
        "",
        "| pp | microbatches | F, I, W | comm | in-flight limit | zero-bubble scheduler | pipedsl zb_auto | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in wins:
        lines.append(
            f"| {r['pp']} | {r['m']} | {', '.join(f'{x:g}' for x in r['fiw'])} | {r['comm']:g} | {r['limit']} |"
            f" {r['theirs']:g} | {r['ours']:g} | {r['ours'] / r['theirs']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20, help="timed runs (default 20); the best is reported")
    parser.add_argument("--zb", type=Path, help="a checkout of sail-sg/zero-bubble-pipeline-parallelism")
    parser.add_argument("--markdown", type=Path, help="write the comparison's tables here")
    args = parser.parse_args()
    record("bench_synthesis", {**timing(args.repeat), **guarantee()})
    if args.zb is None or not (args.zb / _SCHEDULER / "zb.py").is_file():
        print("comparison skipped: give --zb PATH, a checkout of sail-sg/zero-bubble-pipeline-parallelism")
        return
    start = time.perf_counter()
    text = report(compare(args.zb))
    print(text)
    print(f"comparison took {time.perf_counter() - start:.1f} s")
    if args.markdown is not None:
        args.markdown.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
