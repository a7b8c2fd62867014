"""Checkpoints: parameters and optimizer state saved to a directory, and read back.

A long run saves every few steps and, after a failure, starts a new pipeline from the
last save, losing at most the steps since::

    save_checkpoint("ckpt", pipe.gather(params), pipe.gather(opt_state), step=step)
    ...
    saved = load_checkpoint("ckpt", like_params=params)
    params, opt_state, loss = new_pipe.train_step(saved.params, saved.opt_state, batch, optimizer=opt)

The directory ``ckpt`` holds one complete version per save and a pointer to the
current one:

- ``LATEST``: the name of the current version's directory, one line;
- ``step-<N>-<token>/``: one version, three files:

  - ``manifest.json``: format, version, the step number, and the shape and dtype of
    every saved array (readable by anyone);
  - ``arrays.npz``: the arrays, ``params/<i>`` and ``opt_state/<i>`` by flat leaf index;
  - ``structure.pkl``: the pytree structures, pickled with every leaf replaced by its
    index (optax states are named tuples, which only pickle can rebuild). Loading
    unpickles this file: load only checkpoints you trust.

- ``.lock``: held (``flock``) by whoever saves or tidies, so that two of them never
  remove each other's files.

A save writes a complete version into a staging directory inside ``ckpt``, flushes it
to disk, renames it to its version name and then replaces ``LATEST`` in one rename.
Killed at any instant, a save leaves ``LATEST`` naming either the previous version or
the new one, both complete; the leftovers of a killed save (staging directories, an
unreferenced version, a half-written pointer) are removed by the next save or load.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipedsl.executor.errors import ExecutionError

__all__ = ["Checkpoint", "CheckpointError", "save_checkpoint", "load_checkpoint"]

_FORMAT = "pipedsl-checkpoint"
_VERSION = 2
_PARTS = ("params", "opt_state")
_LATEST = "LATEST"
_LOCK = ".lock"
_VERSION_NAME = re.compile(r"step-(\d+)-[0-9a-f]{16}")
_STAGING_PREFIX = ".staging-"
_POINTER_PREFIX = ".LATEST-"
LOCK_TIMEOUT_S = 60.0
"""Seconds a save or load waits for another process's save in the same directory."""


class CheckpointError(ExecutionError):
    """A checkpoint that cannot be saved, read, or used with the pipeline at hand."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What a checkpoint holds: the number of optimizer steps taken, the parameters and
    the optimizer state (None when none was saved), as pytrees of numpy arrays."""

    step: int
    params: Any
    opt_state: Any


# -- saving -----------------------------------------------------------------------


def save_checkpoint(path: str | Path, params: Any, opt_state: Any = None, *, step: int) -> Path:
    """Save ``params`` and ``opt_state`` (pytrees of arrays on the driver; gather Ray
    handles first) after ``step`` optimizer steps to the directory ``path``, replacing
    the checkpoint there atomically (see the module's docstring). Returns the path."""
    path = Path(path)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a whole number >= 0, got {step!r}")
    arrays, skeletons, described = _flatten(params, opt_state)
    manifest = {"format": _FORMAT, "version": _VERSION, "step": step, "arrays": described}
    try:
        _prepare_directory(path)
        with _locked(path, exclusive=True):
            _tidy(path)
            version = _write_version(path, arrays, skeletons, manifest, step=step)
            _point_to(path, version)
            _tidy(path)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot save the checkpoint: {err.strerror or err}") from err
    return path


def _flatten(params: Any, opt_state: Any) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """(arrays by name, structures with leaf indices, per part the leaves' shapes and dtypes)."""
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
                raise CheckpointError(
                    f"{part} leaf {i} is not an array ({type(leaves[i]).__name__}); gather Ray handles before saving"
                )
            arrays[f"{part}/{i}"] = leaf
        skeletons[part] = jax.tree_util.tree_unflatten(treedef, list(range(len(host))))
        described[part] = [{"shape": list(leaf.shape), "dtype": leaf.dtype.name} for leaf in host]
    return arrays, skeletons, described


