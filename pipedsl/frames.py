"""Messages between processes as length-prefixed pickles on a byte stream.

A frame is the pickle's length (8 bytes, little-endian) and the pickle. The plan search's
worker processes (:mod:`pipedsl.simulator.workers`, over pipes) and the Ray backend's step
connections (:mod:`pipedsl.executor.ray.step_channel`, over sockets) speak it. Unpickling runs
code: read frames only from a peer that is trusted (a child process, or one that has
proved it holds a shared key).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["encode", "read", "messages"]

_HEADER = struct.Struct("<Q")


def encode(message: object) -> bytes:
    """``message`` as one frame."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def read(stream: IO[bytes]) -> Any:
    """The next message on ``stream`` (a buffered one: each read returns all it asks for
    unless the stream ends). Raises EOFError at its end (the other side has gone)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the stream ended")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the stream ended inside a message")
    return pickle.loads(data)


def messages(stream: IO[bytes]) -> Iterator[Any]:
    """Every message on ``stream``, until it ends."""
    while True:
        try:
            message = read(stream)
        except EOFError:
            return
        yield message
