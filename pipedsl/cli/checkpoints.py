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

Nothing here imports JAX at import time (the parser is built without it).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipedsl.errors import PipedslError

__all__ = ["Checkpointing", "add_checkpoint_options"]


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--checkpoint``, ``--checkpoint-every`` and ``--resume`` to ``run``."""
    parser.add_argument("--checkpoint", type=Path, metavar="DIR", help="save parameters and optimizer state to DIR")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=1,
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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Checkpointing:
        """The options, checked before anything is built."""
        directory: Path | None = args.checkpoint
        if args.checkpoint_every < 1:
            raise PipedslError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
        if directory is None:
            if args.resume:
                raise PipedslError("--resume continues a checkpoint: give its directory with --checkpoint DIR")
            return cls(None, args.checkpoint_every, False)
        if directory.exists() and not directory.is_dir():
            raise PipedslError(f"--checkpoint {directory}: exists and is not a directory")
        if args.resume and not (directory / "LATEST").exists():
            raise PipedslError(f"--resume: {directory} holds no checkpoint yet; run without --resume to start one")
        if not args.resume and (directory / "LATEST").exists():
            raise PipedslError(
                f"--checkpoint {directory}: holds a checkpoint already; pass --resume to continue it, "
                "or choose another directory"
            )
        return cls(directory, args.checkpoint_every, args.resume)

    def restore(self, pipe: Any, params: Any, batch: Any, optimizer: Any, *, steps: int) -> tuple[Any, Any, int]:
        """(parameters, optimizer state, first step to run): the fresh ``params``, None and 1
        without ``--resume``; else the checkpoint's, checked against this pipeline."""
        if not self.resume:
            return params, None, 1
        from pipedsl.executor.checkpoint import load_checkpoint

        assert self.directory is not None  # from_args requires it with resume
        saved = load_checkpoint(self.directory, like_params=params)
        if saved.step >= steps:
            return saved.params, saved.opt_state, saved.step + 1
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
        return True
