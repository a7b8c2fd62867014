"""Time the plan search on GPT-3 175B over 1024 A100s (global batch 1536, Megatron's GPT-3 run).

Prints how many plans were considered, dropped (by reason), simulated and ranked, the
processes that ranked them (``--jobs``; by default the search's own choice), the wall
and CPU time (the worker processes' included) and plans per second, and the best
pipeline plan against the best SPMD plan. With ``--no-prune`` every plan that fits is
simulated (the ranking of the top is the same). With ``--top K``, the same search then
ranks only its best K plans and each schedule's best (what ``pipedsl search`` does
unless it writes a CSV), in the same run: its time, the ratio, and that its best K rows
are the full ranking's.

With ``--cli``, instead, the command line as a user types it is timed in fresh processes
(imports included), ``pipedsl search ... --top 3 --csv OUT``, against the same with
``--no-prune`` (every plan that fits simulated and written, what ``--csv`` did before it
ranked a shortlist and bounded the rest) in the same run, taking turns; the median of
``--repeat`` runs of each (default 5), with the first command's fastest run and its median
CPU seconds (user and system, its worker processes included: on a shared machine the wall
time follows the load).

The best 40 plans are checked against ``search_gpt3_175b_top40.json`` beside this file,
the ranking recorded (``--record``) for the default arguments when the cost model last
changed; a change of speed alone must leave it as it is. With
``--baseline PYTHON`` (another checkout's interpreter, e.g. the previous
implementation's virtual environment), the same search is also run by that interpreter
in a fresh process and the ratio printed.

    python bench/bench_search.py [--model gpt3-175b] [--cluster a100-80gb] [--gpus 1024]
                                 [--global-batch 1536] [--no-prune] [--top K] [--jobs N] [--baseline PYTHON]
                                 [--record] [--stage-layers even|ends] [--cli [--repeat N]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from timing import record

from pipedsl.simulator.search import DEFAULT_PRUNE, search, summarize

RECORDED = Path(__file__).parent / "search_gpt3_175b_top40.json"
TOP_COLUMNS = ["schedule", "dp", "tp", "pp", "vpp", "microbatch_size", "zero", "recompute", "step_time_s"]
# The search as another interpreter runs it: wall seconds, plans considered, best 40 rows.
_CHILD = """
import json, sys, time
from pipedsl.simulator.search import search
model, cluster, gpus, batch, prune = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
start, cpu = time.perf_counter(), time.process_time()
frame = search(model, cluster, gpus, global_batch=batch, prune=None if prune == "none" else float(prune))
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
top = frame[COLUMNS].head(40).to_dict("split")["data"]
print(json.dumps({"seconds": seconds, "cpu": cpu, "considered": frame.attrs["considered"], "top": top}))
"""


def _top(frame: pd.DataFrame) -> list[list[object]]:
    """The best 40 rows' :data:`TOP_COLUMNS` as plain Python values."""
    return frame[TOP_COLUMNS].head(40).to_dict("split")["data"]


