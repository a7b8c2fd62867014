"""Set-up shared by every test tier: eight CPU devices for JAX, set once before JAX loads.

XLA reads ``--xla_force_host_platform_device_count`` when JAX starts, so it is set here,
before any test module imports JAX; eight devices fit every ``dp x tp x pp`` grid the
executor tests use. A flag the caller already set wins.

The tests compile hundreds of small stage programs and run each a few times, so XLA's
compile time is most of their time: ``--xla_backend_optimization_level=0`` skips LLVM's
optimisations of the CPU code, which about halves the hybrid grid's time. Every result is
compared with a reference computed in the same process, under the same flags. This directory is on ``sys.path``
(pytest puts a conftest's folder there), so every tier imports ``helpers``.
"""

from __future__ import annotations

import os

DEVICES = 8

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} --xla_backend_optimization_level=0"
