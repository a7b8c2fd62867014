"""The driver's own connection to each process of a Ray world, for a step's call and report.

A step is one call per process and one report back (:mod:`pipedsl.executor.ray.backend`).
As Ray actor tasks the two cost far more than the step's own messages need (submission,
scheduling onto the actor's thread, serialising each array apart; ``bench/bench_world.py``
times a Ray call of no work). So when a world starts, each process opens a TCP socket (on
127.0.0.1 for a local instance pipedsl started, else on its node's address) served by a
thread of its own, and the driver connects to it: a step's call and its report then go as
one pickle each way. Everything else (installing, parameters, checkpoints, asking a process
what it is doing) stays a Ray call, and Ray still starts, places and ends the processes.

Both ends prove they hold the world's key (32 random bytes the driver hands the processes
through Ray) before either reads a pickle from the other: the process sends a random
challenge, the driver answers with its HMAC-SHA256 under the key and a challenge of its own,
and the process answers that. Messages are :mod:`pipedsl.frames`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import IO, Any

from pipedsl import frames

__all__ = ["StepServer", "StepClient"]

_CHALLENGE = 32  # bytes
_ADMIT_S = 10.0
"""Seconds a connecting peer gets to answer the challenge."""


class StepServer:
    """A process's end: listens on ``host`` (a free port) and answers each request of an
    admitted connection with ``handle(request)``, or ``failed(error)`` where that raises or
    its answer cannot be pickled, on a thread of its own, one connection at a time."""

    def __init__(
        self, host: str, key: bytes, *, handle: Callable[[Any], Any], failed: Callable[[BaseException], Any]
    ) -> None:
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._key = key
        self._handle = handle
        self._failed = failed
        threading.Thread(target=self._serve, name="pipedsl-steps", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as incoming:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._admit(conn, incoming):
                    self._answer(conn, incoming)

    def _admit(self, conn: socket.socket, incoming: IO[bytes]) -> bool:
        conn.settimeout(_ADMIT_S)
        try:
            challenge = os.urandom(_CHALLENGE)
            conn.sendall(challenge)
            answer = incoming.read(2 * _CHALLENGE)
            if len(answer) < 2 * _CHALLENGE or not hmac.compare_digest(
                answer[:_CHALLENGE], _digest(self._key, challenge)
            ):
                return False
            conn.sendall(_digest(self._key, answer[_CHALLENGE:]))
        except OSError:
            return False
        conn.settimeout(None)
        return True

    def _answer(self, conn: socket.socket, incoming: IO[bytes]) -> None:
        while True:
            try:
                request = frames.read(incoming)
            except (OSError, EOFError):
                return  # the driver has gone
            try:
                data = frames.encode(self._handle(request))
            except Exception as err:  # reported to the driver, whatever it was
                data = frames.encode(self._failed(err))
            try:
                conn.sendall(data)
            except OSError:
                return


class StepClient:
    """The driver's end of one process's connection: connects to ``address`` and proves
    it holds ``key`` both ways (the module docstring), within ``timeout`` seconds each;
    raises ConnectionError where the process does not prove it."""

    def __init__(self, address: Sequence[Any], key: bytes, *, timeout: float) -> None:
        where = f"{address[0]}:{address[1]}"
        self._sock = socket.create_connection((str(address[0]), int(address[1])), timeout=timeout)
        self._incoming = self._sock.makefile("rb")
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = self._incoming.read(_CHALLENGE)
            if len(challenge) < _CHALLENGE:
                raise ConnectionError(f"the process at {where} closed the connection")
            mine = os.urandom(_CHALLENGE)
            self._sock.sendall(_digest(key, challenge) + mine)
            answer = self._incoming.read(_CHALLENGE)
            if len(answer) < _CHALLENGE:
                raise ConnectionError(f"the process at {where} refused the world's key")
            if not hmac.compare_digest(answer, _digest(key, mine)):
                raise ConnectionError(f"the process at {where} does not hold the world's key")
        except BaseException:
            self.close()
            raise
        self._sock.settimeout(None)

    def fileno(self) -> int:
        """The socket's descriptor, for ``select``: with one request out at a time, nothing
        of an answer waits in this end's buffer while ``select`` looks at the socket."""
        return self._sock.fileno()

    def send(self, request: Any) -> None:
        self._sock.sendall(frames.encode(request))

    def receive(self, *, timeout: float) -> Any:
        """The answer to the request sent, read within ``timeout`` seconds (the process has
        started sending it when ``select`` says so). Raises EOFError where the process has
        gone."""
        self._sock.settimeout(max(timeout, 1e-3))
        try:
            return frames.read(self._incoming)
        except ConnectionError as err:
            raise EOFError(f"the connection was broken ({err})") from err
        finally:
            self._sock.settimeout(None)

    def close(self) -> None:
        self._incoming.close()
        self._sock.close()


def _digest(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()
