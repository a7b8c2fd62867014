"""Time the ``pipedsl simulate`` path on a large library schedule, phase by phase.

Interleaved 1F1B with pp=64, vpp=2 and 1024 microbatches: 262,144 actions. Each run
loads the .sched file (parse + evaluate), validates, lowers, and simulates under the
default cost model, timing each phase; then it times the whole command
(``pipedsl simulate FILE -p ... --json``, output discarded) in a fresh process, with its
peak memory and CPU time. Prints the best run of each.

With ``--baseline PYTHON`` (the interpreter of another checkout, e.g. the previous
implementation's virtual environment), the same command is also run by that
interpreter, alternating with this one so that load drifts hit both alike, and the
ratios are printed. ``--microbatches 4096`` makes it a million actions.

    python bench/bench_simulate.py [--repeat N] [--microbatches M] [--baseline PYTHON]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

from timing import record

from pipedsl.library import library_path, load
from pipedsl.program import lower
from pipedsl.simulator import CostModel, simulate
from pipedsl.validate import validate

T = TypeVar("T")


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


# Runs the command in the child and reports the child's own peak resident memory (KiB)
# and CPU seconds (user + system): on a loaded machine the CPU time is what compares.
# Linux keeps ``ru_maxrss`` across exec, so there it would be this process's own peak
# (the schedules it holds) whenever that is larger: the child's high-water mark of its
# own memory is read from /proc instead.
_CHILD = (
    "import resource, runpy, sys\n"
    "sys.argv = ['pipedsl', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('pipedsl', run_name='__main__')\n"
    "finally:\n"
    "    use = resource.getrusage(resource.RUSAGE_SELF)\n"
    "    peak = use.ru_maxrss\n"
    "    try:\n"
    "        with open('/proc/self/status') as status:\n"
    "            peak = next(int(line.split()[1]) for line in status if line.startswith('VmHWM:'))\n"
    "    except (OSError, StopIteration):\n"
    "        pass\n"
    "    print(use.ru_utime + use.ru_stime, peak, file=sys.stderr)\n"
)


def _command(python: str, params: dict[str, int]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak resident MiB) of ``pipedsl simulate ... --json``
    run by ``python``."""
    path = library_path("interleaved_1f1b")
    argv = [python, "-c", _CHILD, "simulate", str(path), *(f"-p{k}={v}" for k, v in params.items()), "--json"]
    start = time.perf_counter()
    # From a neutral folder: ``-c`` puts the working folder first on the import path.
    done = subprocess.run(
        argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir()
    )
    seconds = time.perf_counter() - start
    cpu, peak = done.stderr.split()[-2:]
    return seconds, float(cpu), int(peak) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (default 3); the best is reported")
    parser.add_argument("--microbatches", type=int, default=1024, help="microbatches (default 1024)")
    parser.add_argument("--baseline", help="another checkout's python to run the same command with")
    args = parser.parse_args()
    params = {"pp": 64, "vpp": 2, "microbatches": args.microbatches}
    path = library_path("interleaved_1f1b")
    costs = CostModel()
    best: dict[str, float] = {}
    peaks: dict[str, float] = {}
    actions = instructions = 0
    makespan = bubble = 0.0
    for _ in range(max(args.repeat, 1)):
        schedule, t_load = _timed(lambda: load(path, **params))
        _, t_validate = _timed(lambda: validate(schedule))  # noqa: B023 - called at once
        # The validation is kept on the schedule: lowering a fresh copy times its own.
        fresh = load(path, **params)
        program, t_lower = _timed(lambda: lower(fresh))  # noqa: B023
        sim, t_sim = _timed(lambda: simulate(program, costs))  # noqa: B023
        actions, instructions = schedule.num_actions, program.num_instructions
        makespan, bubble = sim.makespan, sim.bubble_ratio
        timings = {"load": t_load, "validate": t_validate, "lower": t_lower, "simulate": t_sim}
        # The commands start from nothing, as a user's does.
        runs = {"command": sys.executable} | ({"baseline": args.baseline} if args.baseline else {})
        for name, python in runs.items():
            timings[name], timings[f"{name} cpu"], peak = _command(python, params)
            peaks[name] = min(peaks.get(name, float("inf")), peak)
        for phase, seconds in timings.items():
            best[phase] = min(best.get(phase, float("inf")), seconds)

    print(f"schedule:     interleaved_1f1b {' '.join(f'{k}={v}' for k, v in params.items())}")
    print(f"actions:      {actions:,} ({instructions:,} instructions lowered)")
    print(f"result:       makespan {makespan:g} s, bubble {bubble:.4%} (default costs F=1 B=2)")
    print(f"load:         {best['load']:.3f} s   (parse + evaluate)")
    print(f"validate:     {best['validate']:.3f} s")
    print(f"lower:        {best['lower']:.3f} s   (includes its own validation)")
    print(f"simulate:     {best['simulate']:.3f} s   {actions / best['simulate']:,.0f} actions/s")
    print(
        f"command:      {best['command']:.3f} s   {best['command cpu']:.3f} s of CPU   peak {peaks['command']:.0f} MiB"
        " (pipedsl simulate --json)"
    )
    if args.baseline:
        print(
            f"baseline:     {best['baseline']:.3f} s   {best['baseline cpu']:.3f} s of CPU"
            f"   peak {peaks['baseline']:.0f} MiB ({args.baseline})"
        )
        print(
            f"ratio:        {best['baseline'] / best['command']:.2f}x faster than the baseline"
            f" ({best['baseline cpu'] / best['command cpu']:.2f}x in CPU time)"
        )
    figures = {"actions": actions, "simulate_s": best["simulate"], "command_s": best["command"],
               "command_cpu_s": best["command cpu"], "peak_mib": peaks["command"]}  # fmt: skip
    if args.baseline:
        figures |= {"baseline_s": best["baseline"], "baseline_peak_mib": peaks["baseline"]}
    record("bench_simulate", figures)


if __name__ == "__main__":
    main()
