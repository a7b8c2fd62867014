"""This process's connection to Ray: joined or started here, and never waited on without a bound.

:func:`connect` joins an existing cluster (``address=...`` or the ``RAY_ADDRESS``
environment variable) or starts a local instance that pipedsl also shuts down (the last
:func:`disconnect` does). A local instance is started with ``address="local"``, so that a
stale cluster recorded by an earlier ``ray start`` is never joined by accident, and keeps
all its traffic on 127.0.0.1: that takes ``_node_ip_address="127.0.0.1"`` *and* the
environment variable ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which Ray reads once, when it
is imported. The variable must not be set when joining a user's cluster (the driver would
then look for its node at 127.0.0.1), so which of the two happens is only known when
:func:`connect` is called; that is why the Ray backend's modules import ``ray`` inside
their functions, never at the top. If ``ray`` was imported before pipedsl starts a local
instance, the variable comes too late and the instance also listens on the machine's
interface address (it still works).

Bounds. Joining ``HOST:PORT`` (or ``ray://HOST:PORT``) first opens a TCP connection to it,
so an address where nothing listens fails at once; ``ray.init`` then runs in a helper
thread that this thread waits for at most ``timeout`` seconds (Ray retries an unanswering
cluster for many minutes), and a late success is shut down by the helper, so the process
is left as it was. A local instance is started in the calling thread instead: Ray ties
the processes it starts to the thread that started them (they are killed when it exits),
and bounds its own start-up. In the main thread a Ctrl-C during that start is held back
until the start is done, then the instance is shut down and ``KeyboardInterrupt`` raised,
so no process of a half-started instance is left behind (a second Ctrl-C does not wait).

A local instance pipedsl starts offers, beside its CPUs, :data:`SLOTS` units of the custom
resource :data:`SLOT`: device actors there reserve a slot instead of CPUs, so any number
of pipelines fit beside each other on one machine (they share its cores, as threads of
one process would).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from pipedsl.executor.errors import ExecutionError, first_line

__all__ = ["connect", "disconnect", "owns_instance", "SLOT", "SLOTS"]

_BACKEND_LOG_VAR = "RAY_BACKEND_LOG_LEVEL"
SLOT = "pipedsl_device"
"""The custom resource of a local instance pipedsl starts; one per device actor."""
SLOTS = 4096
"""How many device actors such an instance can hold."""

_LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Seconds to wait for the TCP handshake with a cluster's address.
_PROBE_TIMEOUT = 5.0


class _Connection:
    """This process's use of Ray: whether pipedsl started the instance, and how many
    users (device groups, explicit connects) hold it."""

    lock = threading.Lock()
    started_here = False
    users = 0


def owns_instance() -> bool:
    """Whether this process is connected to a local instance that pipedsl started."""
    return _Connection.started_here and _Connection.users > 0


def connect(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    timeout: float = 30.0,
    system_config: Mapping[str, Any] | None = None,
    verbose: bool = False,
) -> None:
    """Connect this process to Ray, once; every call must be paired with :func:`disconnect`.

    Joins ``address`` (or ``RAY_ADDRESS``) when given, else starts a local instance on
    127.0.0.1 with ``num_cpus`` CPUs (default: the machine's) and Ray's
    ``system_config`` options. When this process is already connected (by pipedsl or by
    the caller's own ``ray.init``), that connection is used as it is. Unless ``verbose``,
    Ray's own log lines below errors and its processes' output stay out of this terminal
    (they remain in Ray's session logs). Raises
    :class:`ExecutionError` when the cluster does not answer within ``timeout`` seconds.
    """
    with _Connection.lock:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            _Connection.users += 1
            return
        address = address or os.environ.get("RAY_ADDRESS") or None
        if address is None and "ray" not in sys.modules:
            os.environ[_LOOPBACK_VAR] = "0"
        if address is not None:
            _probe(address)
            options: dict[str, Any] = {"address": address}
            where = f"the Ray cluster at {address}"
        else:
            options = {
                "address": "local",
                "num_cpus": num_cpus,
                "resources": {SLOT: SLOTS},
                "include_dashboard": False,
                "_node_ip_address": "127.0.0.1",
            }
            if system_config:
                options["_system_config"] = dict(system_config)
            where = "a local Ray instance"
        options["log_to_driver"] = verbose
        options["logging_level"] = logging.INFO if verbose else logging.ERROR
        if not verbose:
            # Ray's C++ side (its GCS client retrying an address, for one) logs warnings
            # to this terminal; it reads its level when it starts. A level the user set stays.
            os.environ.setdefault(_BACKEND_LOG_VAR, "error")
        _init_bounded(options, timeout, where)
        _Connection.started_here = address is None
        _Connection.users = 1
        _exit_on_sigterm()


def disconnect() -> None:
    """Release one :func:`connect`; the last release shuts down a local instance pipedsl
    started (a joined cluster, or a connection the caller made, is left alone)."""
    with _Connection.lock:
        if _Connection.users == 0:
            return
        _Connection.users -= 1
        if _Connection.users == 0 and _Connection.started_here:
            import ray

            ray.shutdown()
            _Connection.started_here = False


def shutdown_started() -> None:
    """Shut down the local instance pipedsl started, whatever still holds it, for a process
    that ends without the interpreter's teardown (whose exit would shut it down)."""
    with _Connection.lock:
        if not _Connection.started_here:
            return
        import ray

        ray.shutdown()
        _Connection.started_here = False
        _Connection.users = 0


def _probe(address: str) -> None:
    """Raise at once when nothing accepts TCP connections at ``address``'s host and port
    (``auto`` and other forms without a port are left to Ray, under the time bound)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT).close()
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        raise ExecutionError(
            f"cannot connect to the Ray cluster at {address}: nothing answers at {host}:{port} ({reason}); "
            "check the address (RAY_ADDRESS or --address), or leave it unset to start a local instance"
        ) from None


class _NotMainThread(logging.Filter):
    """Hides Ray's note that a helper thread cannot set its SIGTERM handler (a joined
    cluster's driver needs none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "not the main thread" not in record.getMessage()


class _Join:
    """One ``ray.init`` joining a cluster in a helper thread, which the caller may abandon."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._abandoned = False

    def run(self) -> None:
        import ray

        try:
            ray.init(**self.options)
        except BaseException as err:  # handed to the waiting thread
            self.error = err
        with self._lock:
            self.done.set()
            if self._abandoned and ray.is_initialized():
                ray.shutdown()

    def abandon(self) -> None:
        """Nobody waits any longer: a connection made (now or later) is shut down."""
        import ray

        with self._lock:
            self._abandoned = True
            if self.done.is_set() and ray.is_initialized():
                ray.shutdown()


def _init_bounded(options: dict[str, Any], timeout: float, where: str) -> None:
    import ray  # imported here, in this thread, so that the loopback variable is read now

    with warnings.catch_warnings():
        # Ray starts its processes with fork and exec, which is safe with JAX's threads;
        # JAX warns about any fork all the same.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        if options["address"] == "local":
            error = _start_local(options)
        else:
            error = _join(options, timeout, where)
    if error is not None:
        raise ExecutionError(f"cannot connect to {where}: {type(error).__name__}: {first_line(error)}") from error
    if not ray.is_initialized():
        raise ExecutionError(f"cannot connect to {where}: ray.init returned without a connection")


def _join(options: dict[str, Any], timeout: float, where: str) -> BaseException | None:
    join = _Join(options)
    quiet = _NotMainThread()
    handlers = list(logging.getLogger("ray").handlers)
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        threading.Thread(target=join.run, name="pipedsl-ray-join", daemon=True).start()
        if not join.done.wait(timeout):
            raise ExecutionError(
                f"cannot connect to {where}: no answer within {timeout:g} s (start_timeout); "
                "check that the cluster is up and reachable from this machine"
            )
    except BaseException:
        join.abandon()
        raise
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
    return join.error


def _start_local(options: dict[str, Any]) -> BaseException | None:
    import ray

    if threading.current_thread() is not threading.main_thread():
        try:
            ray.init(**options)
        except Exception as err:  # Ray raises RuntimeError, ValueError, ConnectionError...
            return err
        return None
    interrupted: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if interrupted:
            raise KeyboardInterrupt
        interrupted.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        ray.init(**options)
    except Exception as err:  # as above
        return err
    finally:
        signal.signal(signal.SIGINT, previous)
        if interrupted and ray.is_initialized():
            ray.shutdown()
    if interrupted:
        raise KeyboardInterrupt
    return None


def _exit_on_sigterm() -> None:
    """Turn SIGTERM into a normal exit (which shuts Ray down), as ``ray.init`` does in the
    main thread; a handler the program set itself is kept."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
