"""JAX's persistent compilation cache, on by default for every process that runs stages.

A pipeline compiles many programs (per stage ``F``, ``B``, the ``I``/``W`` halves, the
optimizer update), and a first step on an accelerator spends most of its time in XLA's
compiler. JAX can keep compiled programs on disk, keyed by the program and the platform,
so that a second process (the next run of a script, a Ray world's processes, a resumed
job) loads them instead. pipedsl turns that cache on in a user cache folder unless told
otherwise, through one environment variable:

- ``PIPEDSL_COMPILATION_CACHE`` unset: ``$XDG_CACHE_HOME/pipedsl/jax`` (``~/.cache/pipedsl/jax``);
- set to a folder: that folder;
- set to ``off`` (or ``0``, ``none``, ``false``, empty): no persistent cache.

Where JAX was given a cache folder already (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.update("jax_compilation_cache_dir", ...)``) and the variable is unset, that
folder is kept. When pipedsl chooses the folder it caches every program, however quickly
it compiled (JAX's default skips those under a second, which is most stage programs).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

__all__ = ["CACHE_ENV", "cache_folder", "enable_compilation_cache"]

CACHE_ENV = "PIPEDSL_COMPILATION_CACHE"
"""The environment variable that moves (a folder) or turns off (``off``) the cache."""

_OFF = {"", "0", "off", "none", "false", "no"}


def cache_folder() -> Path | None:
    """The folder of the cache (see the module docstring), None when it is turned off."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in _OFF else Path(chosen).expanduser()
    current = _jax_folder()
    if current:
        return Path(current)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pipedsl" / "jax"


def enable_compilation_cache() -> Path | None:
    """Point JAX's persistent compilation cache at :func:`cache_folder` (once per process;
    later calls change nothing unless the variable changed). Returns the folder in use,
    None when the cache is off. A folder that cannot be created
    leaves the cache off rather than failing a run."""
    folder = cache_folder()
    if folder is None:
        return None
    if _jax_folder() == str(folder):
        return folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX decides once, at its first compile, whether a cache is in use: programs compiled
    # before this call (a model's initialisation) would have settled it without one.
    compilation_cache.reset_cache()
    return folder


def _jax_folder() -> str | None:
    """The cache folder JAX is configured with (its option is not in JAX's type stubs)."""
    return jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
