"""The driver's own connection to each process of a Ray world, for a step's call and report.

A step is one call per process and one report back (:mod:`pipedsl.executor.ray_backend`).
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
and the process answers that. Frames are an 8-byte little-endian length and a pickle.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["StepServer", "StepClient"]

_HEADER = struct.Struct("<Q")
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
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._admit(conn):
                    self._answer(conn)

    def _admit(self, conn: socket.socket) -> bool:
        conn.settimeout(_ADMIT_S)
        try:
            challenge = os.urandom(_CHALLENGE)
            conn.sendall(challenge)
            answer = _read_exact(conn, 2 * _CHALLENGE)
            if not hmac.compare_digest(answer[:_CHALLENGE], _digest(self._key, challenge)):
                return False
            conn.sendall(_digest(self._key, answer[_CHALLENGE:]))
        except (OSError, EOFError):
            return False
        conn.settimeout(None)
        return True

    def _answer(self, conn: socket.socket) -> None:
        while True:
            try:
                request = _read(conn)
            except (OSError, EOFError):
                return  # the driver has gone
            try:
                data = _frame(self._handle(request))
            except Exception as err:  # reported to the driver, whatever it was
                data = _frame(self._failed(err))
            try:
                conn.sendall(data)
            except OSError:
                return


class StepClient:
    """The driver's end of one process's connection: connects to ``address`` and proves
    it holds ``key`` both ways (the module docstring), within ``timeout`` seconds each;
    raises ConnectionError where the process does not prove it."""

    def __init__(self, address: Sequence[Any], key: bytes, *, timeout: float) -> None:
        self._sock = socket.create_connection((str(address[0]), int(address[1])), timeout=timeout)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = os.urandom(_CHALLENGE)
            self._sock.sendall(_digest(key, _read_exact(self._sock, _CHALLENGE)) + challenge)
            if not hmac.compare_digest(_read_exact(self._sock, _CHALLENGE), _digest(key, challenge)):
                raise ConnectionError(f"the process at {address[0]}:{address[1]} does not hold the world's key")
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)

    def fileno(self) -> int:
        """The socket's descriptor, for ``select``."""
        return self._sock.fileno()

    def send(self, request: Any) -> None:
        self._sock.sendall(_frame(request))

    def receive(self, *, timeout: float) -> Any:
        """The next answer, read within ``timeout`` seconds (the process has started
        sending it when ``select`` says so). Raises EOFError where the process has gone."""
        self._sock.settimeout(max(timeout, 1e-3))
        try:
            return _read(self._sock)
        except ConnectionError as err:
            raise EOFError(f"the connection was broken ({err})") from err
        finally:
            self._sock.settimeout(None)

    def close(self) -> None:
        self._sock.close()


def _digest(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


def _frame(value: Any) -> bytes:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _read(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_read_exact(sock, _HEADER.size))
    return pickle.loads(_read_exact(sock, size))


def _read_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the connection was closed")
        got += n
    return buffer
