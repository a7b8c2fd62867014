"""Worker processes for the plan search: independent calls run on several cores.

The search ranks each pipeline schedule's plans apart from every other schedule's
(its pruning compares a plan only with its own schedule's best), so the schedules can be
ranked at once in separate processes and the results put together in the order the
search would have made them itself: the ranking is the same, byte for byte. (A search
for a shortlist also hands each schedule the best step times found before it, which
changes how much is simulated, not what is ranked.)

On Linux, from a process that runs no other Python thread (``pipedsl search``), a worker
is this process forked: it starts at once with everything imported and read (about a third
of a second sooner than an interpreter on a 2-core machine), holds the calls as the caller
does (what of them goes either way is named by its place among them, not pickled:
:class:`_Shared`), and ends with ``os._exit``,
never returning into the caller's code. Elsewhere (another system, or a caller with threads
of its own, which a fork could leave holding a lock) it is a fresh interpreter
(``sys.executable``) started with this process's import path; it imports only what a call
needs (never the caller's ``__main__``, unlike :mod:`multiprocessing`'s spawn, so a script
that searches without an ``if __name__ == "__main__"`` guard works). Calls travel as frames
(:mod:`pipedsl.frames`) on a pipe (an interpreter's standard input) and answers on a pipe of
their own. A worker reports
progress while it works, at most every :data:`_REPORT_S` seconds, and exits when its input
closes. With ``here``, one of the workers is instead a thread of the calling process,
which starts at once and needs nothing pickled (the plan search ranks schedules there
too). A worker that dies, or a call that raises, ends the whole run with an
error (the call's own exception where it can be pickled), and the other workers are
killed at once; so are they on Ctrl-C.

A worker dies with the process that started it, however that one ends (SIGKILL, the
out-of-memory killer, a crash), in the middle of a call too: on Linux the kernel kills it
as its parent exits (``prctl(PR_SET_PDEATHSIG)``), and everywhere a thread of its own
waits on a *lifeline*, a pipe on which the parent never writes and which reaches its end
only when every holder of the writing end, the parent alone, has gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import IO, Any, NoReturn, TypeVar

from pipedsl import frames
from pipedsl.errors import PipedslError

__all__ = ["Advance", "available_cores", "run_in_workers"]

R = TypeVar("R")

Advance = Callable[[str, int], None]
"""Called with (phase, items) when ``items`` more items of ``phase`` are done."""

_REPORT_S = 0.2
"""Seconds between a worker's progress reports, at most one per interval."""

_POLL_S = 1.0
"""Seconds the caller waits on its queue at a time. It never waits on a worker that has
gone: each worker's reader reports its exit."""

_STOP_S = 5.0
"""Seconds a worker whose input has closed gets to exit before it is killed."""

_ORPHANED = 1
"""A worker's exit code when it finds its parent gone (nobody is left to read it)."""

_PR_SET_PDEATHSIG = 1
"""Linux's ``prctl`` option: the signal this process gets when its parent exits."""

