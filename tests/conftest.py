"""Set-up shared by every test tier: eight CPU devices for JAX, set once before JAX loads.

XLA reads ``--xla_force_host_platform_device_count`` when JAX starts, so it is set here,
before any test module imports JAX; eight devices fit every ``dp x tp x pp`` grid the
executor tests use. A flag the caller already set wins.

The tests compile hundreds of small stage programs and run each a few times, so XLA's
compile time is most of their time: ``--xla_backend_optimization_level=0`` skips LLVM's
optimisations of the CPU code, which about halves the hybrid grid's time, and
``--xla_cpu_use_fusion_emitters=false`` emits the fused loops the older way, without the
MLIR pipeline XLA builds for every compile, which halves it again (``tests/executor/test_hybrid.py``
97 s against 50 s, one after the other on this 2-core machine). XLA aborts on a flag it does
not know, so that one goes in only when a short process of this JAX takes it. Every result
is compared with a reference computed in the same process, under the same flags.

Many tests compile the same programs again (one model split the same way under every
schedule; the subprocesses of the command-line tests; every Ray actor), so the session
keeps one persistent compilation cache in a temporary folder, shared with every process
it starts through the environment, and removes it at the end; a cache folder the caller
set wins. Under pytest-xdist (``make test`` runs two workers) the controller loads this
file before it starts the workers, so they inherit its folder and leave it to the
controller to remove. This directory is on ``sys.path`` (pytest puts a conftest's folder
there), so every tier imports ``helpers``.

The modules of the Ray tier (marked ``ray``: they start clusters and worlds), then the
other modules that hold a test marked ``slow``, are collected first, each module's tests
together and in their order. Under ``make test`` (``--dist loadfile --no-loadscope-reorder``)
the workers take whole modules in collection order, so the long ones start first and the
many short ones even out the end; xdist's own order (most tests first) would leave a module
of one long test for last.

Hypothesis draws the same examples in every run and every clone (the ``ci`` profile, the
default), so a property test's verdict never depends on the draw, and it writes no example
database into the clone. ``HYPOTHESIS_PROFILE=random`` (``make test-random``) draws anew in
each run and ten times as many examples where a test leaves the count to the profile (the
synthesiser's property tests do); a failure prints the ``@reproduce_failure`` line that
replays it.

Tests of Ctrl-C take the ``ctrl_c`` fixture: SIGINT as a foreground job in a terminal gets
it, whatever this run inherited (a shell starts a background job with SIGINT ignored, and
every process it starts inherits that).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
from hypothesis import settings

from pipedsl.executor.devices import request_devices

DEVICES = 8

# The same as `pipedsl run` asks for its CPU devices (the caller's count wins).
request_devices(DEVICES)

# Output is checked as a file or a pipe gets it, whatever terminal started the run:
# pytest-xdist's workers are started with the controller's COLUMNS (80 when it has no
# terminal), which the commands honour. A test that wants a width sets it; so do the
# processes the tests start, which inherit this environment.
os.environ.pop("COLUMNS", None)


def _xla_takes(flag: str) -> bool:
    """Whether this JAX's XLA starts with ``flag`` in ``XLA_FLAGS`` (it aborts on one it
    does not know); a probe that does not start within two minutes counts as no."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    try:
        return subprocess.run(probe, env=env, capture_output=True, timeout=120, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _default_flag(flag: str, *, probe: bool = False) -> None:
    """Add ``flag`` to ``XLA_FLAGS`` unless the caller set it; with ``probe``, only where
    this XLA takes it (:func:`_xla_takes`)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=")[0] not in flags and (not probe or _xla_takes(flag)):
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=100)
settings.register_profile("random", derandomize=False, database=None, deadline=None, max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_default_flag("--xla_backend_optimization_level=0")
_default_flag("--xla_cpu_use_fusion_emitters=false", probe=True)

_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="pipedsl-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    # Every program, however small or quick to compile: most of them are.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank: dict[object, int] = {}
    for item in items:
        mine = 0 if item.get_closest_marker("ray") else 1 if item.get_closest_marker("slow") else 2
        rank[item.path] = min(mine, rank.get(item.path, 2))
    items.sort(key=lambda item: rank[item.path])  # stable: each module stays in one piece, in order


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Python's own SIGINT handler in this process (and so SIGINT's default in the
    processes it starts) for the test, then the handler it had."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _CACHE is not None:
        shutil.rmtree(_CACHE, ignore_errors=True)
