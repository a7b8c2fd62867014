"""A pipeline's sharded checkpoint: one orbax checkpoint per pipeline device, and the plan that
wrote them (``Pipeline.save`` and ``Pipeline.restore``, on either backend).

``path/step-<N>/`` is one saved version:

- ``device-<d>/``: pipeline device ``d``'s parameter leaves (``params/<flat index>``) and its
  stages' optimizer states (``opt_state/<stage>``), an orbax checkpoint (:func:`save_device`).
  On Ray the processes of ``d``'s mesh write it together, each the shards it holds, while the
  other devices' processes write theirs; locally the one process writes every device's. Orbax
  writes it aside and renames it when complete. Any orbax reader opens it
  (``orbax.checkpoint.PyTreeCheckpointer``);
- ``plan.json``: the plan that saved it (:func:`plan_record`), written by the driver once
  every device's checkpoint is written, so it also marks the version complete.

:func:`restore_device` reads a device's checkpoint back onto its mesh, each process its own
shards; :func:`check_plan` first refuses a version of another plan, naming what differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.mesh import MeshConfig
from pipedsl.ir import Schedule

if TYPE_CHECKING:
    import optax

    from pipedsl.executor.worker import Worker

__all__ = [
    "PLAN",
    "plan_record",
    "new_version",
    "finish_version",
    "latest_version",
    "check_plan",
    "device_part",
    "save_device",
    "restore_device",
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


def device_part(version: Path, device: int) -> str:
    """The directory of pipeline device ``device``'s orbax checkpoint in ``version``."""
    return str(version / f"device-{device}")


def save_device(worker: Worker, directory: str, *, processes: Sequence[int]) -> None:
    """Write ``worker``'s parameter leaves and optimizer states as the orbax checkpoint
    ``directory``. Every one of ``processes``, the processes of the worker's mesh, calls
    this at once and writes the shards it holds; no other process takes part."""
    tree = {
        "params": {str(i): leaf for i, leaf in worker.leaves.items()},
        "opt_state": {str(s): state for s, state in worker.states.items()},
    }
    checkpointer, ocp = _checkpointer(processes, worker.index)
    try:
        checkpointer.save(directory, args=ocp.args.PyTreeSave(tree), force=True)
    except Exception as err:  # orbax's and the file system's errors alike, named as ours
        raise _failed(worker, "write", directory, err) from None
    finally:
        checkpointer.close()


def restore_device(
    worker: Worker, directory: str, optimizer: optax.GradientTransformation | None, *, processes: Sequence[int]
) -> None:
    """Load what :func:`save_device` wrote for ``worker`` back onto its mesh (the same plan
    puts the same shards on the same processes), the optimizer states only with
    ``optimizer``; every one of ``processes`` calls this at once and reads its own shards."""
    avals = worker.model.param_avals
    target: dict[str, Any] = {
        "params": {
            str(i): jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype, sharding=sharding)
            for i, sharding in worker.kept().items()
        }
    }
    if optimizer is not None:
        target["opt_state"] = {str(s): worker.abstract_state(optimizer, s) for s in worker.local}
    checkpointer, ocp = _checkpointer(processes, worker.index)
    restore = jax.tree_util.tree_map(
        lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), target
    )
    try:
        # Without an optimizer only the parameters are read: part of what was saved.
        args = ocp.args.PyTreeRestore(target, restore_args=restore, partial_restore=optimizer is None)
        saved = checkpointer.restore(directory, args=args)
    except Exception as err:  # orbax's and the file system's errors alike, named as ours
        raise _failed(worker, "read", directory, err) from None
    finally:
        checkpointer.close()
    worker.load({int(i): leaf for i, leaf in saved["params"].items()}, None)
    if optimizer is not None:
        worker.load(None, {int(s): state for s, state in saved["opt_state"].items()})


def _failed(worker: Worker, doing: str, directory: str, err: Exception) -> ExecutionError:
    # Orbax's messages can print whole trees: their first line says what went wrong.
    lines = str(err).splitlines()
    what = lines[0][:300] if lines else ""
    return ExecutionError(
        f"device {worker.index} could not {doing} {directory}: {type(err).__name__}: {what}", device=worker.index
    )


def _checkpointer(processes: Sequence[int], device: int) -> tuple[Any, Any]:
    """An orbax checkpointer of the group ``processes`` (pipeline device ``device``'s) alone,
    and the orbax module (imported here: a Ray driver imports this module and writes no
    shards)."""
    import orbax.checkpoint as ocp

    first = min(processes)
    # Named barriers: every device's group writes at once, each waiting for its own.
    options = ocp.options.MultiprocessingOptions(
        primary_host=first, active_processes=set(processes), barrier_sync_key_prefix=f"pipedsl-device-{device}"
    )
    # The array handler writes each array's metadata from its own primary process, by
    # default process 0: a group without process 0 would write shards and no metadata.
    arrays = ocp.type_handlers.ArrayHandler(primary_host=first)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=options, type_handler_registry=registry)
    return ocp.Checkpointer(handler, multiprocessing_options=options), ocp
