"""How many JAX devices a run gets on CPU, set before JAX is imported; whether a GPU build
of JAX fell back to the CPU.

On CPU, XLA gives a process one host device unless ``XLA_FLAGS`` asks for more with
``--xla_force_host_platform_device_count``; the flag is read when JAX starts, so it must be
set before the first ``import jax``. GPUs are found as they are and need none of this.
This module does not import JAX.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

__all__ = ["xla_device_flag", "request_devices", "with_device_count", "cpu_fallback_note"]

_CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def xla_device_flag(count: int) -> str:
    """The ``XLA_FLAGS`` entry that gives JAX ``count`` CPU devices."""
    return f"{_DEVICE_FLAG}={count}"


def with_device_count(flags: str, count: int) -> str:
    """``XLA_FLAGS`` text ``flags`` with its host device count, if any, replaced by ``count``."""
    kept = [f for f in flags.split() if not f.startswith(_DEVICE_FLAG)]
    return " ".join([*kept, xla_device_flag(count)])


def request_devices(count: int) -> None:
    """Ask XLA for ``count`` host devices, unless JAX is already imported (then its
    device count is fixed and the backend reports any shortage) or the user chose."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG in flags:
        return
    os.environ["XLA_FLAGS"] = with_device_count(flags, count)


def cpu_fallback_note(platform: str) -> str | None:
    """A line saying that JAX runs on the CPU although its CUDA plugin is installed (no
    GPU, or no driver JAX can use), for ``platform`` the platform of JAX's first device;
    None when JAX runs where it was installed to (a GPU, or a CPU-only install)."""
    if platform != "cpu" or os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return None
    for name in _CUDA_PLUGINS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return (
            f"pipedsl: JAX's CUDA plugin ({name} {version}) is installed but JAX found no GPU it can use "
            "(no NVIDIA GPU or driver here); running on the CPU"
        )
    return None