# Run by ``python -c``: this process's import path, then the worker loop. A worker runs in
# a process group of its own (``start``), so a terminal's Ctrl-C reaches only the caller,
# which stops its workers; one sent to the worker itself still ends it quietly.
_BOOT = (
    "import sys\n"
    "try:\n"
    "    import json; sys.path[:] = json.loads(sys.argv[1])\n"
    "    from pipedsl.simulator.workers import serve; serve(int(sys.argv[2]), lifeline=int(sys.argv[3]))\n"
    "except KeyboardInterrupt:\n"
    "    pass\n"
)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_in_workers(
    fn: Callable[..., R],
    calls: Sequence[tuple[Any, ...]],
    *,
    jobs: int,
    advance: Advance,
    names: Sequence[str],
    here: bool = False,
) -> list[R]:
    """``fn(*call, advance=...)`` for every call, in ``jobs`` worker processes; the
    results in the order of ``calls``.

    ``fn`` is a module-level function (it is pickled by name) that reports progress
    through its ``advance`` keyword; those reports reach ``advance`` here, on the
    calling thread. Calls are handed out in the order given, each to the next free
    worker, so put the longest first. ``names[i]`` says what call i is in an error.

    With ``here``, one of the ``jobs`` is a thread of this process, which takes the first
    call at once: one interpreter fewer to start, and no call's arguments or result
    pickled for it. Its calls must then be ones that end (a thread cannot be killed: after
    an error elsewhere, or a Ctrl-C, it gives up at its next progress report), and they
    print where this process prints.

    Raises the exception a call raised (the first to arrive), or PipedslError when a
    worker exits before it answers.
    """
    results: list[Any] = [None] * len(calls)
    messages: queue.Queue[tuple[int, tuple[Any, ...]]] = queue.Queue()
    workers: list[_Worker | _Thread] = []
    count = min(jobs, len(calls))
    # Decided before any thread of this run starts (the processes first, then the thread).
    fork = _forks()
    shared = _Shared(calls) if fork else None
    try:
        # Started inside the try: a Ctrl-C between two starts still stops the first.
        for w in range(1 if here else 0, count):
            workers.append(_Worker.start(w, messages, shared=shared))
        if here and count:
            workers.insert(0, _Thread.start(0, messages))
        pending = iter(range(len(calls)))

        def given(call: int | None) -> tuple[int, tuple[Any, ...]] | None:
            return None if call is None else (call, calls[call])

        for worker in workers:
            worker.give(given(next(pending, None)), fn)
        outstanding = len(calls)
        while outstanding:
            try:
                w, message = messages.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            worker = workers[w]
            kind = message[0]
            if kind == "progress":
                for phase, items in message[1].items():
                    advance(phase, items)
            elif kind == "done":
                assert worker.call is not None  # an answer comes only to a call
                results[worker.call] = message[1]
                outstanding -= 1
                worker.give(given(next(pending, None)), fn)
            elif kind == "error":
                raise message[1]
            elif worker.call is not None:  # it exited with a call unanswered
                assert isinstance(worker, _Worker)  # the thread ends only when its input closes
                raise PipedslError(
                    f"search worker process {worker.process.pid} exited with code {message[1]}"
                    f" while ranking {names[worker.call]}"
                )
    except BaseException:
        # An error or Ctrl-C: what the other workers are doing is not wanted any more.
        for worker in workers:
            worker.kill()
        raise
    for worker in workers:
        worker.stop()
    return results


class _Worker:
    """One worker process, the call it is running, and the thread that reads its
    messages onto the caller's queue (tagged with the worker's index)."""

    def __init__(
        self,
        index: int,
        process: subprocess.Popen[bytes] | _Forked,
        answers: IO[bytes],
        lifeline: int,
        shared: _Shared | None,
    ) -> None:
        self.index = index
        self.process = process
        self.answers = answers
        self.lifeline = lifeline
        self.shared = shared
        self.call: int | None = None

    @classmethod
    def start(
        cls, index: int, messages: queue.Queue[tuple[int, tuple[Any, ...]]], *, shared: _Shared | None
    ) -> _Worker:
        """A worker started (this process forked where the calls are ``shared``, else an
        interpreter), and the thread that reads its messages."""
        # Answers come on a pipe of their own: nothing the interpreter or a library
        # prints on standard output as it starts can be taken for one.
        read, write = os.pipe()
        # The lifeline's writing end stays here, never written: os.pipe's ends are not
        # inherited by an interpreter, and a forked worker closes every descriptor but its own.
        alive, lifeline = os.pipe()
        worker: _Worker | None = None
        try:
            with _signals_held():
                try:
                    process = _interpreter(write, alive) if shared is None else _Forked.start(write, alive, shared)
                except BaseException:
                    os.close(read)
                    os.close(lifeline)
                    raise
                finally:
                    os.close(write)
                    os.close(alive)
                worker = cls(index, process, os.fdopen(read, "rb"), lifeline, shared)
                threading.Thread(target=worker._read, args=(messages,), daemon=True).start()
        except BaseException:
            # A signal held while it started: the caller never holds it, so it is stopped here.
            if worker is not None:
                worker.kill()
            raise
        return worker

    def give(self, call: tuple[int, tuple[Any, ...]] | None, fn: Callable[..., Any]) -> None:
        """Hand the worker a call, (its number, its arguments); None closes its input (no
        more calls)."""
        self.call = None if call is None else call[0]
        assert self.process.stdin is not None
        try:
            if call is None:
                self.process.stdin.close()
            else:
                _write(self.process.stdin, (fn, call[1]), self.shared)
        except BrokenPipeError:
            pass  # it has exited: its reader reports how, naming this call

    def _read(self, messages: queue.Queue[tuple[int, tuple[Any, ...]]]) -> None:
        with self.answers:
            for message in frames.messages(self.answers, referred=None if self.shared is None else self.shared.take):
                messages.put((self.index, message))
        messages.put((self.index, ("exit", self.process.wait())))

    def stop(self) -> None:
        """Wait for the worker to exit, its calls answered and its input closed; kill it
        if it has not within :data:`_STOP_S`."""
        try:
            self.process.wait(timeout=_STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()
        else:
            self._cut_lifeline()

    def kill(self) -> None:
        """Stop the worker now, whatever it is doing."""
        self.process.kill()
        self.process.wait()
        self._cut_lifeline()

    def _cut_lifeline(self) -> None:
        """Close the lifeline's writing end, once the worker has exited (a second call,
        from a kill after a stop, finds it closed)."""
        if self.lifeline >= 0:
            os.close(self.lifeline)
            self.lifeline = -1


def _forks() -> bool:
    """Whether a worker is this process forked: on Linux, where no other Python thread
    runs (one could hold a lock the fork copies held, which the worker could then wait on
    for ever) and JAX is not loaded (its runtime's threads are not Python's, and it warns
    of any fork), and where the worker can list the descriptors it must close. A BLAS
    pool's threads are not counted: the library takes care of a fork."""
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "fork")
        and threading.active_count() == 1
        and "jax" not in sys.modules
        and os.path.isdir(_DESCRIPTORS)
    )


