"""Checkpoints: parameters and optimizer state saved to a directory, and read back.

A long run saves every few steps and, after a failure, starts a new pipeline from the
last save, losing at most the steps since::

    save_checkpoint("ckpt", pipe.gather(params), pipe.gather(opt_state), step=step)
    ...
    saved = load_checkpoint("ckpt")
    params, opt_state, loss = new_pipe.train_step(saved.params, saved.opt_state, batch, optimizer=opt)

A checkpoint is a directory of three files:

- ``manifest.json``: format, version, the step number, and the shape and dtype of
  every saved array (readable by anyone);
- ``arrays.npz``: the arrays, ``params/<i>`` and ``opt_state/<i>`` by flat leaf index;
- ``structure.pkl``: the pytree structures, pickled with every leaf replaced by its
  index (optax states are named tuples, which only pickle can rebuild). Loading
  unpickles this file: load only checkpoints you trust.

Saving writes a new directory beside the target and then renames it into place, so a
crash while saving leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pipedsl.executor.errors import ExecutionError

__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint"]

_FORMAT = "pipedsl-checkpoint"
_VERSION = 1
_PARTS = ("params", "opt_state")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What a checkpoint holds: the number of optimizer steps taken, the parameters and
    the optimizer state (None when none was saved), as pytrees of numpy arrays."""

    step: int
    params: Any
    opt_state: Any


def save_checkpoint(path: str | Path, params: Any, opt_state: Any = None, *, step: int) -> Path:
    """Save ``params`` and ``opt_state`` (pytrees of arrays on the driver; gather Ray
    handles first) after ``step`` optimizer steps to the directory ``path``, replacing
    any checkpoint there. Returns the path."""
    path = Path(path)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ExecutionError(f"step must be a whole number >= 0, got {step!r}")
    arrays: dict[str, np.ndarray] = {}
    skeletons: dict[str, Any] = {}
    described: dict[str, Any] = {}
    for part, tree in zip(_PARTS, (params, opt_state), strict=True):
        if tree is None and part == "opt_state":
            skeletons[part] = None
            described[part] = None
            continue
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        host = [np.asarray(leaf) for leaf in jax.device_get(leaves)]
        for i, leaf in enumerate(host):
            if leaf.dtype == object:
                raise ExecutionError(f"{part} leaf {i} is not an array ({type(leaves[i]).__name__}); gather Ray handles before saving")
            arrays[f"{part}/{i}"] = leaf
        skeletons[part] = jax.tree_util.tree_unflatten(treedef, list(range(len(host))))
        described[part] = [{"shape": list(leaf.shape), "dtype": leaf.dtype.name} for leaf in host]
    manifest = {"format": _FORMAT, "version": _VERSION, "step": step, "arrays": described}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        np.savez(staging / "arrays.npz", **arrays)
        (staging / "structure.pkl").write_bytes(pickle.dumps(skeletons))
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            staging.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(path)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise ExecutionError(f"{path}: cannot save the checkpoint: {err.strerror or err}") from err
    return path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint that :func:`save_checkpoint` wrote to the directory ``path``."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        skeletons = pickle.loads((path / "structure.pkl").read_bytes())
        with np.load(path / "arrays.npz", allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as err:
        raise ExecutionError(f"{path}: not a readable pipedsl checkpoint: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or manifest.get("version") != _VERSION:
        raise ExecutionError(f"{path}: not a pipedsl checkpoint of version {_VERSION} (manifest.json says otherwise)")
    trees = []
    for part in _PARTS:
        skeleton = skeletons.get(part)
        if skeleton is None:
            trees.append(None)
            continue
        try:
            trees.append(jax.tree_util.tree_map(lambda i, part=part: arrays[f"{part}/{i}"], skeleton))
        except KeyError as err:
            raise ExecutionError(f"{path}: arrays.npz lacks {err.args[0]}; the checkpoint is incomplete") from None
    return Checkpoint(step=int(manifest["step"]), params=trees[0], opt_state=trees[1])
