"""Worker processes for the search: results in order, progress, errors, and no hang."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from processes import Lines, alive, wait_gone

from pipedsl.errors import PipedslError
from pipedsl.simulator import workers
from pipedsl.simulator.plan import PlanError
from pipedsl.simulator.workers import Advance, available_cores, run_in_workers


def _square(n: int, *, advance: Advance) -> tuple[int, int]:
    advance("squared", n)
    return n * n, os.getpid()


def _pick(items: list[object], n: int, *, advance: Advance) -> tuple[object, int, list[int]]:
    return items[n], n, [n]


def _reject(n: int, *, advance: Advance) -> int:
    if n == 2:
        raise PlanError(f"plan {n} does not divide the model")
    return n


def _raise_once_other_runs(n: int, fifo: str, *, advance: Advance) -> int:
    """Call 1 says through ``fifo`` that it is running (its pid), then never returns; call
    0 waits for that, then fails with the other's pid in its message."""
    if n == 1:
        with open(fifo, "w") as other:
            other.write(str(os.getpid()))
        threading.Event().wait()
    # Opened for reading and writing, a FIFO does not wait for a writer to open it.
    fd = os.open(fifo, os.O_RDWR)
    ready, _, _ = select.select([fd], [], [], 60)
    if not ready:
        raise PlanError("the other call never started")
    raise PlanError(f"the first call fails while {os.read(fd, 32).decode()} runs")


def _busy(n: int, *, advance: Advance) -> int:
    """Says it runs, on standard error, then never returns. The line goes out in one write
    (atomic on a pipe): the workers share their parent's standard error, and print's pieces
    from two of them could interleave."""
    os.write(2, f"busy {os.getpid()}\n".encode())
    threading.Event().wait()
    return n


def _exit(n: int, *, advance: Advance) -> int:
    if n == 1:
        os._exit(3)
    return n


class _Unpicklable(Exception):
    def __init__(self, n: int, lock: object) -> None:
        super().__init__(f"number {n}")
        self.lock = lock


def _raise_unpicklable(n: int, *, advance: Advance) -> int:
    raise _Unpicklable(n, threading.Lock())


def _fail(n: int, *, advance: Advance) -> int:
    return 1 // (n - n)


def _chatty(n: int, *, advance: Advance) -> int:
    print("a line on standard output", n)
    os.write(1, b"\x00" * 64)
    return n + 1


def _names(count: int) -> list[str]:
    return [f"call {i}" for i in range(count)]


# Forked workers are tried here whatever this process runs (another file's JAX, pytest's
# threads): the calls below need nothing those could hold. JAX and Python 3.12 warn of such a fork.
_WAYS = ["forked", "interpreter"] if sys.platform.startswith("linux") else ["interpreter"]
pytestmark = [
    pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning"),
    pytest.mark.filterwarnings(r"ignore:This process .* is multi-threaded:DeprecationWarning"),
]


@pytest.fixture(params=_WAYS)
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Workers started each way this system has: this process forked (Linux, no other
    thread), and a fresh interpreter."""
    forked = request.param == "forked"
    monkeypatch.setattr(workers, "_forks", lambda: forked)
    return str(request.param)


@pytest.fixture
def interpreters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers that are fresh interpreters (started by subprocess.Popen)."""
    monkeypatch.setattr(workers, "_forks", lambda: False)


@pytest.mark.usefixtures("way")
def test_results_come_back_in_the_order_of_the_calls() -> None:
    done: Counter[str] = Counter()
    found = run_in_workers(
        _square, [(n,) for n in range(7)], jobs=3, advance=lambda phase, n: done.update({phase: n}), names=_names(7)
    )
    assert [square for square, _ in found] == [n * n for n in range(7)]
    # Every call ran in a worker, and at most three of them.
    pids = {pid for _, pid in found}
    assert os.getpid() not in pids and 1 <= len(pids) <= 3
    assert done == {"squared": sum(range(7))}


