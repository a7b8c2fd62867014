"""Timing helpers shared by the benchmark scripts (run as ``python bench/NAME.py``, which
puts this folder on ``sys.path``), and :func:`record`, which keeps each run's figures."""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pipedsl.results import RESULTS_ENV, Figure, append_result

RESULTS = Path(__file__).resolve().parent / "results"
"""Where every benchmark run appends its line (``make results`` draws bench/RESULTS.md from it)."""


def record(benchmark: str, figures: Mapping[str, Figure]) -> None:
    """Append this run's ``figures`` to ``bench/results/<benchmark>.jsonl`` (or to the folder
    ``$PIPEDSL_RESULTS_DIR`` names, where the checkout is read-only, as on an accelerator
    machine) with the command that ran it, the commit, the machine and its load
    (:func:`pipedsl.results.append_result`)."""
    command = shlex.join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    path = append_result(benchmark, figures, command=command, folder=os.environ.get(RESULTS_ENV) or RESULTS)
    print(f"\nrecorded in {path} (make results redraws bench/RESULTS.md from bench/results)")


def interleaved_medians(fns: dict[Any, Callable[[], Any]], repeat: int, *, burst: int = 1) -> dict[Any, float]:
    """Median wall seconds of each function (see :func:`wall_and_cpu_medians`)."""
    return {name: wall for name, (wall, _) in wall_and_cpu_medians(fns, repeat, burst=burst).items()}


def wall_and_cpu_medians(
    fns: dict[Any, Callable[[], Any]], repeat: int, *, burst: int = 1
) -> dict[Any, tuple[float, float]]:
    """(median wall seconds, median process CPU seconds) of each function, timed in turn
    so that load drifts hit all alike; CPU time moves less with the machine's load.

    Each function is called once first (compilation, caches), and every call is waited
    for with ``jax.block_until_ready``. With ``burst`` above 1, each turn calls a function
    ``burst`` times and times all but the first, as a loop of steps runs it: what another
    function's turn left behind (threads of its own still winding down, caches it took)
    is then not counted against it.
    """
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[Any, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            for call in range(burst):
                wall, cpu = time.perf_counter(), time.process_time()
                jax.block_until_ready(fn())
                if call or burst == 1:
                    times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for name, ts in times.items()
    }


def medians_with_recordings(
    timed: dict[str, Callable[[], Any]], pipes: dict[str, Any], params: Any, batch: Any, repeat: int
) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """:func:`interleaved_medians` of ``timed``, with one recorded step of every pipeline
    in ``pipes`` taken in each round (so the recordings see the same load), and those
    recorded timelines by pipeline name."""
    recorded: dict[str, list[Any]] = {name: [] for name in pipes}

    def record_all() -> None:
        for name, pipe in pipes.items():
            recorded[name].append(pipe.step(params, batch, record=True).timeline)

    medians = interleaved_medians({**timed, "record": record_all}, repeat)
    del medians["record"]
    return medians, recorded
