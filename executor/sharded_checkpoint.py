"""A pipeline's sharded checkpoint: one orbax checkpoint per pipeline device, and the plan that
wrote them (``Pipeline.save`` and ``Pipeline.restore``, on either backend).

``path/step-<N>/`` is one saved version:

- ``device-<d>/``: pipeline device ``d``'s parameter leaves (``params/<flat index>``) and its
  stages' optimizer states (``opt_state/<stage>``), an orbax checkpoint (:func:`save_device`).
  On Ray the processes of ``d``'s mesh write it together, each the shards it holds (a mesh in
  one process, that process alone), while the other devices' processes write theirs; locally
  the one process writes every device's. Orbax
  writes it aside and renames it when complete. Any orbax reader opens it
  (``orbax.checkpoint.PyTreeCheckpointer``);
- ``plan.json``: the plan that saved it (:func:`plan_record`), written by the driver once
  every device's checkpoint is written, so it also marks the version complete.

A version is read back by any plan of the same model: :func:`latest_readable` refuses one
of another model (naming the first parameter that differs) and says where each stage was
saved; :func:`restore_device` reads each leaf and optimizer state a device keeps from the
saved device that held it, straight into this plan's shardings (orbax reshards on read), each
process its own shards. So a checkpoint of 4 Ray processes resumes on one process, with
another ``dp``, ``tp``, ZeRO stage, schedule or placement, and back.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.event_loops import draining
from pipedsl.ir import Schedule
from pipedsl.run_options import RunOptions

if TYPE_CHECKING:
    import optax

    from pipedsl.executor.runtime.worker import Worker
    from pipedsl.executor.stages.model import StagedModel

__all__ = [
    "PLAN",
    "plan_record",
    "new_version",
    "finish_version",
    "complete_versions",
    "latest_readable",
    "remove_older",
    "device_part",
    "save_device",
    "restore_device",
]

PLAN = "plan.json"


def plan_record(
    schedule: Schedule, options: RunOptions, *, processes: int, model: StagedModel, specs: Sequence[Any]
) -> dict[str, Any]:
    """The plan and model that write a version: the schedule, its placement, the mesh
    (``options``' degrees and ZeRO stage), the process count, every parameter leaf's place
    in the parameters' pytree with its dtype and shape, the stage that owns it, and its spec
    (``specs``, in leaf order). A version is read back by any plan of the same model (:func:`latest_readable`)."""
    params = jax.tree_util.tree_unflatten(model.param_treedef, list(model.param_avals))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {
        "schedule": schedule.name,
        "placement": list(schedule.placement),
        "dp": options.dp,
        "tp": options.tp,
        "zero": options.zero,
        "processes": processes,
        "leaves": [[jax.tree_util.keystr(path), _shown(a)] for path, a in leaves],
        "owners": list(model.owner),
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


def complete_versions(path: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete version under ``path``, by increasing step."""
    return sorted((step, v) for step, v in _versions(path) if (v / PLAN).exists())


def remove_older(path: str | Path, step: int) -> None:
    """Remove the versions under ``path`` of steps before ``step``, complete or left
    incomplete by a save that was stopped (call it once ``step``'s version is complete)."""
    for older, version in _versions(path):
        if older < step:
            shutil.rmtree(version)


def _versions(path: str | Path) -> list[tuple[int, Path]]:
    return [(int(v.name[5:]), v) for v in Path(path).glob("step-*") if v.name[5:].isdigit() and v.is_dir()]


def latest_readable(path: str | Path, plan: Mapping[str, Any]) -> tuple[int, Path, tuple[int, ...]]:
    """(step, directory, placement) of the latest complete version under ``path``, the
    placement (stage to pipeline device) being the one it was saved with, where
    :func:`restore_device` finds each leaf and state. Refuses the version unless it holds
    the model of ``plan`` (:func:`plan_record`): the same parameter leaves, owned by the
    same stages. The rest of the plan (schedule, placement, mesh, ZeRO stage, processes)
    may differ: orbax reads each array into the sharding asked for, whoever wrote it."""
    versions = complete_versions(path)
    if not versions:
        raise ExecutionError(f"{path}: no complete checkpoint (a step-<N> directory with {PLAN})")
    step, version = versions[-1]
    try:
        saved = json.loads((version / PLAN).read_text(encoding="utf-8"))["plan"]
        placement = tuple(int(d) for d in saved["placement"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ExecutionError(f"{version / PLAN}: not a plan record ({err})") from None
    # The parameters, else their owners: where the leaves differ, so do what owns them.
    differ = next((k for k in ("leaves", "owners") if saved.get(k) != plan[k]), None)
    if differ is not None:
        what = _difference(differ, saved.get(differ), plan[differ])
        raise ExecutionError(
            f"{version} holds another model's parameters ({what}); resume it with the model that saved it"
        )
    return step, version, placement


def _difference(key: str, saved: Any, here: Any) -> str:
    """One line of what differs under ``key``: for the parameters, the first leaf that does."""
    if key == "leaves" and isinstance(saved, list):
        if len(saved) != len(here):
            return f"parameters: {len(saved)} arrays saved, {len(here)} in this pipeline"
        (path, a), (path_here, b) = next((s, h) for s, h in zip(saved, here, strict=True) if s != h)
        if path != path_here:
            return f"parameters: params{path} saved where this pipeline has params{path_here}"
        return f"parameters: params{path} is {a} there and {b} here"
    if key == "owners" and isinstance(saved, list) and len(saved) == len(here):
        i = next(i for i, (s, h) in enumerate(zip(saved, here, strict=True)) if s != h)
        return f"parameter leaf {i} is owned by stage {saved[i]} there and stage {here[i]} here"
    return f"{key}: saved {saved!r}, this pipeline {here!r}"


def device_part(version: Path, device: int) -> str:
    """The directory of pipeline device ``device``'s orbax checkpoint in ``version``."""
    return str(version / f"device-{device}")


def save_device(worker: Worker, directory: str, *, processes: Sequence[int]) -> None:
    """Write ``worker``'s parameter leaves and optimizer states as the orbax checkpoint
    ``directory``. Every one of ``processes``, the processes of the worker's mesh, calls
    this at once and writes the shards it holds (a mesh in one process: that process
    alone, see :func:`_writable`); no other process takes part."""
    checkpointer, _, ocp = _checkpointer(processes, worker.index)
    try:
        tree = jax.tree_util.tree_map(
            _writable,
            {
                "params": {str(i): leaf for i, leaf in worker.leaves.items()},
                "opt_state": {str(s): state for s, state in worker.states.items()},
            },
        )
        with draining():
            checkpointer.save(directory, args=ocp.args.PyTreeSave(tree), force=True)
    except Exception as err:  # orbax's and the file system's errors alike, named as ours
        raise _failed(worker, "write", directory, err) from None
    finally:
        checkpointer.close()


def restore_device(
    worker: Worker,
    version: Path,
    optimizer: optax.GradientTransformation | None,
    *,
    processes: Sequence[int],
    placement: Sequence[int],
) -> None:
    """Load ``worker``'s parameter leaves, and with ``optimizer`` its stages' optimizer
    states, from ``version``, saved by a plan with ``placement`` (:func:`latest_readable`):
    each leaf from the checkpoint of the device that held the stage owning it, each state
    from its stage's, read straight into this worker's shardings. Every one of
    ``processes`` (the worker's mesh's) calls this at once and reads its own shards."""
    avals, owner = worker.model.param_avals, worker.model.owner
    # Per saved device, what this worker reads from its checkpoint.
    wanted: dict[int, dict[str, dict[str, Any]]] = {}
    for i, sharding in worker.kept().items():
        part = wanted.setdefault(placement[owner[i]], {"params": {}})
        part["params"][str(i)] = jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype, sharding=sharding)
    if optimizer is not None:
        for s in worker.local:
            part = wanted.setdefault(placement[s], {"params": {}})
            part.setdefault("opt_state", {})[str(s)] = worker.abstract_state(optimizer, s)
    leaves: dict[int, Any] = {}
    states: dict[int, Any] = {}
    checkpointer, handler, ocp = _checkpointer(processes, worker.index)
    try:
        for device, target in sorted(wanted.items()):
            directory = device_part(version, device)
            try:
                if "opt_state" in target:
                    _check_states(_tree_metadata(handler, directory), target["opt_state"], directory)
                restore = jax.tree_util.tree_map(
                    lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), target
                )
                # Part of what a device saved: the leaves and states this worker keeps.
                args = ocp.args.PyTreeRestore(target, restore_args=restore, partial_restore=True)
                with draining():
                    # Orbax reads only from an absolute path, whatever the directory given to the run.
                    saved = checkpointer.restore(Path(directory).absolute(), args=args)
            except ExecutionError as err:
                raise ExecutionError(str(err), stage=err.stage, device=worker.index) from None
            except Exception as err:  # orbax's and the file system's errors alike, named as ours
                raise _failed(worker, "read", directory, err) from None
            leaves |= {int(i): leaf for i, leaf in saved["params"].items()}
            states |= {int(s): state for s, state in saved.get("opt_state", {}).items()}
    finally:
        checkpointer.close()
    worker.load(leaves, states if optimizer is not None else None)


def _writable(value: Any) -> Any:
    """``value`` as orbax writes it. In a world of several processes orbax refuses an array
    that one process holds whole ("Cannot serialize host local jax.Array": it takes it for a
    ``pmap`` result), which every array of a pipeline device whose mesh lies in one process
    is. Such an array is handed to it as the global array it is plus a copy on as many
    devices of other processes, a copy that is never read: orbax writes the first copy of
    each shard (replica 0; replica-parallel writing is off, :func:`_checkpointer`), and that
    is this process's. The other processes take no part and no value moves; the checkpoint
    is the one a mesh across processes writes (its sharding file names the other devices)."""
    # A worker keeps every array on its mesh (a NamedSharding); anything else goes to orbax as it is.
    sharding = getattr(value, "sharding", None)
    if jax.process_count() == 1 or not isinstance(sharding, NamedSharding) or not value.is_fully_addressable:
        return value
    devices, names, spec = sharding.mesh.devices, sharding.mesh.axis_names, sharding.spec
    others = [d for d in jax.devices() if d.process_index != jax.process_index()][: devices.size]
    mesh = Mesh(np.stack([devices, np.array(others).reshape(devices.shape)]), ("copy", *names))
    shards = [shard.data for shard in value.addressable_shards]
    return jax.make_array_from_single_device_arrays(value.shape, NamedSharding(mesh, spec), shards)


def _tree_metadata(handler: Any, directory: str) -> Any:
    """Orbax's metadata of the tree saved in ``directory``; None where it cannot be read
    (a checkpoint missing or damaged: the restore then says what is wrong, in one line, where
    the checkpointer's own metadata call would log a warning beside it)."""
    try:
        with draining():
            return handler.metadata(Path(directory).absolute())
    except (FileNotFoundError, NotImplementedError, ValueError, TypeError):
        return None


def _check_states(saved: Mapping[str, Any] | None, states: Mapping[str, Any], directory: str) -> None:
    """Refuse optimizer states saved (``saved``: orbax's metadata of the checkpoint) by
    another optimizer than the one whose ``states`` are wanted, by stage, naming the stage
    and both states' arrays: orbax would only say that two trees differ. Without metadata
    (a checkpoint missing or broken) the restore itself says what is wrong."""
    if saved is None or "opt_state" not in saved:
        return
    for stage, state in states.items():
        there = [_shown(a) for a in jax.tree_util.tree_leaves(saved["opt_state"].get(stage))]
        here = [_shown(a) for a in jax.tree_util.tree_leaves(state)]
        if there != here:
            raise ExecutionError(
                f"{directory}: the optimizer state of stage {stage} was saved by another optimizer "
                f"({_listed(there)} there, {_listed(here)} for this one); resume with the optimizer that saved it",
                stage=int(stage),
            )


def _listed(arrays: Sequence[str]) -> str:
    return f"{len(arrays)} arrays: " + ", ".join(arrays[:4]) + (", ..." if len(arrays) > 4 else "")


def _shown(a: Any) -> str:
    """An array's (or shape's) dtype and shape, as ``float32[8,8]``."""
    return f"{a.dtype}[{','.join(map(str, a.shape))}]"


def _failed(worker: Worker, doing: str, directory: str, err: Exception) -> ExecutionError:
    # Orbax's messages can print whole trees: their first line says what went wrong.
    lines = str(err).splitlines()
    what = lines[0][:300] if lines else ""
    return ExecutionError(
        f"device {worker.index} could not {doing} {directory}: {type(err).__name__}: {what}", device=worker.index
    )


def _checkpointer(processes: Sequence[int], device: int) -> tuple[Any, Any, Any]:
    """An orbax checkpointer of the group ``processes`` (pipeline device ``device``'s) alone,
    its tree handler, and the orbax module (imported here: a Ray driver imports this module and writes no
    shards)."""
    import orbax.checkpoint as ocp

    first = min(processes)
    # Named barriers: every device's group writes at once, each waiting for its own.
    options = ocp.options.MultiprocessingOptions(
        primary_host=first, active_processes=set(processes), barrier_sync_key_prefix=f"pipedsl-device-{device}"
    )
    # The array handler writes each array's metadata from its own primary process, by
    # default process 0: a group without process 0 would write shards and no metadata.
    # Each shard is written by the process of its first copy: replica-parallel writing
    # would share a replicated shard among its copies, and the copy _writable adds is never written.
    arrays = ocp.type_handlers.ArrayHandler(primary_host=first, use_replica_parallel=False)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=options, type_handler_registry=registry)
    return ocp.Checkpointer(handler, multiprocessing_options=options), handler, ocp