@pytest.mark.usefixtures("way")
def test_here_runs_the_first_call_in_this_process_the_rest_in_workers() -> None:
    done: Counter[str] = Counter()
    found = run_in_workers(
        _square,
        [(n,) for n in range(5)],
        jobs=2,
        advance=lambda phase, n: done.update({phase: n}),
        names=_names(5),
        here=True,
    )
    assert [square for square, _ in found] == [n * n for n in range(5)]
    pids = [pid for _, pid in found]
    assert pids[0] == os.getpid() and len(set(pids)) <= 2
    assert done == {"squared": sum(range(5))}
    # Its error comes back as it is, as a worker's does.
    with pytest.raises(PlanError, match="plan 2 does not divide the model"):
        run_in_workers(_reject, [(2,), (1,)], jobs=2, advance=lambda *_: None, names=_names(2), here=True)


def test_what_the_calls_hold_comes_back_as_the_same_objects_from_a_fork(way: str) -> None:
    items: list[object] = [("item", n) for n in range(3)]
    calls = [(items, n) for n in range(3)]
    found = run_in_workers(_pick, calls, jobs=3, advance=lambda *_: None, names=_names(3))
    assert found == [(("item", n), n, [n]) for n in range(3)]
    # A forked worker holds the calls: what of them it answers with is named, not copied.
    assert all((got[0] is items[n]) == (way == "forked") for n, got in enumerate(found))


def test_more_jobs_than_calls_start_only_what_is_needed() -> None:
    found = run_in_workers(_square, [(4,)], jobs=8, advance=lambda *_: None, names=_names(1))
    assert found[0][0] == 16


@pytest.mark.usefixtures("way")
def test_a_call_that_raises_raises_its_own_error_here() -> None:
    with pytest.raises(PlanError, match="plan 2 does not divide the model") as caught:
        run_in_workers(_reject, [(n,) for n in range(4)], jobs=2, advance=lambda *_: None, names=_names(4))
    # One of pipedsl's own errors comes back as it is, without the worker's traceback.
    assert not getattr(caught.value, "__notes__", None)


@pytest.mark.usefixtures("way")
def test_an_error_stops_the_other_workers_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "running"
    os.mkfifo(fifo)
    calls = [(0, str(fifo)), (1, str(fifo))]
    with pytest.raises(PlanError, match="the first call fails while") as caught:
        run_in_workers(_raise_once_other_runs, calls, jobs=2, advance=lambda *_: None, names=_names(2))
    # The other call never returns: the run came back because its worker was stopped.
    assert not alive(int(str(caught.value).split()[-2]))


# Runs two calls of _busy in workers, in a process the test then kills.
_PARENT = (
    "import importlib, json, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "from pipedsl.simulator.workers import run_in_workers\n"
    "busy = importlib.import_module(sys.argv[2])._busy\n"
    "run_in_workers(busy, [(0,), (1,)], jobs=2, advance=lambda *_: None, names=['call 0', 'call 1'])\n"
)


def test_workers_die_with_a_parent_killed_in_the_middle_of_their_calls() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, json.dumps(sys.path), _busy.__module__],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = Lines(parent.stderr)  # type: ignore[arg-type]
    try:
        busy = [int(line.split()[1]) for line in lines.starting("busy ", 2)]
        assert len(busy) == 2, lines.read
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone(busy, timeout_s=5) == []
    assert "Traceback" not in lines.text()


@pytest.mark.usefixtures("way")
def test_any_other_error_carries_the_workers_traceback() -> None:
    with pytest.raises(ZeroDivisionError) as caught:
        run_in_workers(_fail, [(1,)], jobs=1, advance=lambda *_: None, names=_names(1))
    notes = "\n".join(caught.value.__notes__)
    assert "In the search worker process" in notes and "_fail" in notes


@pytest.mark.usefixtures("way")
def test_an_error_that_cannot_travel_comes_back_as_its_text() -> None:
    with pytest.raises(RuntimeError, match=r"_Unpicklable: number 5"):
        run_in_workers(_raise_unpicklable, [(5,)], jobs=1, advance=lambda *_: None, names=_names(1))


