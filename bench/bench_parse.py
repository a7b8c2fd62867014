"""Time parse + expand of a large library schedule.

Interleaved 1F1B with pp=64, vpp=2 and 1024 microbatches: 262,144 actions. Prints the
action count, the seconds of the first (cold: grammar construction included) and the best
of the following runs, and actions per second for the best run.

    python bench/bench_parse.py [--repeat N]
"""

from __future__ import annotations

import argparse
import time

from timing import record

from pipedsl.library import library_path, load

PARAMS = {"pp": 64, "vpp": 2, "microbatches": 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs after the first (default 5)")
    args = parser.parse_args()
    path = library_path("interleaved_1f1b")
    times = []
    actions = 0
    for _ in range(1 + args.repeat):
        start = time.perf_counter()
        schedule = load(path, **PARAMS)
        times.append(time.perf_counter() - start)
        actions = schedule.num_actions
    best = min(times[1:]) if len(times) > 1 else times[0]
    print(f"schedule:  interleaved_1f1b {' '.join(f'{k}={v}' for k, v in PARAMS.items())}")
    print(f"actions:   {actions}")
    print(f"first:     {times[0]:.3f} s")
    print(f"best:      {best:.3f} s")
    print(f"rate:      {actions / best:,.0f} actions/s")
    record("bench_parse", {"actions": actions, "first_s": times[0], "best_s": best, "actions_per_s": actions / best})


if __name__ == "__main__":
    main()
