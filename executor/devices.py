"""How many JAX devices a run gets on CPU, set before JAX is imported.

On CPU, XLA gives a process one host device unless ``XLA_FLAGS`` asks for more with
``--xla_force_host_platform_device_count``; the flag is read when JAX starts, so it must be
set before the first ``import jax``. GPUs are found as they are and need none of this.
This module does not import JAX.
"""

from __future__ import annotations

import os
import sys

__all__ = ["xla_device_flag", "request_devices", "with_device_count"]

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
