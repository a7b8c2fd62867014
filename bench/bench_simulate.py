"""Time the ``pipedsl simulate`` path on a large library schedule, phase by phase.

Interleaved 1F1B with pp=64, vpp=2 and 1024 microbatches: 262,144 actions. Each run
loads the .sched file (parse + evaluate), validates, lowers, and simulates under the
default cost model, timing each phase; then it times the whole command in-process
(``pipedsl simulate FILE -p ... --json``, output discarded). Prints the best run of each
and the rate in actions per second, for the simulation alone and for the whole path.

    python bench/bench_simulate.py [--repeat N]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import time
from collections.abc import Callable
from typing import TypeVar

from pipedsl.cli import main as cli_main
from pipedsl.library import library_path, load
from pipedsl.program import lower
from pipedsl.simulator import CostModel, simulate
from pipedsl.validate import validate

PARAMS = {"pp": 64, "vpp": 2, "microbatches": 1024}
T = TypeVar("T")


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (default 3); the best is reported")
    args = parser.parse_args()
    path = library_path("interleaved_1f1b")
    costs = CostModel()
    best: dict[str, float] = {}
    actions = instructions = 0
    makespan = bubble = 0.0
    for _ in range(max(args.repeat, 1)):
        schedule, t_load = _timed(lambda: load(path, **PARAMS))
        _, t_validate = _timed(lambda s=schedule: validate(s))
        # lower() validates again, as every consumer's entry does; time it as called.
        program, t_lower = _timed(lambda s=schedule: lower(s))
        sim, t_sim = _timed(lambda p=program: simulate(p, costs))
        actions, instructions = schedule.num_actions, program.num_instructions
        makespan, bubble = sim.makespan, sim.bubble_ratio
        # The command starts from nothing, as a user's does: no large objects left alive
        # for the cyclic collector to walk while it runs.
        del schedule, program, sim
        gc.collect()
        argv = ["simulate", str(path), *(f"-p{k}={v}" for k, v in PARAMS.items()), "--json"]
        with contextlib.redirect_stdout(io.StringIO()):
            code, t_cli = _timed(lambda: cli_main(argv))
        if code != 0:
            raise SystemExit(f"pipedsl simulate exited with {code}")
        for phase, seconds in (
            ("load", t_load),
            ("validate", t_validate),
            ("lower", t_lower),
            ("simulate", t_sim),
            ("command", t_cli),
        ):
            best[phase] = min(best.get(phase, float("inf")), seconds)

    print(f"schedule:     interleaved_1f1b {' '.join(f'{k}={v}' for k, v in PARAMS.items())}")
    print(f"actions:      {actions:,} ({instructions:,} instructions lowered)")
    print(f"result:       makespan {makespan:g} s, bubble {bubble:.4%} (default costs F=1 B=2)")
    print(f"load:         {best['load']:.3f} s   (parse + evaluate)")
    print(f"validate:     {best['validate']:.3f} s")
    print(f"lower:        {best['lower']:.3f} s   (includes its own validation)")
    print(f"simulate:     {best['simulate']:.3f} s   {actions / best['simulate']:,.0f} actions/s")
    print(f"command:      {best['command']:.3f} s   {actions / best['command']:,.0f} actions/s (pipedsl simulate --json)")


if __name__ == "__main__":
    main()
