"""Checkpoints are never lost or silently wrong: atomic saves, full checks on load.

The kill test runs a real process that saves over and over, reads the checkpoint while
it saves, and kills it with SIGKILL at random moments: every read, and the directory
after every kill, hold a complete checkpoint (after a kill: the last one the process
finished, or the one it was writing), and the next save leaves nothing of the killed one
behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipedsl.executor.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint


def _params() -> dict[str, Any]:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [np.ones(3, np.float32)]}


def _version(path: Path) -> Path:
    return path / (path / "LATEST").read_text().strip()


def test_round_trip_keeps_structure_shapes_and_dtypes(tmp_path: Path) -> None:
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "h": np.ones(4, jnp.bfloat16)}
    state = optax.adam(1e-3).init(params)
    save_checkpoint(tmp_path / "ckpt", params, state, step=3)
    saved = load_checkpoint(tmp_path / "ckpt", like_params=params, like_opt_state=state)
    assert saved.step == 3
    assert saved.params["h"].dtype == jnp.bfloat16
    assert jax.tree_util.tree_structure(saved.opt_state) == jax.tree_util.tree_structure(state)
    np.testing.assert_array_equal(saved.params["w"], params["w"])


def test_a_save_replaces_the_last_and_keeps_one_version(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    for step in (1, 2, 2):
        save_checkpoint(path, _params(), None, step=step)
    assert load_checkpoint(path).step == 2
    names = sorted(p.name for p in path.iterdir())
    assert names[:2] == [".lock", "LATEST"] and len(names) == 3 and names[2].startswith("step-2-")


def test_leftovers_of_a_killed_save_are_removed_by_the_next_load_and_save(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    save_checkpoint(path, _params(), None, step=1)
    current = _version(path)
    (path / ".staging-0123456789abcdef").mkdir()
    (path / ".staging-0123456789abcdef" / "arrays.npz").write_bytes(b"x" * 1000)
    (path / ".LATEST-0123456789abcdef").write_text("step-9-0123456789abcdef")
    (path / "step-9-0123456789abcdef").mkdir()
    assert load_checkpoint(path).step == 1
    assert sorted(p.name for p in path.iterdir()) == [".lock", "LATEST", current.name]
    (path / ".staging-fedcba9876543210").mkdir()
    save_checkpoint(path, _params(), None, step=2)
    assert not any(p.name.startswith(".staging-") for p in path.iterdir())


def test_another_model_or_optimizer_is_refused_naming_the_first_difference(tmp_path: Path) -> None:
    params = _params()
    save_checkpoint(tmp_path / "ckpt", params, optax.adam(1e-3).init(params), step=1)
    cases = [
        ({"like_params": {"w": params["w"]}}, r"its params has \['b'\]\[0\] where this pipeline has \['w'\]"),
        (
            {"like_params": {**params, "w": np.zeros((3, 2), np.float32)}},
            r"params\['w'\] is float32\[2, 3\] there and float32\[3, 2\] here",
        ),
        (
            {"like_params": {**params, "w": params["w"].astype(np.float16)}},
            r"params\['w'\] is float32\[2, 3\] there and float16\[2, 3\]",
        ),
        ({"like_params": [params]}, "another model or optimizer"),
        ({"like_opt_state": optax.sgd(0.1, momentum=0.9).init(params)}, "its opt_state has"),
        ({"like_opt_state": optax.adamw(1e-3).init(params)}, "opt_state has the structure"),
    ]
    for like, message in cases:
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(tmp_path / "ckpt", **like)
    save_checkpoint(tmp_path / "none", params, None, step=1)
    with pytest.raises(CheckpointError, match="holds no opt_state"):
        load_checkpoint(tmp_path / "none", like_opt_state=optax.adam(1e-3).init(params))


def _edit_manifest(path: Path, edit: Any) -> None:
    manifest_file = _version(path) / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    edit(manifest)
    manifest_file.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.pop("step"), '"step" must be a whole number >= 0, got None'),
        (lambda m: m.update(step=-1), "got -1"),
        (lambda m: m.update(step=2.5), "got 2.5"),
        (lambda m: m.update(step=True), "got True"),
        (lambda m: m.update(step="3"), "got '3'"),
        (lambda m: m.update(version=1), "format version 1"),
        (lambda m: m.update(format="other"), "not a pipedsl checkpoint"),
        (lambda m: m.pop("arrays"), '"arrays" must describe'),
        (lambda m: m["arrays"]["params"][1].update(shape=[3, 2]), r"float32\[2, 3\] in arrays.npz but float32\[3, 2\]"),
        (lambda m: m["arrays"]["params"][0].update(shape=[-1]), 'shape" of whole numbers'),
        (lambda m: m["arrays"]["params"][0].update(dtype="int32"), r"float32\[3\] in arrays.npz but int32\[3\]"),
        (lambda m: m["arrays"]["params"][1].update(dtype="nonsense"), "unknown dtype"),
        (lambda m: m["arrays"]["params"].pop(), "does not match the manifest"),
        (lambda m: m["arrays"].update(opt_state=None), "does not match the manifest"),
    ],
)
def test_the_manifest_is_checked_against_itself_and_the_arrays(tmp_path: Path, edit: Any, message: str) -> None:
    params = _params()
    save_checkpoint(tmp_path / "ckpt", params, optax.sgd(0.1, momentum=0.9).init(params), step=4)
    _edit_manifest(tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "ckpt")


def test_damaged_files_give_our_error(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    for damage, message in [
        (lambda v: (v / "structure.pkl").write_bytes(b"\x80\x04junk"), "not a readable pipedsl checkpoint"),
        (lambda v: (v / "arrays.npz").write_bytes(b"PK\x03\x04junk"), "not a readable pipedsl checkpoint"),
        (lambda v: (v / "manifest.json").write_text("{"), "not a readable pipedsl checkpoint"),
        (lambda v: (v / "manifest.json").unlink(), "not a readable pipedsl checkpoint"),
        (lambda v: (path / "LATEST").write_text("../../etc"), "not a saved version"),
        (lambda v: (path / "LATEST").write_bytes(b"\xff\xfe"), "not a version name"),
        (lambda v: (path / "LATEST").unlink(), "no LATEST file"),
    ]:
        save_checkpoint(path, _params(), None, step=1)
        damage(_version(path))
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(path)
        for entry in path.iterdir():
            if entry.is_dir():
                for f in entry.iterdir():
                    f.unlink()
                entry.rmdir()
            else:
                entry.unlink()
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(tmp_path / "missing")


def test_saving_refuses_a_file_or_a_directory_of_other_files(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        save_checkpoint(tmp_path / "file", _params(), step=0)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"not part of a checkpoint \(notes.txt\)"):
        save_checkpoint(tmp_path / "mine", _params(), step=0)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(CheckpointError, match="whole number"):
        save_checkpoint(tmp_path / "c", _params(), step=-1)


_SAVER = """
import sys
import numpy as np
from pipedsl.executor.checkpoint import save_checkpoint
path = sys.argv[1]
step = int(sys.argv[2])
while True:
    step += 1
    # Every array holds the step number, so a mix of two saves would show.
    params = {"w": np.full((512, 512), step, np.float32), "b": [np.full(7, step, np.int64)]}
    save_checkpoint(path, params, {"m": np.full((256, 512), step, np.float32)}, step=step)
    print(step, flush=True)
"""


def _assert_complete(saved: Checkpoint) -> None:
    leaves = jax.tree_util.tree_leaves((saved.params, saved.opt_state))
    assert len(leaves) == 3 and all((leaf == saved.step).all() for leaf in leaves)


def test_kill_9_during_saves_always_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    rng = random.Random(1913)
    step = 0
    for _ in range(4):
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(path), str(step)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        first = child.stdout.readline()  # one save is complete: the saver is in its loop
        assert first.strip(), "the saving process died before its first save"
        # Loads while the process saves see a complete checkpoint every time.
        until = time.monotonic() + rng.uniform(0.0, 0.5)
        while time.monotonic() < until:
            _assert_complete(load_checkpoint(path))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        done = [int(line) for line in [first, *child.stdout.read().split()] if line.strip()]
        child.stdout.close()
        saved = load_checkpoint(path)
        # The last finished save, or the one under way when the kill came.
        assert saved.step in (done[-1], done[-1] + 1), (saved.step, done[-1])
        _assert_complete(saved)
        step = saved.step
    save_checkpoint(path, {"w": np.zeros(1, np.float32)}, None, step=step + 1)
    names = sorted(p.name for p in path.iterdir())
    assert names[:2] == [".lock", "LATEST"] and len(names) == 3, names
