"""Binding processes to cores: the blocks chosen, and the claims live processes share out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipedsl.executor.ray.cores import _choose, claim_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no process binding on this system")

# Claims cores in a process of its own (so that this test process stays unbound) and says
# which, with the cores a thread it starts afterwards may run on; then waits for its input
# to close, holding the claim.
_CLAIM = """
import json, os, sys, threading
from pathlib import Path
from pipedsl.executor.ray.cores import claim_cores
cores = claim_cores(int(sys.argv[2]), path=Path(sys.argv[1]))
seen = []
thread = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
thread.start()
thread.join()
print(json.dumps({"cores": cores, "thread": seen[0], "process": sorted(os.sched_getaffinity(0))}), flush=True)
sys.stdin.read()
"""


def test_the_least_claimed_block_is_chosen() -> None:
    assert _choose([0, 1, 2, 3], {}, 2) == (0, 1)
    assert _choose([0, 1, 2, 3], {0: 1, 1: 1}, 2) == (2, 3)
    assert _choose([0, 1, 2, 3], {0: 1, 2: 1, 3: 1}, 2) == (0, 1)
    # Fewer cores than processes: shared evenly, the first of equally claimed ones.
    assert _choose([0, 1], {0: 1, 1: 1}, 1) == (0,)
    assert _choose([0, 1], {0: 2, 1: 1}, 1) == (1,)
    # The last block ends at the last core; more cores than there are: all of them.
    assert _choose([0, 1, 2], {0: 1}, 2) == (1, 2)
    assert _choose([4, 6, 7], {}, 5) == (4, 6, 7)


def _claim(registry: Path, count: int) -> tuple[subprocess.Popen[str], dict[str, list[int]]]:
    process = subprocess.Popen(
        [sys.executable, "-c", _CLAIM, str(registry), str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    return process, json.loads(process.stdout.readline())


def test_live_claims_are_shared_out_and_a_dead_ones_freed(tmp_path: Path) -> None:
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip("needs two cores")
    registry = tmp_path / "cores.json"
    first, got = _claim(registry, 1)
    try:
        # The process and the threads it starts later run on the claimed core only.
        assert got["process"] == got["thread"] == got["cores"] == [available[0]]
        second, other = _claim(registry, 1)
        try:
            assert other["cores"] == [available[1]]
            claims = json.loads(registry.read_text())
            assert claims == {str(first.pid): [available[0]], str(second.pid): [available[1]]}
        finally:
            second.communicate("")
        # A claim ends with its process: the next one takes the core the dead one held.
        third, again = _claim(registry, 1)
        third.communicate("")
        assert again["cores"] == [available[1]]
        assert str(second.pid) not in json.loads(registry.read_text())
    finally:
        first.communicate("")


def test_an_unreadable_registry_is_started_afresh(tmp_path: Path) -> None:
    registry = tmp_path / "cores.json"
    registry.write_text("not json")
    process, got = _claim(registry, 1)
    process.communicate("")
    assert got["cores"] == [min(os.sched_getaffinity(0))]
    assert json.loads(registry.read_text()) == {str(process.pid): got["cores"]}


def test_a_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="positive number of cores"):
        claim_cores(0)