def _prepare_directory(path: Path) -> None:
    """Create ``path``, or check that everything in it is a checkpoint's: saving into a
    directory of other files would mix them with ours (and tidying would not know them)."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: exists and is not a directory; checkpoints are directories")
    path.mkdir(parents=True, exist_ok=True)
    foreign = sorted(entry.name for entry in path.iterdir() if not _is_ours(entry.name))
    if foreign:
        raise CheckpointError(
            f"{path}: holds files that are not part of a checkpoint ({', '.join(foreign[:3])}); "
            "save into a new or empty directory"
        )


def _is_ours(name: str) -> bool:
    return (
        name in (_LATEST, _LOCK)
        or name.startswith((_STAGING_PREFIX, _POINTER_PREFIX))
        or _VERSION_NAME.fullmatch(name) is not None
    )


def _write_version(
    path: Path, arrays: dict[str, np.ndarray], skeletons: dict[str, Any], manifest: dict[str, Any], *, step: int
) -> str:
    """Write one complete version into a staging directory, flush it and rename it to
    its version name (not yet current). Returns that name."""
    token = secrets.token_hex(8)
    staging = path / f"{_STAGING_PREFIX}{token}"
    staging.mkdir()
    try:
        with open(staging / "arrays.npz", "wb") as out:
            np.savez(out, allow_pickle=False, **arrays)
            _flush(out)
        with open(staging / "structure.pkl", "wb") as out:
            pickle.dump(skeletons, out)
            _flush(out)
        with open(staging / "manifest.json", "w", encoding="utf-8") as out:
            out.write(json.dumps(manifest, indent=1) + "\n")
            _flush(out)
        _fsync_directory(staging)
        name = f"step-{step}-{token}"
        os.rename(staging, path / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_directory(path)
    return name


def _point_to(path: Path, version: str) -> None:
    """Make ``version`` the current one: a complete pointer file renamed onto ``LATEST``."""
    pointer = path / f"{_POINTER_PREFIX}{secrets.token_hex(8)}"
    with open(pointer, "w", encoding="utf-8") as out:
        out.write(version + "\n")
        _flush(out)
    os.replace(pointer, path / _LATEST)
    _fsync_directory(path)


def _flush(file: Any) -> None:
    file.flush()
    os.fsync(file.fileno())


def _fsync_directory(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a crash of the machine, not only
    of the process, then keeps it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tidy(path: Path) -> None:
    """Remove what killed saves left: staging directories, pointer files never renamed,
    and every version but the current one. Call with the lock held."""
    current = _read_pointer(path)
    for entry in path.iterdir():
        name = entry.name
        if name.startswith(_STAGING_PREFIX) or (_VERSION_NAME.fullmatch(name) and name != current):
            shutil.rmtree(entry, ignore_errors=True)
        elif name.startswith(_POINTER_PREFIX):
            entry.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(path: Path, *, exclusive: bool) -> Iterator[bool]:
    """Hold ``path/.lock``: for a save, waiting up to :data:`LOCK_TIMEOUT_S` for another
    save; for a load, only when that is possible at once. Yields whether it is held; a
    directory one cannot write to (a read-only copy) is loaded without the lock."""
    try:
        fd = os.open(path / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        if exclusive:
            raise
        yield False
        return
    try:
        yield _acquire(fd, path, wait=exclusive)
    finally:
        os.close(fd)


def _acquire(fd: int, path: Path, *, wait: bool) -> bool:
    """Take the exclusive lock on ``fd``; without ``wait``, give up at once if it is taken."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if not wait:
            return False
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{path}: another process has been saving a checkpoint here for over "
                f"{LOCK_TIMEOUT_S:.0f} s; save to another directory"
            )
        time.sleep(0.05)


# -- loading ----------------------------------------------------------------------


