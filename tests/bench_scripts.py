"""The benchmark scripts under ``bench/``, imported as modules by the tests that hold their
code or their recorded data to account (without JAX: the simulator's tests use it too)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` as the module ``name`` (once per process)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass finds its module by name while it is made
    spec.loader.exec_module(module)
    return module
