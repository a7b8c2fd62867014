"""The driver's own connection to a world process: answers, admission by key, failures."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from pipedsl.executor.ray.step_channel import StepClient, StepServer

KEY = b"k" * 32


def _server(handle: object = None) -> StepServer:
    def echo(request: object) -> object:
        args, kwargs = request  # type: ignore[misc]
        return ("answer", args, kwargs)

    return StepServer("127.0.0.1", KEY, handle=handle or echo, failed=lambda err: ("failed", str(err)))  # type: ignore[arg-type]


def test_requests_are_answered_in_turn() -> None:
    server = _server()
    client = StepClient(server.address, KEY, timeout=10)
    try:
        for i in range(3):
            batch = np.arange(12, dtype=np.float32).reshape(3, 4) + i
            client.send(((batch,), {"update": None}))
            kind, args, kwargs = client.receive(timeout=10)
            assert kind == "answer" and kwargs == {"update": None}
            np.testing.assert_array_equal(args[0], batch)
    finally:
        client.close()


def test_a_failing_request_is_answered_with_the_failure() -> None:
    def refuse(request: object) -> object:
        raise ValueError("no such step")

    server = _server(refuse)
    client = StepClient(server.address, KEY, timeout=10)
    try:
        client.send(((), {}))
        assert client.receive(timeout=10) == ("failed", "no such step")
        # The connection goes on serving.
        client.send(((), {}))
        assert client.receive(timeout=10) == ("failed", "no such step")
    finally:
        client.close()


def test_each_end_must_hold_the_key() -> None:
    calls: list[object] = []
    server = _server(lambda request: calls.append(request))
    # A peer without the key is dropped before anything it sends is read.
    with pytest.raises((EOFError, ConnectionError)):
        StepClient(server.address, b"x" * 32, timeout=10)
    # A server that cannot answer the driver's challenge is refused by the driver's end.
    impostor = socket.create_server(("127.0.0.1", 0))

    def pretend() -> None:
        conn, _ = impostor.accept()
        with conn:
            conn.sendall(os.urandom(32))
            conn.recv(64)
            conn.sendall(os.urandom(32))
            conn.recv(1)

    thread = threading.Thread(target=pretend, daemon=True)
    thread.start()
    try:
        with pytest.raises(ConnectionError, match="does not hold the world's key"):
            StepClient(impostor.getsockname()[:2], KEY, timeout=10)
    finally:
        thread.join(timeout=10)
        impostor.close()
    # The server admits the next connection that has the key.
    client = StepClient(server.address, KEY, timeout=10)
    try:
        client.send(((1,), {}))
        client.receive(timeout=10)
    finally:
        client.close()
    assert calls == [((1,), {})]


def test_a_peer_that_leaves_unanswered_is_dropped_and_a_silent_server_times_out() -> None:
    server = _server()
    with socket.create_connection(server.address, timeout=10) as peer:
        peer.recv(32)  # the challenge, left unanswered
    client = StepClient(server.address, KEY, timeout=10)
    try:
        client.send(((), {}))
        assert client.receive(timeout=10)[0] == "answer"
    finally:
        client.close()
    # A process that never challenges: connecting gives up at its timeout.
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(TimeoutError):
            StepClient(listener.getsockname()[:2], KEY, timeout=0.2)
    finally:
        listener.close()