_DESCRIPTORS = "/proc/self/fd"
"""Where Linux lists a process's open file descriptors."""


def _interpreter(answers: int, lifeline: int) -> subprocess.Popen[bytes]:
    """A worker that is a fresh interpreter, answering on descriptor ``answers``."""
    return subprocess.Popen(
        [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(answers), str(lifeline)],
        stdin=subprocess.PIPE,
        pass_fds=(answers, lifeline),
        # Out of the caller's process group: a Ctrl-C that arrives while the
        # interpreter is still starting would print its traceback.
        process_group=0,
    )


class _Forked:
    """A worker that is this process forked: what :class:`_Worker` asks of a
    :class:`subprocess.Popen` (its input, ``wait``, ``kill``, ``pid``)."""

    def __init__(self, pid: int, stdin: IO[bytes]) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.returncode: int | None = None
        # The reader thread waits for the exit while the caller may kill and wait too.
        self._reaping = threading.Lock()

    @classmethod
    def start(cls, answers: int, lifeline: int, shared: _Shared) -> _Forked:
        calls, given = os.pipe()
        # What this process has printed but not yet written stays in its buffers: the
        # worker writes through streams of its own and never flushes these (os._exit).
        try:
            pid = os.fork()
        except BaseException:
            os.close(calls)
            os.close(given)
            raise
        if pid == 0:
            _forked_worker(calls, answers, lifeline, shared)
        os.close(calls)
        return cls(pid, os.fdopen(given, "wb"))

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (minus the signal's number for a signal), once it has exited;
        raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.returncode is None:
            if deadline is None:
                with self._reaping:
                    self._reap(0)
                continue
            if self._reaping.acquire(blocking=False):
                try:
                    self._reap(os.WNOHANG)
                finally:
                    self._reaping.release()
            if self.returncode is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(f"search worker {self.pid}", timeout or 0.0)
                delay = min(delay * 2, left, 0.05)
                time.sleep(delay)
        return self.returncode

    def _reap(self, options: int) -> None:
        if self.returncode is not None:
            return
        pid, status = os.waitpid(self.pid, options)
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _forked_worker(calls: int, answers: int, lifeline: int, shared: _Shared) -> NoReturn:
    """The forked worker's life: its own process group and the signals' defaults, no
    descriptor but standard input, output and error and its three pipes (the lifeline's
    writing end among those closed: held here, it would never reach its end), then
    :func:`serve`; it ends with ``os._exit``, never returning into the caller's code
    (nothing the caller holds is finalised or flushed twice)."""
    code = 0
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        kept = {0, 1, 2, calls, answers, lifeline}
        for fd in map(int, os.listdir(_DESCRIPTORS)):
            if fd not in kept:
                with contextlib.suppress(OSError):  # the listing's own, closed already
                    os.close(fd)
        # The caller's streams may write elsewhere (a capture's file, closed above).
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - never closed: the worker ends with os._exit
        sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
        serve(answers, lifeline=lifeline, calls=os.fdopen(calls, "rb"), shared=shared)
    except KeyboardInterrupt:
        pass
    except BaseException:  # noqa: BLE001 - said on standard error, as an interpreter would
        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stderr.flush()
        code = 1
    os._exit(code)


class _Cancelled(Exception):
    """Raised inside the thread's call at its next progress report once the run is over."""


class _Thread:
    """The worker that is a thread of this process (``here``): the same messages on the
    same queue as a worker process's, its calls handed over on a queue of its own."""

    def __init__(self, index: int, messages: queue.Queue[tuple[int, tuple[Any, ...]]]) -> None:
        self.index = index
        self.messages = messages
        self.inbox: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.Queue()
        self.cancelled = threading.Event()
        self.call: int | None = None

    @classmethod
    def start(cls, index: int, messages: queue.Queue[tuple[int, tuple[Any, ...]]]) -> _Thread:
        worker = cls(index, messages)
        # A daemon: a call still running when the process ends (after a Ctrl-C) holds nothing up.
        threading.Thread(target=worker._serve, daemon=True).start()
        return worker

    def give(self, call: tuple[int, tuple[Any, ...]] | None, fn: Callable[..., Any]) -> None:
        """As :meth:`_Worker.give`: a call, or None for no more."""
        self.call = None if call is None else call[0]
        self.inbox.put(None if call is None else (fn, call[1]))

    def _serve(self) -> None:
        def send(message: tuple[Any, ...]) -> None:
            if self.cancelled.is_set():
                raise _Cancelled
            self.messages.put((self.index, message))

        while (task := self.inbox.get()) is not None:
            fn, call = task
            reporter = _Reporter(send)
            try:
                result = fn(*call, advance=reporter.advance)
                reporter.flush()
            except _Cancelled:
                return
            except Exception as err:  # noqa: BLE001 - every failure goes back to the caller
                self.messages.put((self.index, ("error", err)))
                return
            self.messages.put((self.index, ("done", result)))

    def stop(self) -> None:
        """Its calls are answered: nothing is left to wait for (its input is closed)."""

    def kill(self) -> None:
        """End its call at its next progress report, and take no more."""
        self.cancelled.set()
        self.inbox.put(None)


_HELD = (signal.SIGINT, signal.SIGTERM)
"""The signals a caller may take as an exception (Ctrl-C; TERM in ``pipedsl search``),
held while a worker starts."""


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """A Ctrl-C or TERM that arrives inside the block takes effect as it ends, each as
    its handler outside the block would have taken it. ``Popen`` interrupted after its
    fork would raise without returning the process it started, which would then run on
    with nobody to stop it. Only the main thread receives signals, so elsewhere this holds
    nothing."""
    previous = {signum: signal.getsignal(signum) for signum in _HELD}
    # None: a handler set outside Python, which could not be put back.
    if None in previous.values() or threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[int, FrameType | None]] = []
    for signum in _HELD:
        signal.signal(signum, lambda got, frame: caught.append((got, frame)))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        # The first signal caught, as its handler takes it: that one ends the block's caller.
        for got, frame in caught[:1]:
            taken = previous[signal.Signals(got)]
            if callable(taken):
                taken(got, frame)
            elif taken == signal.SIG_DFL:
                signal.raise_signal(got)