def load_checkpoint(path: str | Path, *, like_params: Any = None, like_opt_state: Any = None) -> Checkpoint:
    """Read the current checkpoint that :func:`save_checkpoint` wrote to ``path``.

    Every part is checked: the manifest (format, a whole ``step`` >= 0, a shape and
    dtype per array), the arrays against the manifest, and the structure against the
    arrays. With ``like_params`` or ``like_opt_state`` (pytrees of arrays or
    ``jax.ShapeDtypeStruct``: what the pipeline at hand trains, for example freshly
    initialised parameters) the saved tree must have the same structure, shapes and
    dtypes; the error names the first leaf that differs. Leftovers of a killed save are
    removed first when no save is under way.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a readable pipedsl checkpoint: no such directory")
    try:
        with _locked(path, exclusive=False) as locked:
            if locked:
                _tidy(path)
            saved = _read_current(path)
    except OSError as err:
        raise CheckpointError(f"{path}: not a readable pipedsl checkpoint: {err.strerror or err}") from None
    for part, tree, like in zip(_PARTS, (saved.params, saved.opt_state), (like_params, like_opt_state), strict=True):
        if like is not None:
            _compare(path, part, tree, like)
    return saved


def _read_current(path: Path, *, attempts: int = 3) -> Checkpoint:
    """The version ``LATEST`` names. A save in another process may make a newer one
    current and remove this one between reading ``LATEST`` and reading the version;
    then the newer one is read instead."""
    attempt = 1
    while True:
        current = _read_pointer(path)
        if current is None:
            raise CheckpointError(
                f"{path}: not a readable pipedsl checkpoint: no {_LATEST} file naming a saved version "
                "(nothing was saved here, or the first save was interrupted)"
            )
        try:
            if not (path / current).is_dir():
                raise CheckpointError(
                    f"{path / _LATEST}: names {current[:80]!r}, which is not a saved version in {path}"
                )
            return _read_version(path / current)
        except (OSError, CheckpointError):
            if attempt == attempts or _read_pointer(path) == current:
                raise
        attempt += 1


def _read_pointer(path: Path) -> str | None:
    """The current version's name from ``LATEST`` (checked to be a version name, not
    that the version is there: :func:`_read_current` does that), or None when there is none."""
    try:
        name = (path / _LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path / _LATEST}: not a version name (not text)") from None
    if _VERSION_NAME.fullmatch(name) is None:
        raise CheckpointError(f"{path / _LATEST}: names {name[:80]!r}, which is not a saved version in {path}")
    return name


def _read_version(version: Path) -> Checkpoint:
    try:
        manifest = json.loads((version / "manifest.json").read_text(encoding="utf-8"))
        skeletons = pickle.loads((version / "structure.pkl").read_bytes())
        with np.load(version / "arrays.npz", allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - unpickling and unzipping fail in many ways; all mean a damaged file
        raise CheckpointError(f"{version}: not a readable pipedsl checkpoint: {type(err).__name__}: {err}") from None
    step, described = _check_manifest(version, manifest)
    if not isinstance(skeletons, dict) or set(skeletons) != set(_PARTS):
        raise CheckpointError(f"{version}/structure.pkl: expected the structures of {list(_PARTS)}")
    expected_names = {f"{part}/{i}" for part in _PARTS for i in range(len(described[part] or ()))}
    if set(arrays) != expected_names:
        missing, extra = sorted(expected_names - set(arrays)), sorted(set(arrays) - expected_names)
        raise CheckpointError(
            f"{version}/arrays.npz: does not match the manifest (missing {missing[:3]}, extra {extra[:3]})"
        )
    trees = [_rebuild(version, part, skeletons[part], described[part], arrays) for part in _PARTS]
    if trees[0] is None:
        raise CheckpointError(f"{version}: the checkpoint has no parameters")
    return Checkpoint(step=step, params=trees[0], opt_state=trees[1])


def _check_manifest(version: Path, manifest: Any) -> tuple[int, dict[str, Any]]:
    """The manifest's step and per-part leaf descriptions, checked."""
    where = f"{version}/manifest.json"
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise CheckpointError(f'{where}: not a pipedsl checkpoint (expected "format": "{_FORMAT}")')
    if manifest.get("version") != _VERSION:
        raise CheckpointError(
            f"{where}: format version {manifest.get('version')!r}; this pipedsl reads version {_VERSION}"
        )
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f'{where}: "step" must be a whole number >= 0, got {step!r}')
    described = manifest.get("arrays")
    if not isinstance(described, dict) or set(described) != set(_PARTS):
        raise CheckpointError(f'{where}: "arrays" must describe {list(_PARTS)}')
    for part in _PARTS:
        entries = described[part]
        if entries is None and part == "opt_state":
            continue
        if not isinstance(entries, list):
            raise CheckpointError(f'{where}: "arrays".{part} must be a list of {{shape, dtype}}')
        for i, entry in enumerate(entries):
            shape = entry.get("shape") if isinstance(entry, dict) else None
            dtype = entry.get("dtype") if isinstance(entry, dict) else None
            if (
                not isinstance(shape, list)
                or not all(type(n) is int and n >= 0 for n in shape)
                or not isinstance(dtype, str)
            ):
                raise CheckpointError(f'{where}: {part} leaf {i} needs a "shape" of whole numbers >= 0 and a "dtype"')
    return step, described


