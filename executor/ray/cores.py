"""Binding a world's processes to CPU cores, shared out among the node's pipedsl processes.

A process of a Ray world spends its step handing work between its own threads (the
thread that runs the step, the collectives' network thread, XLA's compute pool) and
waiting in collectives for its peers. Left to the operating system, these threads move
between cores and wake each other across them; bound, a process's threads stay on its own
cores and hand work over there (``bench/bench_world.py`` times steps bound and unbound in
one run).

:func:`claim_cores` binds the calling process, every thread it has and every thread they
start, to the cores it claims: the ``count`` cores, adjacent in the order the process may
use them, that the fewest live processes of this user on this node have claimed already.
The claims are kept in one file per user on the node (:func:`registry`), read and written
under a lock; a claim lasts as long as its process, and a dead one's is dropped by the next
claim. So two worlds on one node take different cores while there are enough, and share
them evenly when there are not.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["claim_cores", "registry"]


def registry() -> Path:
    """The file of this user's claims on this node."""
    return Path(tempfile.gettempdir()) / f"pipedsl-cores-{os.getuid()}.json"


def claim_cores(count: int, *, path: Path | None = None) -> tuple[int, ...]:
    """Bind this process to ``count`` cores (all it may run on, if it may run on fewer)
    and record the claim in ``path`` (default :func:`registry`). Returns the cores, in
    increasing order; empty where this system cannot bind a process (no
    ``os.sched_setaffinity``)."""
    if count < 1:
        raise ValueError(f"count must be a positive number of cores, got {count!r}")
    if not hasattr(os, "sched_setaffinity"):
        return ()
    available = sorted(os.sched_getaffinity(0))
    path = registry() if path is None else path
    try:
        with open(path, "a+", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            handle.seek(0)
            claims = {pid: held for pid, held in _read(handle.read()).items() if pid != os.getpid() and _alive(pid)}
            cores = _choose(available, Counter(c for held in claims.values() for c in held), count)
            claims[os.getpid()] = cores
            handle.seek(0)
            handle.truncate()
            json.dump({str(pid): list(held) for pid, held in claims.items()}, handle)
    except OSError:
        # No registry to share with (a read-only temporary folder): the first cores, as a
        # process that finds no claims would take them.
        cores = _choose(available, {}, count)
    # Every thread the process has (Ray's, and the one running this), so that the threads
    # they start later are bound too.
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [str(os.getpid())]:
        try:
            os.sched_setaffinity(int(task), cores)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that has just ended
    return cores


def _choose(available: Sequence[int], load: Mapping[int, int], count: int) -> tuple[int, ...]:
    """The ``count`` adjacent cores of ``available`` (blocks from its start, the last one
    ending at its end) with the fewest claims between them, the first such block on ties."""
    n = min(count, len(available))
    starts = sorted({*range(0, len(available) - n + 1, n), len(available) - n})
    best = min(starts, key=lambda s: sum(load.get(c, 0) for c in available[s : s + n]))
    return tuple(available[best : best + n])


def _read(text: str) -> dict[int, tuple[int, ...]]:
    """The claims in a registry's ``text``; an unreadable file holds none (it is rewritten)."""
    try:
        found = json.loads(text) if text.strip() else {}
        return {int(pid): tuple(int(c) for c in cores) for pid, cores in found.items()}
    except (ValueError, TypeError, AttributeError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to judge
    return True
