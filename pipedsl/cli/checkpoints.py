"""``pipedsl run --checkpoint DIR [--checkpoint-every N] [--resume]``: save and resume training.

With ``--checkpoint DIR`` the run saves its parameters and optimizer state to ``DIR``
every ``N`` steps and after its last step (:mod:`pipedsl.executor.checkpoint`: a kill at
any moment leaves the previous save whole). ``--resume`` loads ``DIR`` and continues
with the step after the saved one, up to ``--steps``; the same command run again after a
crash therefore picks up where the crash left off, and the batch (a function of
``--seed``) is the same, so the losses are those an uninterrupted run prints.

The saved parameters must match the model the options build (structure, shapes,
dtypes), and the saved optimizer state the layout this pipeline's optimizer gives it;
that layout is learnt from one step of the pipeline from the fresh parameters (whose
compilation the resumed steps then reuse). Without ``--resume``, a directory that holds
a checkpoint is refused rather than overwritten.

The first save also records, in ``DIR/settings.json``, the settings that change the
training but not the saved arrays' shapes: the seed (the parameters' start and the
batch), the learning rate, the microbatches, their size and the data-parallel degree
(the batch). ``--resume`` with other values than those is refused, naming both: the
losses would not be an uninterrupted run's. A checkpoint whose step is already at
``--steps`` or past it leaves nothing to do, which the run says.

Nothing here imports JAX at import time (the parser is built without it).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        if directory.exists() and not directory.is_dir():
            raise PipedslError(f"--checkpoint {directory}: exists and is not a directory")
        if args.resume and not (directory / "LATEST").exists():
            raise PipedslError(f"--resume: {directory} holds no checkpoint yet; run without --resume to start one")
        if not args.resume and (directory / "LATEST").exists():
            raise PipedslError(
                f"--checkpoint {directory}: holds a checkpoint already; pass --resume to continue it, "
                "or choose another directory"
            )
        if args.resume:
            _check_settings(directory, settings)
        return cls(directory, every, args.resume, settings)

    def saved_step(self) -> int | None:
        """With ``--resume``, the step the checkpoint holds (read from it); else None."""
        if not self.resume:
            return None
        from pipedsl.executor.checkpoint import load_checkpoint

        assert self.directory is not None  # from_args requires it with resume
        return load_checkpoint(self.directory).step

    def restore(self, pipe: Any, params: Any, batch: Any, optimizer: Any) -> tuple[Any, Any, int]:
        """(parameters, optimizer state, first step to run): the fresh ``params``, None and 1
        without ``--resume``; else the checkpoint's, checked against this pipeline (the
        caller has seen that steps are left, :meth:`saved_step`)."""
        if not self.resume:
            return params, None, 1
        from pipedsl.executor.checkpoint import load_checkpoint

        assert self.directory is not None  # from_args requires it with resume
        saved = load_checkpoint(self.directory, like_params=params)
        if saved.opt_state is None:
            raise PipedslError(f"--resume: {self.directory} holds no optimizer state; it was not saved by pipedsl run")
        _, probe_state, _ = pipe.train_step(params, None, batch, optimizer=optimizer)
        saved = load_checkpoint(self.directory, like_params=params, like_opt_state=pipe.gather(probe_state))
        return saved.params, saved.opt_state, saved.step + 1

    def after_step(self, pipe: Any, step: int, params: Any, opt_state: Any, *, last: bool) -> bool:
        """Save after ``step`` when it is due; returns whether it saved."""
        if self.directory is None or (step % self.every and not last):
            return False
        from pipedsl.executor.checkpoint import save_checkpoint

        save_checkpoint(self.directory, pipe.gather(params), pipe.gather(opt_state), step=step)
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


def _settings_file(directory: Path) -> Path:
    from pipedsl.executor.checkpoint import SETTINGS

    return directory / SETTINGS


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
