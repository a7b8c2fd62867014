"""A Ray world's checkpoint on disk: one orbax checkpoint per pipeline device, and the plan
that wrote them.

``path/step-<N>/`` is one saved version:

- ``device-<d>/``: pipeline device ``d``'s parameter leaves (``params/<flat index>``) and its
  stages' optimizer states (``opt_state/<stage>``), an orbax checkpoint
  (:func:`write_shards`) written by the processes of ``d``'s mesh together, each the shards it
  holds, while the other devices' processes write theirs; orbax writes it aside and renames
  it when complete. Any orbax reader opens it (``orbax.checkpoint.PyTreeCheckpointer``);
- ``plan.json``: the plan that saved it (:func:`plan_record`), written by the driver once
  every process has written its files, so it also marks the version complete.

:func:`read_shards` reads a device's checkpoint back onto its mesh, each process its own
shards; :func:`check_plan` first refuses a version of another plan, naming what differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.mesh import MeshConfig
from pipedsl.ir import Schedule

__all__ = [
    "PLAN",
    "plan_record",
    "new_version",
    "finish_version",
    "latest_version",
    "check_plan",
    "write_shards",
    "read_shards",
]

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


def write_shards(directory: str, tree: Any, *, processes: Sequence[int], name: str) -> None:
    """Write ``tree`` (a pytree of ``jax.Array`` on one pipeline device's mesh, with string
    keys) as the orbax checkpoint ``directory``. Every one of ``processes``, the processes
    of that mesh, calls this at once and writes the shards it holds; no other process
    takes part (each device's processes write their own checkpoint at the same time).
    ``name`` tells this group's barriers from the other devices'."""
    checkpointer, ocp = _checkpointer(processes, name)
    try:
        checkpointer.save(directory, args=ocp.args.PyTreeSave(tree), force=True)
    finally:
        checkpointer.close()


def read_shards(directory: str, target: Any, *, processes: Sequence[int], name: str) -> Any:
    """The orbax checkpoint ``directory`` read onto ``target``'s shardings (a pytree of
    ``jax.ShapeDtypeStruct`` with shardings, the structure :func:`write_shards` was given):
    every one of ``processes`` calls this at once and reads its own shards."""
    checkpointer, ocp = _checkpointer(processes, name)
    restore = jax.tree_util.tree_map(
        lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), target
    )
    try:
        return checkpointer.restore(directory, args=ocp.args.PyTreeRestore(target, restore_args=restore))
    finally:
        checkpointer.close()


def _checkpointer(processes: Sequence[int], name: str) -> tuple[Any, Any]:
    """An orbax checkpointer of the group ``processes`` alone, and the orbax module
    (imported here: the driver imports this module and never writes shards)."""
    import orbax.checkpoint as ocp

    first = min(processes)
    options = ocp.options.MultiprocessingOptions(
        primary_host=first, active_processes=set(processes), barrier_sync_key_prefix=name
    )
    # The array handler writes each array's metadata from its own primary process, by
    # default process 0: a group without process 0 would write shards and no metadata.
    arrays = ocp.type_handlers.ArrayHandler(primary_host=first)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=options, type_handler_registry=registry)
    return ocp.Checkpointer(handler, multiprocessing_options=options), ocp