_PLAIN = (int, float, complex, str, bytes, type(None))
"""What :class:`_Shared` never names by its place."""


class _Shared:
    """The calls of a run, which a forked worker holds as the caller does: an object of
    them (a call's arguments, an argument, an item of a list or tuple argument) travels
    either way as its place among them, not pickled (a search's thousands of plans, and
    its model and cluster, in every call and every answer)."""

    def __init__(self, calls: Sequence[tuple[Any, ...]]) -> None:
        self.calls = calls
        # By id: each is alive as long as the calls are, so no other object has its id.
        # Numbers and text are pickled as they are: a place is itself written as numbers.
        self.places: dict[int, tuple[int, ...]] = {}

        def add(obj: object, place: tuple[int, ...]) -> None:
            if not isinstance(obj, _PLAIN):
                self.places.setdefault(id(obj), place)

        for i, call in enumerate(calls):
            add(call, (i,))
            for j, argument in enumerate(call):
                add(argument, (i, j))
                if isinstance(argument, list | tuple):
                    for k, item in enumerate(argument):
                        add(item, (i, j, k))

    def place(self, obj: object) -> tuple[int, ...] | None:
        """``obj``'s place among the calls, or None for one not among them."""
        return self.places.get(id(obj))

    def take(self, place: tuple[int, ...]) -> object:
        """The object at ``place`` (:meth:`place`)."""
        found: Any = self.calls[place[0]]
        for index in place[1:]:
            found = found[index]
        return found