def _rebuild(
    version: Path, part: str, skeleton: Any, described: list[dict[str, Any]] | None, arrays: dict[str, np.ndarray]
) -> Any:
    """The tree ``skeleton`` with leaf ``i`` replaced by array ``part/i``, each checked
    against the manifest's shape and dtype."""
    if skeleton is None or described is None:
        if skeleton is not None or described is not None:
            raise CheckpointError(f"{version}: the manifest and structure.pkl disagree on whether {part} was saved")
        return None
    leaves = jax.tree_util.tree_leaves(skeleton)
    if leaves != list(range(len(described))):
        raise CheckpointError(
            f"{version}/structure.pkl: the {part} structure has {len(leaves)} leaves; the manifest lists {len(described)}"
        )
    restored = []
    for i, entry in enumerate(described):
        array = arrays[f"{part}/{i}"]
        dtype = _dtype(entry["dtype"])
        if dtype is None:
            raise CheckpointError(
                f"{version}/manifest.json: {part} leaf {i} has an unknown dtype {entry['dtype'][:40]!r}"
            )
        # npz keeps dtypes numpy does not know (bfloat16) as raw bytes of the same size.
        if array.dtype != dtype and array.dtype.kind == "V" and array.dtype.itemsize == dtype.itemsize:
            array = array.view(dtype)
        if list(array.shape) != entry["shape"] or array.dtype != dtype:
            raise CheckpointError(
                f"{version}: {part} leaf {i} is {array.dtype.name}{list(array.shape)} in arrays.npz but "
                f"{entry['dtype']}{entry['shape']} in the manifest"
            )
        restored.append(array)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(skeleton), restored)


def _dtype(name: str) -> np.dtype[Any] | None:
    try:
        return np.dtype(jnp.dtype(name))
    except TypeError:
        return None


def _compare(path: Path, part: str, saved: Any, like: Any) -> None:
    """Fail unless ``saved`` has ``like``'s structure, shapes and dtypes, naming the
    first difference by its key path."""
    if saved is None:
        raise CheckpointError(f"{path}: the checkpoint holds no {part}, but this pipeline needs one")
    got = jax.tree_util.tree_flatten_with_path(saved)[0]
    want = jax.tree_util.tree_flatten_with_path(like)[0]
    for (got_path, got_leaf), (want_path, want_leaf) in zip(got, want, strict=False):
        if got_path != want_path:
            raise CheckpointError(
                f"{path}: the checkpoint is of another model or optimizer: its {part} has "
                f"{jax.tree_util.keystr(got_path) or 'a leaf'} where this pipeline has {jax.tree_util.keystr(want_path)}"
            )
        want_shape, want_dtype = tuple(np.shape(want_leaf)), np.dtype(jnp.result_type(want_leaf))
        if got_leaf.shape != want_shape or got_leaf.dtype != want_dtype:
            raise CheckpointError(
                f"{path}: the checkpoint is of another model or optimizer: {part}{jax.tree_util.keystr(got_path)} is "
                f"{got_leaf.dtype.name}{list(got_leaf.shape)} there and {want_dtype.name}{list(want_shape)} here"
            )
    if len(got) != len(want):
        which = got if len(got) > len(want) else want
        first = jax.tree_util.keystr(which[min(len(got), len(want))][0])
        raise CheckpointError(
            f"{path}: the checkpoint is of another model or optimizer: its {part} has {len(got)} arrays, this "
            f"pipeline's {len(want)} (the first unmatched is {part}{first})"
        )
    if jax.tree_util.tree_structure(saved) != jax.tree_util.tree_structure(like):  # type: ignore[operator]  # jaxlib stubs omit PyTreeDef.__eq__
        raise CheckpointError(
            f"{path}: the checkpoint is of another model or optimizer: its {part} has the structure "
            f"{str(jax.tree_util.tree_structure(saved))[:200]}, this pipeline's is {str(jax.tree_util.tree_structure(like))[:200]}"
        )