@pytest.mark.usefixtures("way")
def test_a_worker_that_dies_is_an_error_not_a_hang() -> None:
    with pytest.raises(PipedslError, match=r"exited with code 3 while ranking call 1"):
        run_in_workers(_exit, [(n,) for n in range(3)], jobs=2, advance=lambda *_: None, names=_names(3))


@pytest.mark.usefixtures("interpreters")
def test_a_ctrl_c_while_the_workers_start_stops_those_started(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[subprocess.Popen[bytes]] = []
    start = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        # The Ctrl-C lands as the second worker is started, the first one running.
        if started:
            raise KeyboardInterrupt
        started.append(start(*args, **kwargs))  # type: ignore[call-overload]
        return started[-1]

    monkeypatch.setattr(workers.subprocess, "Popen", popen)
    with pytest.raises(KeyboardInterrupt):
        run_in_workers(_square, [(n,) for n in range(4)], jobs=2, advance=lambda *_: None, names=_names(4))
    assert len(started) == 1 and started[0].poll() is not None


@pytest.mark.usefixtures("ctrl_c", "interpreters")
def test_a_ctrl_c_inside_a_workers_start_stops_that_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[subprocess.Popen[bytes]] = []
    start = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        # The Ctrl-C lands after the fork, before Popen has returned the process it started.
        started.append(start(*args, **kwargs))  # type: ignore[call-overload]
        signal.raise_signal(signal.SIGINT)
        return started[-1]

    monkeypatch.setattr(workers.subprocess, "Popen", popen)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_in_workers(_square, [(n,) for n in range(4)], jobs=2, advance=lambda *_: None, names=_names(4))
        assert len(started) == 1 and started[0].poll() is not None
    finally:
        for process in started:
            process.kill()
            process.wait()


@pytest.mark.usefixtures("way")
@pytest.mark.skipif("forked" not in _WAYS, reason="workers are forked only on Linux")
def test_a_ctrl_c_while_forked_workers_start_stops_those_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "_forks", lambda: True)
    started: list[workers._Forked] = []
    start = workers._Forked.start

    def fork(answers: int, lifeline: int, shared: workers._Shared) -> workers._Forked:
        # The Ctrl-C lands as the second worker is started, the first one running.
        if started:
            raise KeyboardInterrupt
        started.append(start(answers, lifeline, shared))
        return started[-1]

    monkeypatch.setattr(workers._Forked, "start", fork)
    with pytest.raises(KeyboardInterrupt):
        run_in_workers(_square, [(n,) for n in range(4)], jobs=3, advance=lambda *_: None, names=_names(4))
    assert len(started) == 1 and started[0].returncode is not None


@pytest.mark.skipif("forked" not in _WAYS, reason="workers are forked only on Linux")
@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_inside_a_fork_stops_that_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "_forks", lambda: True)
    children: list[int] = []
    fork = os.fork

    def forked() -> int:
        # The Ctrl-C lands in this process after the fork, before its worker is kept.
        pid = fork()
        if pid:
            children.append(pid)
            signal.raise_signal(signal.SIGINT)
        return pid

    monkeypatch.setattr(workers.os, "fork", forked)
    with pytest.raises(KeyboardInterrupt):
        run_in_workers(_square, [(n,) for n in range(4)], jobs=2, advance=lambda *_: None, names=_names(4))
    assert len(children) == 1 and wait_gone(children, timeout_s=5) == []


def test_what_a_call_prints_does_not_reach_the_answers(capfd: pytest.CaptureFixture[str]) -> None:
    found = run_in_workers(_chatty, [(1,), (2,)], jobs=2, advance=lambda *_: None, names=_names(2))
    assert found == [2, 3]
    assert "a line on standard output" in capfd.readouterr().err


def test_available_cores_is_at_least_one() -> None:
    assert available_cores() >= 1
