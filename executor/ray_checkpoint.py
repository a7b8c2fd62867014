"""A Ray world's checkpoint on disk: per-process shard files and the plan that wrote them.

``path/step-<N>/`` is one saved version:

- ``device-<d>/process-<r>.pkl``: the shards process ``r`` holds of pipeline device ``d``'s
  parameter leaves and optimizer states, written by that process
  (:meth:`pipedsl.executor.ray_actor.WorldProcess.save`; whole or absent: written aside,
  flushed, renamed). Loading unpickles them: load only checkpoints you trust;
- ``plan.json``: the plan that saved it (:func:`plan_record`), written by the driver once
  every process has written its files, so it also marks the version complete.

The same plan puts the same shards on the same processes, so a process reads back exactly
the files it wrote; :func:`check_plan` refuses a version of another plan, naming what differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.mesh import MeshConfig
from pipedsl.ir import Schedule

__all__ = ["PLAN", "plan_record", "new_version", "finish_version", "latest_version", "check_plan"]

PLAN = "plan.json"


def plan_record(
    schedule: Schedule, mesh: MeshConfig, *, processes: int, leaves: Sequence[Any], specs: Sequence[Any]
) -> dict[str, Any]:
    """What a version must agree on to be read back in place: the schedule, its placement,
    the mesh, the process count, and every parameter leaf's shape, dtype and spec."""
    return {
        "schedule": schedule.name,
        "placement": list(schedule.placement),
        "dp": mesh.dp,
        "tp": mesh.tp,
        "zero": mesh.zero,
        "processes": processes,
        "leaves": [[list(a.shape), str(a.dtype)] for a in leaves],
        "specs": [str(spec) for spec in specs],
    }


def new_version(path: str | Path, step: int) -> Path:
    """The directory of step ``step``'s version under ``path`` (refused when complete already)."""
    version = Path(path).absolute() / f"step-{step}"
    if (version / PLAN).exists():
        raise ExecutionError(f"{version} already holds a saved step {step}; save under another step")
    return version


def finish_version(version: Path, step: int, plan: Mapping[str, Any]) -> None:
    """Write ``plan.json`` (aside, then renamed): the version is complete."""
    staged = version / (PLAN + ".partial")
    staged.write_text(json.dumps({"step": step, "plan": dict(plan)}, indent=1), encoding="utf-8")
    os.replace(staged, version / PLAN)


def latest_version(path: str | Path) -> tuple[int, Path]:
    """(step, directory) of the latest complete version under ``path``."""
    versions = sorted(
        (int(v.name[5:]), v) for v in Path(path).glob("step-*") if v.name[5:].isdigit() and (v / PLAN).exists()
    )
    if not versions:
        raise ExecutionError(f"{path}: no complete checkpoint (a step-<N> directory with {PLAN})")
    return versions[-1]


def check_plan(version: Path, plan: Mapping[str, Any]) -> None:
    """Refuse ``version`` unless it was saved by ``plan``, naming what differs."""
    try:
        saved = json.loads((version / PLAN).read_text(encoding="utf-8"))["plan"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ExecutionError(f"{version / PLAN}: not a plan record ({err})") from None
    differ = [k for k in plan if saved.get(k) != plan[k]]
    if differ:
        what = "; ".join(f"{k}: saved {saved.get(k)!r}, this pipeline {plan[k]!r}" for k in differ)
        raise ExecutionError(
            f"{version} was saved by another plan ({what}); resume it with the plan that saved it, or gather "
            "the parameters there and pass them as arrays"
        )