def _baseline(python: str, args: argparse.Namespace, prune: float | None) -> dict[str, object]:
    code = _CHILD.replace("COLUMNS", repr(TOP_COLUMNS))
    argv = [python, "-c", code, args.model, args.cluster, str(args.gpus), str(args.global_batch), str(prune).lower()]
    # From a neutral folder: ``-c`` puts the working folder first on the import path.
    done = subprocess.run(argv, check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(done.stdout.splitlines()[-1])


def _children_cpu_seconds() -> float:
    """CPU seconds (user and system) of the child processes that have exited, theirs included."""
    times = os.times()
    return times.children_user + times.children_system


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have exited (the workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--cluster", default="a100-80gb")
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--no-prune", action="store_true", help="simulate every plan that fits")
    parser.add_argument("--top", type=int, help="then rank only what the best K plans need, and compare")
    parser.add_argument("--jobs", type=int, help="processes that rank schedules at once (default: the search's)")
    parser.add_argument("--baseline", help="another checkout's python to run the same search with")
    parser.add_argument("--record", action="store_true", help=f"write the best 40 plans to {RECORDED.name}")
    parser.add_argument(
        "--stage-layers",
        choices=("even", "ends"),
        default="even",
        help="ends: also split the layers with embedding-only first and head-only last stages (Llama 3 405B)",
    )
    parser.add_argument("--cli", action="store_true", help="time `pipedsl search --top 3 --csv` as a command")
    parser.add_argument("--repeat", type=int, default=5, help="with --cli, runs of each command (default 5)")
    args = parser.parse_args()
    if args.cli:
        record("bench_search", _cli(args))
        return
    prune = None if args.no_prune else DEFAULT_PRUNE

    frame, seconds, cpu = _timed_search(args, prune, shortlist=None)
    attrs = frame.attrs
    print(f"{attrs['model']} on {attrs['gpus']} x {attrs['cluster']}, global batch {attrs['global_batch']}")
    print(f"  plans considered   {attrs['considered']:>7}")
    for reason, count in sorted(attrs["dropped"].items(), key=lambda item: -item[1]):
        print(f"  dropped            {count:>7}  {reason}")
    print(f"  ranked             {len(frame):>7}")
    print(f"  simulations        {attrs['simulations']:>7}")
    print(f"  processes          {attrs['processes']:>7}")
    print(f"  wall time          {seconds:7.1f} s  ({attrs['considered'] / seconds:,.0f} plans/s)")
    print(
        f"  CPU time           {cpu:7.1f} s  ({attrs['considered'] / cpu:,.0f} plans per CPU second, workers included)"
    )
    print(summarize(frame).text())
    default = (args.model, args.cluster, args.gpus, args.global_batch) == ("gpt3-175b", "a100-80gb", 1024, 1536)
    if default and not args.no_prune and args.record:
        RECORDED.write_text(json.dumps(_top(frame)) + "\n")
        print(f"  best 40 plans      recorded in {RECORDED.name}")
    elif default and not args.no_prune:
        same = _top(frame) == json.loads(RECORDED.read_text())
        print(
            f"  best 40 plans      {'the same as' if same else 'DIFFERENT from'} the recorded ranking ({RECORDED.name})"
        )
    if args.baseline:
        base = _baseline(args.baseline, args, prune)
        print(f"  baseline           {base['seconds']:7.1f} s  ({base['considered'] / base['seconds']:,.0f} plans/s)"
              f", {base['cpu']:.1f} s of CPU ({base['considered'] / base['cpu']:,.0f} plans per CPU second)")  # fmt: skip
        print(f"  ratio              {base['seconds'] / seconds:7.2f}x faster ({base['cpu'] / cpu:.2f}x in CPU time); best 40 plans "
              f"{'the same' if base['top'] == _top(frame) else 'DIFFERENT'}")  # fmt: skip
    figures = {"plans": attrs["considered"], "ranked": len(frame), "processes": attrs["processes"],
               "seconds": seconds, "plans_per_s": attrs["considered"] / seconds, "cpu_s": cpu}  # fmt: skip
    if args.baseline:
        figures |= {"baseline_s": base["seconds"], "speedup": base["seconds"] / seconds}
    if args.top is not None:
        figures |= _top_only(args, prune, frame, seconds)
    record("bench_search", figures)


def _cli(args: argparse.Namespace) -> dict[str, float]:
    """Median wall seconds of ``pipedsl search ... --top 3 --csv OUT`` and of the same with
    ``--no-prune``, each in a fresh process, in turns; both CSVs' first rows the same."""
    with tempfile.TemporaryDirectory() as folder:
        base = [sys.executable, "-m", "pipedsl", "search", "--model", args.model, "--cluster", args.cluster,
                "--gpus", str(args.gpus), "--global-batch", str(args.global_batch), "--top", "3"]  # fmt: skip
        commands = {
            "shortlist": [*base, "--csv", str(Path(folder) / "plans.csv")],
            "every plan": [*base, "--no-prune", "--csv", str(Path(folder) / "all.csv")],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        cpus: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeat):
            for name, argv in commands.items():
                started, cpu = time.perf_counter(), _children_cpu_seconds()
                subprocess.run(argv, check=True, capture_output=True, cwd=folder)
                times[name].append(time.perf_counter() - started)
                cpus[name].append(_children_cpu_seconds() - cpu)
        first = pd.read_csv(Path(folder) / "plans.csv").head(1)[TOP_COLUMNS]
        same = first.equals(pd.read_csv(Path(folder) / "all.csv").head(1)[TOP_COLUMNS])
    shortlist, every = statistics.median(times["shortlist"]), statistics.median(times["every plan"])
    cpu = statistics.median(cpus["shortlist"])
    print(
        f"pipedsl search --model {args.model} --cluster {args.cluster} --gpus {args.gpus} "
        f"--global-batch {args.global_batch} --top 3 --csv OUT, median of {args.repeat}:"
    )
    print(f"  shortlist, the rest bounded   {shortlist:6.2f} s  ({cpu:.2f} s of CPU, its workers included)")
    print(f"  --no-prune, every plan        {every:6.2f} s  ({every / shortlist:.2f}x as long)")
    print(f"  best plan                     {'the same' if same else 'DIFFERENT'}")
    return {
        "cli_csv_s": shortlist, "cli_csv_fastest_s": min(times["shortlist"]), "cli_csv_cpu_s": cpu,
        "cli_every_plan_s": every, "cli_ratio": every / shortlist,
    }  # fmt: skip


def _timed_search(
    args: argparse.Namespace, prune: float | None, *, shortlist: int | None
) -> tuple[pd.DataFrame, float, float]:
    """The search the arguments ask for, its wall and CPU seconds (workers included)."""
    started, cpu = time.perf_counter(), _cpu_seconds()
    frame = search(
        args.model, args.cluster, args.gpus, global_batch=args.global_batch, prune=prune, jobs=args.jobs,
        shortlist=shortlist, stage_split=args.stage_layers,
    )  # fmt: skip
    return frame, time.perf_counter() - started, _cpu_seconds() - cpu


def _top_only(args: argparse.Namespace, prune: float | None, full: pd.DataFrame, full_s: float) -> dict[str, float]:
    """The search again, ranking only what its best ``args.top`` rows need: its wall and
    CPU seconds, against the full ranking's ``full_s``, and whether its rows are ``full``'s."""
    frame, seconds, cpu = _timed_search(args, prune, shortlist=args.top)
    same = frame[TOP_COLUMNS].head(args.top).equals(full[TOP_COLUMNS].head(args.top))
    print(f"  best {args.top} only        {seconds:7.1f} s wall, {cpu:.1f} s of CPU: {full_s / seconds:.2f}x faster;"
          f" {len(frame)} ranked, {frame.attrs['simulations']} simulations; its best {args.top} rows"
          f" {'the same as' if same else 'DIFFERENT from'} the full ranking's")  # fmt: skip
    return {"top": args.top, "top_s": seconds, "top_cpu_s": cpu, "top_speedup": full_s / seconds}


if __name__ == "__main__":
    main()
