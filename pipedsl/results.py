"""Results as data: one JSON line per run of a benchmark or of the demo, and the page drawn from them.

Each run appends one line to ``<folder>/<name>.jsonl``::

    {"benchmark": "bench_parse", "date": "2026-12-04T18:20:00Z", "commit": "0123abcd4567",
     "dirty": false, "machine": {"cpu": "...", "cores": 2, "memory_gib": 24.0, "gpus": 0},
     "load": [1.5, 1.2, 0.6], "command": "python bench/bench_parse.py",
     "figures": {"best_s": 0.25, "actions_per_s": 1060000}}

``load`` is the 1, 5 and 15 minute load averages when the run ended (or, for a run
recorded before the log was kept as data, the words it was described with); ``figures``
maps a figure's name, unit last (``_s`` seconds, ``_ms``, ``_us``, ``_mib``), to a number
or a short text. ``python -m pipedsl.results FOLDER -o PAGE`` (``make results``) draws
every file of ``FOLDER`` as one Markdown page, a table per benchmark, newest run first, so
a table cannot drift from its data.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipedsl.errors import PipedslError

__all__ = ["Figure", "Run", "append_result", "main", "read_results", "render", "this_machine"]

Figure = int | float | str | bool | None
"""One figure of a run: a number (its unit in the figure's name) or a short text."""

RESULTS_ENV = "PIPEDSL_RESULTS_DIR"
"""The environment variable naming the folder that :func:`append_result` writes to when
it is given none (``make demo`` sets it; unset, nothing is written)."""

_GIT_TIMEOUT_S = 10.0
"""Seconds a ``git`` query for the commit may take before the commit is recorded as unknown."""

_TITLES = {
    "bench_parse": "Parse and expand interleaved 1F1B, pp=64, vpp=2, 1,024 microbatches (262,144 actions)",
    "bench_many_defs": "A file of 20,000 one-line defs: parse, evaluate, peak memory",
    "bench_simulate": "The whole `pipedsl simulate --json` of interleaved 1F1B, pp=64, vpp=2",
    "bench_synthesis": "Synthesise zb_auto, pp=8, 32 microbatches (4 variants, 768 actions)",
    "bench_search": "Plan search: GPT-3 175B on 1,024 A100s",
    "bench_against_jit": "The pipelined train_step against one jax.jit of the same step on one device (an 8-layer Llama, five plans)",
    "bench_executor_split": "The I/W split: (I + W) / B on a stage of 4 GELU layers 512 wide",
    "bench_executor_overhead": "The local backend's cost per step and per action (a model of negligible compute)",
    "bench_executor_per_action": "The executor's own cost per action on both backends (2 stages, 1F1B, 16 microbatches)",
    "bench_executor_dispatch": (
        "1F1B and ZB-H1 at pp=4, 8 microbatches: programs per device and host time per step and per action, "
        "each backend's tasks apart against its one program over the stage axis"
    ),
    "bench_executor_schedules": "Step times on the local backend: GPipe, 1F1B, ZB-H1, and one jax.jit of the same loop",
    "bench_hybrid_plans": "The demo transformer on 8 CPU devices: the search's plans, predicted against measured",
    "bench_hybrid_overhead": "The demo transformer on 8 CPU devices: the executor's steps against one jax.jit",
    "bench_ray_overhead": "The earlier Ray backend (one actor per pipeline device): cost per step and per action",
    "bench_ray_schedules": "The earlier Ray backend: step times against the local backend",
    "bench_world": "The Ray world: one hop as a compiled collective, the cost per action, a 4-process 1F1B step",
    "bench_transports": "One hop between two Ray actors by the earlier transports (transfer servers, actor calls)",
    "accel_check": "`bench/accel_check.sh` on one accelerator: the executor against `jax.value_and_grad` and one `jax.jit`",
    "demo": "`make demo`: the calibrated search's plans run for real, predicted against measured",
    "test_suite": "`make test`: the whole suite",
}
"""The heading of each benchmark's table; a benchmark missing here is headed by its name."""


@dataclass(frozen=True, slots=True)
class Run:
    """One recorded run (one line of a ``.jsonl`` file).

    Attributes:
      benchmark: what ran (the file's stem: ``bench_parse``, ``demo``).
      date: when it ended, ISO 8601 in UTC (``2026-12-04T18:20:00Z``), or the day alone.
      commit: the checkout's commit (12 hex digits), or None where unknown.
      dirty: whether the checkout had changes to tracked files beyond ``commit``.
      machine: what ran it (``cpu``, ``cores``, ``memory_gib``, ``gpus``; or ``text``).
      load: the 1, 5 and 15 minute load averages, or the words a run was described with.
      command: the command that reproduces the run.
      figures: name (unit last) -> value, in the order the benchmark gave them.
      note: what a reader needs to read the figures right, or None.
    """

    benchmark: str
    date: str
    commit: str | None
    dirty: bool
    machine: Mapping[str, Figure]
    load: tuple[float, ...] | str
    command: str
    figures: Mapping[str, Figure]
    note: str | None = None

    def to_json(self) -> str:
        record: dict[str, object] = {
            "benchmark": self.benchmark,
            "date": self.date,
            "commit": self.commit,
            "dirty": self.dirty,
            "machine": dict(self.machine),
            "load": list(self.load) if isinstance(self.load, tuple) else self.load,
            "command": self.command,
            "figures": dict(self.figures),
        }
        if self.note is not None:
            record["note"] = self.note
        return json.dumps(record, ensure_ascii=False)


def _git(folder: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> int:
    # The NVIDIA driver lists one folder per GPU; no driver, no GPU worth recording.
    folder = Path("/proc/driver/nvidia/gpus")
    return len(list(folder.iterdir())) if folder.is_dir() else 0


def this_machine() -> dict[str, Figure]:
    """What this machine is, as a run records it: CPU model, cores, memory (GiB), GPUs."""
    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "memory_gib": _memory_gib(), "gpus": _gpus()}


def _check_figures(figures: Mapping[str, Figure]) -> None:
    for name, value in figures.items():
        if not isinstance(name, str) or not isinstance(value, int | float | str | bool | type(None)):
            raise PipedslError(f"a run's figure {name!r} must be a number or a text, got {type(value).__name__}")


def append_result(
    benchmark: str,
    figures: Mapping[str, Figure],
    *,
    command: str,
    folder: str | Path | None = None,
    note: str | None = None,
) -> Path | None:
    """Append one line for this run to ``folder/<benchmark>.jsonl``; return the file.

    ``folder`` None means the folder named by ``$PIPEDSL_RESULTS_DIR``; with neither,
    nothing is written and None is returned. The commit is the one checked out where the
    folder is (None outside a git checkout), and the load is read as the run ends.
    """
    if folder is None:
        folder = os.environ.get(RESULTS_ENV) or None
        if folder is None:
            return None
    _check_figures(figures)
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    status = _git(path, "status", "--porcelain", "--untracked-files=no")
    run = Run(
        benchmark=benchmark,
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        commit=_git(path, "rev-parse", "--short=12", "HEAD"),
        dirty=bool(status),
        machine=this_machine(),
        load=tuple(round(x, 2) for x in os.getloadavg()),
        command=command,
        figures=dict(figures),
        note=note,
    )
    target = path / f"{benchmark}.jsonl"
    with open(target, "a", encoding="utf-8") as handle:
        handle.write(run.to_json() + "\n")
    return target


def _run(record: object, where: str) -> Run:
    if not isinstance(record, dict):
        raise PipedslError(f"{where}: expected one JSON object per line")
    missing = [k for k in ("benchmark", "date", "commit", "machine", "load", "command", "figures") if k not in record]
    if missing:
        raise PipedslError(f"{where}: the run lacks {', '.join(missing)}")
    if not isinstance(record["figures"], dict) or not isinstance(record["machine"], dict):
        raise PipedslError(f"{where}: 'figures' and 'machine' must be JSON objects")
    load = record["load"]
    if not (isinstance(load, str) or (isinstance(load, list) and all(isinstance(x, int | float) for x in load))):
        raise PipedslError(f"{where}: 'load' must be a list of load averages or a text")
    try:
        _check_figures(record["figures"])
    except PipedslError as err:
        raise PipedslError(f"{where}: {err}") from None
    return Run(
        benchmark=str(record["benchmark"]),
        date=str(record["date"]),
        commit=None if record["commit"] is None else str(record["commit"]),
        dirty=bool(record.get("dirty", False)),
        machine=record["machine"],
        load=load if isinstance(load, str) else tuple(float(x) for x in load),
        command=str(record["command"]),
        figures=record["figures"],
        note=None if record.get("note") is None else str(record["note"]),
    )


def read_results(folder: str | Path) -> dict[str, list[Run]]:
    """Every run in ``folder``'s ``.jsonl`` files, by benchmark (the file's stem), in file order.

    A line that is not a run raises :class:`PipedslError` naming the file and line.
    """
    found: dict[str, list[Run]] = {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        runs = found.setdefault(path.stem, [])
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PipedslError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
            runs.append(_run(record, where))
    return found


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _machine(machine: Mapping[str, Figure]) -> str:
    if "text" in machine:
        return str(machine["text"])
    parts = [f"{machine.get('cores')} cores"]
    memory = machine.get("memory_gib")
    if isinstance(memory, int | float):
        parts.append(f"{memory:.0f} GiB")
    if machine.get("cpu"):
        parts.append(str(machine["cpu"]))
    gpus = machine.get("gpus")
    parts.append(f"{gpus} GPU{'s' if gpus != 1 else ''}" if isinstance(gpus, int) and gpus > 0 else "no GPU")
    return ", ".join(parts)


def _load(load: tuple[float, ...] | str) -> str:
    return load if isinstance(load, str) else " / ".join(f"{x:.2f}" for x in load)


def _commit(run: Run) -> str:
    if run.commit is None:
        return "a working tree" if run.dirty else ""
    return f"`{run.commit}`" + (" (changed)" if run.dirty else "")


def _table(runs: Sequence[Run]) -> list[str]:
    names: list[str] = []
    for run in runs:
        names.extend(n for n in run.figures if n not in names)
    header = ["date", "commit", "machine", "load", "command", *names]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        cells: list[Figure] = [run.date, _commit(run), _machine(run.machine), _load(run.load), f"`{run.command}`"]
        cells += [run.figures.get(n) for n in names]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def render(results: Mapping[str, Sequence[Run]], *, folder: str = "bench/results") -> str:
    """The Markdown page of ``results``: one section per benchmark, its runs newest first."""
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `make results` from the JSON lines in `{folder}/` (one line per run: the",
        "date, the commit, the machine, its load, the command and the figures); edit the data, not",
        "this page. Figures move with the machine and its load: compare figures measured in one",
        "run, and read the load beside each (1, 5 and 15 minute averages).",
    ]
    order = [b for b in _TITLES if b in results] + sorted(b for b in results if b not in _TITLES)
    for benchmark in order:
        runs = sorted(results[benchmark], key=lambda r: r.date, reverse=True)
        if not runs:
            continue
        lines += ["", f"## {_TITLES.get(benchmark, benchmark)}", "", f"From `{folder}/{benchmark}.jsonl`.", ""]
        lines += _table(runs)
        notes = [(r.date, r.note) for r in runs if r.note]
        if notes:
            lines.append("")
            lines += [f"- {date}: {note}" for date, note in notes]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipedsl.results FOLDER [-o PAGE]``: draw the page (standard output without ``-o``)."""
    parser = argparse.ArgumentParser(prog="python -m pipedsl.results", description=main.__doc__)
    parser.add_argument("folder", help="the folder of .jsonl files (bench/results)")
    parser.add_argument("-o", "--output", help="write the page here (bench/RESULTS.md)")
    args = parser.parse_args(argv)
    try:
        page = render(read_results(args.folder), folder=Path(args.folder).as_posix())
    except PipedslError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(page)
    else:
        Path(args.output).write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
