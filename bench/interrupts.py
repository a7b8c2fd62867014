"""Interrupt ``pipedsl run`` at 20 points spread over its start, its compilation and its
steps, and report every exit code: each must be 130, with the one line
``pipedsl run: interrupted`` on stderr and nothing else.

A first run, interrupted after its tenth step, times the three phases on this machine:
the start (imports, the model, the pipeline) ends when the table's header is printed,
the compilation (the first step traces and compiles the stages) when step 1 is, and the
steps follow. Then 20 runs get SIGINT at points spread over those phases (7 in the start,
7 in the compilation, 6 in the steps); the phase a run was in is read from what it had
printed when the signal went, as the phases' lengths move with the machine's load.

    python bench/interrupts.py [--steps-span S]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from timing import record

_COMMAND = ["-m", "pipedsl", "run", "1f1b", "-p", "pp=2", "-p", "microbatches=4", "--steps", "100000"]
_HEADER = " step"
_POINTS = (7, 7, 6)
"""Points in the start, the compilation and the steps."""
_GUARD_S = 300.0
"""How long a run may take to exit after its signal before it counts as hung."""


class _Run:
    """One ``pipedsl run``, its stdout followed on a thread with the time each line came."""

    def __init__(self) -> None:
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, *_COMMAND], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: list[tuple[float, str]] = []
        self.stderr = ""
        self._threads = [
            threading.Thread(target=self._follow, daemon=True),
            threading.Thread(target=self._errors, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _follow(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.perf_counter() - self.started, line))

    def _errors(self) -> None:
        assert self.process.stderr is not None
        self.stderr = self.process.stderr.read()

    def phase(self) -> str:
        """What the run is doing, by what it has printed."""
        seen = [line for _, line in self.lines]
        if not any(line.startswith(_HEADER) for line in seen):
            return "start"
        return "steps" if any("includes tracing and compilation" in line for line in seen) else "compile"

    def steps_done(self) -> int:
        return sum(1 for _, line in self.lines if line[:5].strip().isdigit())

    def interrupt(self) -> int | None:
        """SIGINT, then the exit code (None: no exit within the guard, killed)."""
        self.process.send_signal(signal.SIGINT)
        try:
            code = self.process.wait(timeout=_GUARD_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = None
        for thread in self._threads:
            thread.join()
        return code


@dataclass(frozen=True, slots=True)
class _Point:
    """One interrupted run: when the signal went (seconds after the start), the phase it
    found, the steps printed by then, the exit code and what stderr held."""

    at_s: float
    phase: str
    steps: int
    code: int | None
    stderr: str

    @property
    def clean(self) -> bool:
        return self.code == 130 and self.stderr == "pipedsl run: interrupted\n"


def _phases() -> tuple[float, float]:
    """(seconds to the header, seconds to step 1's line) of one run on this machine."""
    run = _Run()
    while run.steps_done() < 10 and run.process.poll() is None:
        time.sleep(0.01)
    run.interrupt()
    times = {}
    for at, line in run.lines:
        if line.startswith(_HEADER):
            times.setdefault("header", at)
        if "includes tracing and compilation" in line:
            times.setdefault("step 1", at)
    if len(times) < 2:
        raise SystemExit(f"the timing run did not reach its steps:\n{run.stderr}")
    return times["header"], times["step 1"]


def _spread(start: float, end: float, count: int) -> list[float]:
    """``count`` points inside (start, end), evenly apart."""
    return [start + (end - start) * (i + 1) / (count + 1) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-span", type=float, default=1.0, help="seconds of steps to spread points over")
    args = parser.parse_args()
    # The runs inherit SIGINT's default action even where this one was started with it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    header, first = _phases()
    print(f"timing run: header at {header:.2f} s, step 1 at {first:.2f} s")
    targets = (
        _spread(0.0, header, _POINTS[0])
        + _spread(header, first, _POINTS[1])
        + _spread(first, first + args.steps_span, _POINTS[2])
    )
    points = []
    for at in targets:
        run = _Run()
        time.sleep(max(at - (time.perf_counter() - run.started), 0.0))
        sent, phase, steps = time.perf_counter() - run.started, run.phase(), run.steps_done()
        code = run.interrupt()
        points.append(_Point(sent, phase, steps, code, run.stderr))
        print(f"  {sent:6.2f} s  {phase:<8} {steps:>5} steps  exit {code}", flush=True)

    print()
    print("| # | signal at (s) | phase | steps printed | exit | stderr |")
    print("|---|---|---|---|---|---|")
    for i, p in enumerate(points, 1):
        said = " / ".join(p.stderr.strip().splitlines()[-3:]) if p.stderr.strip() else "(nothing)"
        print(f"| {i} | {p.at_s:.2f} | {p.phase} | {p.steps} | {p.code} | {said} |")
    clean = sum(p.clean for p in points)
    print(f"\n{clean} of {len(points)} runs exited 130 with one line")
    phases = {phase: sum(p.phase == phase for p in points) for phase in ("start", "compile", "steps")}
    record(
        "bench_interrupts",
        {
            "points": len(points),
            "clean_130": clean,
            "codes": " ".join(str(p.code) for p in points),
            "phases": " ".join(f"{k}={v}" for k, v in phases.items()),
            "header_s": round(header, 2),
            "step1_s": round(first, 2),
        },
    )
    if clean < len(points):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