def _write(stream: IO[bytes], message: object, shared: _Shared | None = None) -> None:
    stream.write(frames.encode(message, reference=None if shared is None else shared.place))
    stream.flush()


def serve(answers: int, *, lifeline: int, calls: IO[bytes] | None = None, shared: _Shared | None = None) -> None:
    """The worker's loop: run each call that arrives on ``calls`` (default standard input)
    and answer on file descriptor ``answers``, until the input closes; exit at once,
    whatever it is doing, when the pipe ``lifeline`` (a file descriptor) reaches its end.
    What a call prints goes to standard error, as the caller's standard output is for its
    own results. A forked worker holds the caller's calls (``shared``), which go either
    way by their place."""
    _die_with_parent(lifeline)
    out = os.fdopen(answers, "wb")
    os.dup2(2, 1)
    try:
        referred = None if shared is None else shared.take
        for fn, call in frames.messages(sys.stdin.buffer if calls is None else calls, referred=referred):
            reporter = _Reporter(lambda message: _write(out, message, shared))
            try:
                result = fn(*call, advance=reporter.advance)
            except Exception as err:  # noqa: BLE001 - every failure goes back to the caller
                reporter.flush()
                _write(out, ("error", _portable(err)), shared)
            else:
                reporter.flush()
                _write(out, ("done", result), shared)
    except BrokenPipeError:
        # The parent went between the lifeline's end and this write: as there.
        os._exit(_ORPHANED)


def _die_with_parent(lifeline: int) -> None:
    """Exit as soon as the parent has gone. A parent that died before this ran has already
    closed the lifeline, so its end is found at once."""
    if sys.platform.startswith("linux"):
        # SIGKILL, as nothing of a worker's is worth saving. The kernel sends it when the
        # thread that started the worker exits: that thread waits in run_in_workers until
        # every worker has exited.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    threading.Thread(target=_exit_at_end, args=(lifeline,), daemon=True).start()


def _exit_at_end(lifeline: int) -> None:
    """Wait for the end of the pipe ``lifeline``, on which nothing is ever written, then
    exit without a word: the parent has gone, and with it whoever wanted the answers."""
    os.read(lifeline, 1)
    os._exit(_ORPHANED)


class _Reporter:
    """A call's progress, sent on (``send`` a message) at most every :data:`_REPORT_S` seconds."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        self.send = send
        self.pending: Counter[str] = Counter()
        self.sent = time.monotonic()

    def advance(self, phase: str, items: int) -> None:
        self.pending[phase] += items
        if time.monotonic() - self.sent >= _REPORT_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.send(("progress", dict(self.pending)))
            self.pending.clear()
        self.sent = time.monotonic()


def _portable(err: Exception) -> Exception:
    """``err`` as it can travel back: itself when it survives pickling, else a
    RuntimeError naming it. Anything but one of pipedsl's own errors carries the
    worker's traceback as a note, since the caller's traceback ends at the worker."""
    if not isinstance(err, PipedslError):
        err.add_note("In the search worker process:\n" + "".join(traceback.format_exception(err)).rstrip())
    try:
        pickle.loads(pickle.dumps(err, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - any failure to pickle or rebuild means: send its text
        return RuntimeError("".join(traceback.format_exception(err)).rstrip())
    return err
