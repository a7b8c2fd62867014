"""``pipedsl run --checkpoint DIR [--checkpoint-every N] [--resume]``: save and resume training.

With ``--checkpoint DIR`` the run saves its parameters and optimizer state to ``DIR``
every ``N`` steps and after its last step, as a sharded checkpoint
(:meth:`~pipedsl.executor.Pipeline.save`, :mod:`pipedsl.executor.sharded_checkpoint`):
each pipeline device's state is written where it is, on Ray by the processes that hold
its shards, and nothing passes through the driver. A save is complete once its
``plan.json`` is written; the run then removes the saves before it, so ``DIR`` holds the
latest complete one (and a kill at any moment leaves it whole; a TERM or a Ctrl-C ends the run
after the save in progress, with no partial one left). ``--resume`` reads it
back (:meth:`~pipedsl.executor.Pipeline.restore`) and continues with the step after the
saved one, up to ``--steps``; the same command run again after a crash therefore picks
up where the crash left off, and the batch (a function of ``--seed``) is the same, so
the losses are those an uninterrupted run prints.

A checkpoint is resumed by any plan (schedule, placement, mesh, backend) of the model the
options build (every parameter's place, shape and dtype): each array is read into this
run's sharding. The optimizer state must be this run's optimizer's. Anything else is
refused, naming the first difference. Without ``--resume``, a directory that holds a checkpoint is refused
rather than overwritten.

The first save also records, in ``DIR/settings.json``, the settings that change the
training but not the saved arrays' shapes: the seed (the parameters' start and the
batch), the learning rate, the microbatches, their size and the data-parallel degree
(the batch). ``--resume`` with other values than those is refused, naming both: the
losses would not be an uninterrupted run's. Once its model and optimizer are checked too,
a checkpoint whose step is already at ``--steps`` or past it leaves nothing to do, which
the run says.

Nothing here imports JAX at import time (the parser is built without it).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedsl.cli.outputs import check_output_folder
from pipedsl.errors import PipedslError

__all__ = ["Checkpointing", "add_checkpoint_options", "training_settings"]


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--checkpoint``, ``--checkpoint-every`` and ``--resume`` to ``run``."""
    parser.add_argument("--checkpoint", type=Path, metavar="DIR", help="save parameters and optimizer state to DIR")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="with --checkpoint, save every N steps (default 1) and after the last step",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --checkpoint DIR, from the step after the saved one up to --steps",
    )


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """Where and how often a run saves (``directory`` None: never), and whether it resumes."""

    directory: Path | None
    every: int
    resume: bool
    settings: dict[str, int | float]
    """The run's settings that change the training (:func:`training_settings`)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: dict[str, int | float]) -> Checkpointing:
        """The options, checked before anything is built; ``settings`` are the run's
        (:func:`training_settings`), checked against a checkpoint that is resumed."""
        directory: Path | None = args.checkpoint
        every = 1 if args.checkpoint_every is None else args.checkpoint_every
        if every < 1:
            raise PipedslError(f"--checkpoint-every must be at least 1, got {every}")
        if directory is None:
            if args.resume:
                raise PipedslError("--resume continues a checkpoint: give its directory with --checkpoint DIR")
            if args.checkpoint_every is not None:
                raise PipedslError(
                    "--checkpoint-every says how often to save to --checkpoint DIR; give --checkpoint too"
                )
            return cls(None, every, False, settings)
        check_output_folder(directory, option="--checkpoint")
        saved = _latest_step(directory)
        if args.resume and saved is None:
            raise PipedslError(f"--resume: {directory} holds no checkpoint yet; run without --resume to start one")
        if not args.resume and saved is not None:
            raise PipedslError(
                f"--checkpoint {directory}: holds a checkpoint already; pass --resume to continue it, "
                "or choose another directory"
            )
        if args.resume:
            _check_settings(directory, settings)
        return cls(directory, every, args.resume, settings)

    def restore(self, pipe: Any, params: Any, batch: Any, optimizer: Any) -> tuple[Any, Any, int]:
        """(parameters, optimizer state, first step to run): the fresh ``params``, None and 1
        without ``--resume``; else handles to the checkpoint's, read onto ``pipe``'s devices
        and checked against its plan, model and ``optimizer``."""
        if not self.resume:
            return params, None, 1
        assert self.directory is not None  # from_args requires it with resume
        params, opt_state, step = pipe.restore(
            str(self.directory), like_params=params, batch=batch, optimizer=optimizer
        )
        return params, opt_state, step + 1

    def after_step(self, pipe: Any, step: int, *, last: bool) -> bool:
        """Save after ``step`` when it is due, then remove the saves before it; returns
        whether it saved."""
        if self.directory is None or (step % self.every and not last):
            return False
        from pipedsl.executor.sharded_checkpoint import remove_older

        pipe.save(str(self.directory), step=step)
        remove_older(self.directory, step)
        _record_settings(self.directory, self.settings)
        return True


_OPTIONS = {
    "seed": "--seed",
    "lr": "--lr",
    "microbatches": "-p microbatches=",
    "microbatch_size": "--microbatch-size",
    "dp": "--dp",
}
"""The settings a resumed run must share with its checkpoint, and the options that set them."""


def training_settings(
    *, seed: int, lr: float, microbatches: int, microbatch_size: int, dp: int
) -> dict[str, int | float]:
    """The settings of a run that change its training but not its arrays' shapes (those
    the checkpoint's own structure checks): the keys of :data:`_OPTIONS`."""
    return {"seed": seed, "lr": lr, "microbatches": microbatches, "microbatch_size": microbatch_size, "dp": dp}


def _latest_step(directory: Path) -> int | None:
    """The step of the latest complete checkpoint in ``directory``; None when it holds none."""
    from pipedsl.executor.sharded_checkpoint import complete_versions

    versions = complete_versions(directory)
    return versions[-1][0] if versions else None


def _settings_file(directory: Path) -> Path:
    return directory / "settings.json"


def _record_settings(directory: Path, settings: dict[str, int | float]) -> None:
    """Write ``settings`` beside the checkpoint once (a resumed run has the same ones)."""
    target = _settings_file(directory)
    if target.exists():
        return
    staging = target.with_name(target.name + ".tmp")
    staging.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
    os.replace(staging, target)


def _check_settings(directory: Path, settings: dict[str, int | float]) -> None:
    """Refuse to resume with settings other than the checkpoint's, naming each."""
    target = _settings_file(directory)
    if not target.exists():
        return
    try:
        saved = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PipedslError(f"{target}: not the settings a pipedsl run records ({err})") from None
    if not isinstance(saved, dict):
        raise PipedslError(f"{target}: not the settings a pipedsl run records (not a JSON object)")
    differ = [
        f"{_OPTIONS[name]}{'' if _OPTIONS[name].endswith('=') else ' '}{saved[name]} (this run gives {settings[name]})"
        for name in _OPTIONS
        if name in saved and saved[name] != settings[name]
    ]
    if differ:
        raise PipedslError(
            f"--resume: {directory} was trained with " + ", ".join(differ) + "; resuming with other values would"
            " not continue that training: give the checkpoint's values, or start a new --checkpoint DIR"
        )
