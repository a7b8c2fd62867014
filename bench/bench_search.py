"""Time the plan search on GPT-3 175B over 1024 A100s (global batch 1536, Megatron's GPT-3 run).

Prints how many plans were considered, dropped (by reason), simulated and ranked, the
wall time and plans per second, the split of that time between costing every plan and
simulating the pipelines, and the best pipeline plan against the best SPMD plan. With
``--no-prune`` every plan that fits is simulated (the ranking of the top is the same).

    python bench/bench_search.py [--model gpt3-175b] [--cluster a100-80gb] [--gpus 1024]
                                 [--global-batch 1536] [--no-prune]
"""

from __future__ import annotations

import argparse
import time

from pipedsl.simulator.search import DEFAULT_PRUNE, search, summarize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--cluster", default="a100-80gb")
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--no-prune", action="store_true", help="simulate every plan that fits")
    args = parser.parse_args()

    phases: dict[str, float] = {}

    def progress(phase: str, done: int, total: int) -> None:
        phases[phase] = time.perf_counter()

    started = time.perf_counter()
    frame = search(
        args.model,
        args.cluster,
        args.gpus,
        global_batch=args.global_batch,
        prune=None if args.no_prune else DEFAULT_PRUNE,
        progress=progress,
    )
    seconds = time.perf_counter() - started
    attrs = frame.attrs
    costing = phases.get("costing", started) - started
    print(f"{attrs['model']} on {attrs['gpus']} x {attrs['cluster']}, global batch {attrs['global_batch']}")
    print(f"  plans considered   {attrs['considered']:>7}")
    for reason, count in sorted(attrs["dropped"].items(), key=lambda item: -item[1]):
        print(f"  dropped            {count:>7}  {reason}")
    print(f"  ranked             {len(frame):>7}")
    print(f"  simulations        {attrs['simulations']:>7}")
    print(f"  wall time          {seconds:7.1f} s  ({attrs['considered'] / seconds:,.0f} plans/s)")
    print(f"    costing          {costing:7.1f} s")
    print(f"    simulating       {seconds - costing:7.1f} s")
    print(summarize(frame).text())


if __name__ == "__main__":
    main()
