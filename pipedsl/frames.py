"""Messages between processes as length-prefixed pickles on a byte stream.

A frame is the pickle's length (8 bytes, little-endian) and the pickle. The plan search's
worker processes (:mod:`pipedsl.simulator.workers`, over pipes) and the Ray backend's step
connections (:mod:`pipedsl.executor.ray.step_channel`, over sockets) speak it. Unpickling runs
code: read frames only from a peer that is trusted (a child process, or one that has
proved it holds a shared key).
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = ["encode", "read", "messages"]

_HEADER = struct.Struct("<Q")


Reference = Callable[[object], object]
"""Pickle's ``persistent_id``: an object the other side holds already, named by a picklable
key (None for an object to pickle whole)."""
Referred = Callable[[Any], object]
"""Pickle's ``persistent_load``: the object a :data:`Reference` key names."""


def encode(message: object, *, reference: Reference | None = None) -> bytes:
    """``message`` as one frame; with ``reference``, what it names goes as its key."""
    if reference is None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = reference  # type: ignore[method-assign]
        pickler.dump(message)
        data = buffer.getvalue()
    return _HEADER.pack(len(data)) + data


def read(stream: IO[bytes], *, referred: Referred | None = None) -> Any:
    """The next message on ``stream`` (a buffered one: each read returns all it asks for
    unless the stream ends), a key written by :func:`encode`'s ``reference`` taken by
    ``referred``. Raises EOFError at its end (the other side has gone)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the stream ended")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the stream ended inside a message")
    if referred is None:
        return pickle.loads(data)
    unpickler = pickle.Unpickler(io.BytesIO(data))
    unpickler.persistent_load = referred  # type: ignore[method-assign]
    return unpickler.load()


def messages(stream: IO[bytes], *, referred: Referred | None = None) -> Iterator[Any]:
    """Every message on ``stream``, until it ends (``referred`` as :func:`read` takes it)."""
    while True:
        try:
            message = read(stream, referred=referred)
        except EOFError:
            return
        yield message
