"""Where the Ray backend's actors live: one actor per device, placed as one placement group.

Connecting is :mod:`pipedsl.executor.ray_connection`'s (:func:`connect` and
:func:`disconnect` are re-exported here): it joins a cluster or starts a local instance
on 127.0.0.1, and bounds every wait by ``start_timeout``.

:class:`RayDevices` is one actor per pipeline device (:class:`pipedsl.executor.ray_actor.DeviceActor`),
reserved as a placement group with one bundle per device: ``PACK`` (the default) keeps
neighbouring devices on one node where they fit; ``SPREAD`` and ``STRICT_SPREAD`` put
them on different nodes. On a local instance pipedsl started, a bundle is one device
slot of that instance (see :data:`~pipedsl.executor.ray_connection.SLOT`), so every
pipeline of a notebook gets its actors; on a joined cluster it is ``cpus_per_device``
CPUs (and GPUs), and a group that cannot be placed because others hold the resources
fails at once, naming the placement groups that hold them. Several pipelines may also
share one group (comparing schedules without restarting actors). :meth:`RayDevices.call`
runs one method on every actor with a time bound and turns a dead actor, a lost node or
a timeout into an :class:`~pipedsl.executor.errors.ExecutionError` that names the device
and its node.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from pipedsl.executor.devices import with_device_count
from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.ray_actor import DeviceActor, Failure
from pipedsl.executor.ray_connection import connect, disconnect, owns_instance
from pipedsl.executor.ray_placement import reserve

__all__ = ["RayConfig", "NodeInfo", "DeviceLost", "RayDevices", "connect", "disconnect", "STRATEGIES"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Placement group strategies (Ray's names) for the devices' bundles."""

# Threads per actor: one runs the step and blocks on receives; the others take
# deliveries and aborts from peers and the driver, which never block.
_ACTOR_THREADS = 4
# Seconds the devices get to stop after an abort before the driver gives up on them.
_STOP_GRACE = 10.0
# Seconds a device that overran its step gets to say what it is doing.
_ASK_GRACE = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RayConfig:
    """How the Ray backend finds its cluster and places and bounds its actors.

    Attributes:
      address: the cluster to join (``"auto"``, ``"HOST:PORT"``, ``"ray://HOST:PORT"``);
        None joins the cluster named by ``RAY_ADDRESS``, else starts a local instance.
        Ignored when this process is already connected to Ray.
      strategy: placement of the devices' bundles, one of :data:`STRATEGIES`.
      step_timeout: seconds the driver waits for one step on every actor (the first
        step also compiles the stages) and for any other call, before it aborts the
        step and raises.
      start_timeout: seconds to wait for the cluster to answer (or a local instance to
        start), for the placement group and for the actors to start.
      cpus_per_device: CPUs each actor reserves on a joined cluster (on a local instance
        pipedsl started, an actor reserves a device slot instead).
      gpus_per_device: GPUs each actor reserves; None means 1 when the cluster has GPUs,
        else 0.
      local_cpus: CPUs of a local instance pipedsl starts (default: the machine's count).
      runtime_env: Ray runtime environment of the actors (for example ``py_modules``
        holding the model's code on a remote cluster).
    """

    address: str | None = None
    strategy: str = "PACK"
    step_timeout: float = 600.0
    start_timeout: float = 30.0
    cpus_per_device: float = 1.0
    gpus_per_device: float | None = None
    local_cpus: int | None = None
    runtime_env: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ExecutionError(f"unknown placement strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        for name in ("step_timeout", "start_timeout"):
            if not getattr(self, name) > 0:
                raise ExecutionError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")
        if self.cpus_per_device < 0 or (self.gpus_per_device is not None and self.gpus_per_device < 0):
            raise ExecutionError("cpus_per_device and gpus_per_device must be >= 0")


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """Where one device's actor runs: Ray node id, node IP address and process id."""

    node_id: str
    ip: str
    pid: int

    def __str__(self) -> str:
        return f"node {self.node_id[:12]} at {self.ip}"


class DeviceLost(ExecutionError):
    """A device's actor died, or its node went away, or it stopped answering.

    The group's actors have been shut down: build a new pipeline (and restore the last
    checkpoint). ``node`` is where the lost device ran.
    """

    def __init__(self, message: str, *, stage: int | None, device: int, node: NodeInfo | None) -> None:
        self.node = node
        super().__init__(message, stage=stage, device=device)


# -- the device group -------------------------------------------------------------------


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class RayDevices:
    """One Ray actor per pipeline device, placed on the cluster as one placement group.

    Start with :meth:`start`; :meth:`close` (or leaving a ``with`` block) kills the
    actors, frees their resources and releases the connection. A device lost during a
    call closes the group itself.

    Attributes:
      config: the options it was started with.
      actors: the actor handles, ``actors[d]`` runs pipeline device ``d``.
      nodes: where each actor runs.
      offsets: per actor, its wall clock minus this process's, in seconds (measured at
        start; used to put every actor's recorded events on one clock).
      platforms: per actor, the JAX device it computes on (``"cpu:0"``, ``"cuda:0"``).
      step_timeout: the bound on every call, in seconds; starts as ``config.step_timeout``
        and may be lowered once the first step (which compiles) has run.
    """

    def __init__(
        self,
        config: RayConfig,
        actors: tuple[Any, ...],
        group: Any,
        nodes: tuple[NodeInfo, ...],
        offsets: tuple[float, ...],
        platforms: tuple[str, ...],
    ) -> None:
        self.config = config
        self.actors = actors
        self.nodes = nodes
        self.offsets = offsets
        self.platforms = platforms
        self.step_timeout = config.step_timeout
        self._group = group
        self._steps = itertools.count()
        self._closed = False

    @classmethod
    def start(
        cls, num_devices: int, config: RayConfig | None = None, *, jax_devices: int = 1, label: str = "devices"
    ) -> RayDevices:
        """Connect (see :func:`connect`), reserve one bundle per device and start the actors,
        each with ``jax_devices`` JAX devices for its stage mesh (GPUs where the cluster
        has them: ``gpus_per_device`` per JAX device; else that many forced CPU devices).

        ``label`` names the group's placement group (with this process id), so that a
        full cluster's error can say who holds what.
        """
        config = config or RayConfig()
        if num_devices < 1:
            raise ExecutionError(f"a device group needs at least one device, got {num_devices}")
        connect(config.address, num_cpus=_local_cpus(config), timeout=config.start_timeout)
        try:
            return cls._start(num_devices, config, jax_devices, label)
        except BaseException:
            disconnect()
            raise

    @classmethod
    def _start(cls, num_devices: int, config: RayConfig, jax_devices: int, label: str) -> RayDevices:
        import ray
        from ray.util.placement_group import remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = config.gpus_per_device
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        gpus *= jax_devices
        reservation = reserve(
            num_devices,
            cpus=config.cpus_per_device,
            gpus=gpus,
            strategy=config.strategy,
            timeout=config.start_timeout,
            label=label,
        )
        group = reservation.group
        remote = ray.remote(DeviceActor)
        actors = tuple(
            remote.options(
                **reservation.actor_options,
                max_concurrency=_ACTOR_THREADS,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=d),
                runtime_env=actor_runtime_env(
                    config.runtime_env, jax_devices, gpus=bool(gpus), threads=_threads_per_actor(config, num_devices)
                ),
            ).remote(d)
            for d in range(num_devices)
        )
        try:
            where = ray.get([a.where.remote() for a in actors], timeout=config.start_timeout)  # type: ignore[attr-defined]
            addresses = ray.get([a.serve.remote() for a in actors], timeout=config.start_timeout)  # type: ignore[attr-defined]
            ray.get([a.connect.remote(actors, addresses) for a in actors], timeout=config.start_timeout)  # type: ignore[attr-defined]
            offsets = tuple(_clock_offset(a, config.start_timeout) for a in actors)
        except BaseException as err:
            for actor in actors:
                ray.kill(actor)  # type: ignore[arg-type]
            remove_placement_group(group)
            if not isinstance(err, Exception):
                raise
            raise ExecutionError(
                f"the {num_devices} device actors did not start within {config.start_timeout:g} s: {_first_line(err)}"
            ) from err
        nodes = tuple(NodeInfo(node_id, ip, pid) for node_id, ip, pid, _ in where)
        platforms = tuple(platform for *_, platform in where)
        return cls(config, actors, group, nodes, offsets, platforms)

    @property
    def num_devices(self) -> int:
        return len(self.actors)

    @property
    def closed(self) -> bool:
        return self._closed

    def next_step(self) -> int:
        """A step number unique within this group (it keys the actors' mailboxes)."""
        return next(self._steps)

    def put(self, value: Any) -> Any:
        """``value`` in Ray's object store, once, for several actors to read."""
        import ray

        return ray.put(value)

    def call(
        self,
        method: str,
        args: Sequence[tuple[tuple[Any, ...], dict[str, Any]] | None],
        *,
        what: str,
        step: int | None = None,
        stages: Callable[[int], tuple[int, ...]] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every actor ``d`` with ``args[d]`` (positional, keyword; None
        skips the actor) and return the results by device.

        Waits at most :attr:`step_timeout` seconds. A dead actor
        or node raises :class:`DeviceLost` (after closing the group); a timeout aborts
        ``step`` on every actor and raises :class:`ExecutionError`; the first
        :class:`~pipedsl.executor.ray_actor.Failure` returned aborts ``step`` on every
        actor too (and is returned). ``what`` names the call and ``stages(d)`` device d's
        stages in messages.
        """
        import ray
        from ray.exceptions import RayActorError, RayError

        self._check_open()
        limit = self.step_timeout
        pending = {
            getattr(self.actors[d], method).remote(*a[0], **a[1]): d for d, a in enumerate(args) if a is not None
        }
        results: list[Any] = [None] * len(args)
        deadline = time.monotonic() + limit
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._timed_out(pending, what, limit, step, stages)
            for ref in ready:
                d = pending.pop(ref)
                try:
                    results[d] = ray.get(ref, timeout=limit)
                    if isinstance(results[d], Failure) and not results[d].peer:
                        self.abort(step, f"device {d} failed")
                except RayActorError as err:
                    self._lost(d, what, err, step, stages)
                except RayError as err:
                    self.abort(step, f"device {d} failed")
                    message = f"{what}: device {d} ({self.nodes[d]}) raised {_first_line(err)}"
                    raise ExecutionError(message + self._drain(pending), device=d) from err
        return results

    def abort(self, step: int | None, message: str) -> None:
        """Tell every actor that ``step`` failed, so that none waits for it any longer."""
        if step is None or self._closed:
            return
        for actor in self.actors:
            actor.abort.remote(step, None, message)

    def close(self) -> None:
        """Kill the actors, free their placement group, release the connection."""
        if self._closed:
            return
        self._closed = True
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            # Ray may already be shut down (at exit, or by the caller): then so are the actors.
            if ray.is_initialized():
                for actor in self.actors:
                    ray.kill(actor, no_restart=True)
                remove_placement_group(self._group)
        finally:
            disconnect()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- failures -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ExecutionError(
                "these Ray devices are closed (a device was lost, or close() was called); "
                "build a new pipeline and restore the last checkpoint"
            )

    def _describe(self, d: int, stages: Callable[[int], tuple[int, ...]] | None) -> str:
        owned = stages(d) if stages is not None else ()
        held = f", stage{'s' if len(owned) != 1 else ''} {', '.join(map(str, owned))}" if owned else ""
        return f"device {d}{held}, on {self.nodes[d]}"

    def _lost(self, d: int, what: str, err: BaseException, step: int | None, stages: Callable[[int], tuple[int, ...]] | None) -> None:
        self.abort(step, f"device {d} was lost")
        reason = _first_line(err)
        if not _node_alive(self.nodes[d].node_id):
            reason = f"its node is gone ({reason})"
        owned = stages(d) if stages is not None else ()
        self.close()
        raise DeviceLost(
            f"{what}: {self._describe(d, stages)} was lost: its actor died: {reason}. The pipeline's "
            "actors have been shut down; build a new Pipeline and restore the last checkpoint",
            stage=owned[0] if owned else None,
            device=d,
            node=self.nodes[d],
        ) from err

    def _timed_out(
        self,
        pending: dict[Any, int],
        what: str,
        limit: float,
        step: int | None,
        stages: Callable[[int], tuple[int, ...]] | None,
    ) -> None:
        running = sorted(pending.values())
        # Asked before the abort changes it; a call other than a step says nothing.
        doing = self._doing(running) if step is not None else dict.fromkeys(running, "")
        self.abort(step, f"the driver stopped waiting after {limit:g} s")
        where = "; ".join(
            self._describe(d, stages) + ("" if _node_alive(self.nodes[d].node_id) else " (node gone)") + doing[d]
            for d in running
        )
        message = f"{what} did not finish within {limit:g} s (step_timeout): still running: {where}"
        first = running[0]
        owned = stages(first) if stages is not None else ()
        if step is None:
            # Not a step (compiling, loading): nothing can stop it, so stop the actors.
            self.close()
            message += "; it cannot be aborted, so the actors have been shut down: build a new Pipeline"
        else:
            message += self._drain(pending)
        raise ExecutionError(message, stage=owned[0] if owned else None, device=first)

    def _doing(self, devices: Sequence[int]) -> dict[int, str]:
        """``", <what device d says its step is doing>"`` for each of ``devices``; an
        actor that does not answer within :data:`_ASK_GRACE` seconds (its process busy
        or stuck outside Python's reach) is said not to answer."""
        import ray
        from ray.exceptions import RayError

        asked = {d: self.actors[d].doing.remote() for d in devices}
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=_ASK_GRACE)
        answers = {}
        for d, ref in asked.items():
            try:
                answers[d] = f", {ray.get(ref, timeout=0)}" if ref in ready else f", not answering within {_ASK_GRACE:g} s"
            except RayError as err:
                answers[d] = f", not answering ({_first_line(err)})"
        return answers

    def _drain(self, pending: dict[Any, int]) -> str:
        """Wait a little for calls still running after an abort; if some do not return,
        close the group and say so (for the end of an error message)."""
        import ray

        # An aborted device returns at its next receive; one that does not is stuck in a
        # computation, and a group with a step still running cannot take another.
        if not pending:
            return ""
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_STOP_GRACE)
        if len(ready) == len(pending):
            return ""
        self.close()
        return "; devices did not stop, so the actors have been shut down: build a new Pipeline"


# glibc's allocator, as a CPU actor starts with it: keep up to this many free bytes at the
# top of a heap rather than give them back to the system, and serve blocks up to 32 MiB
# (glibc's largest threshold) from the heaps rather than from a mapping of their own.
_ALLOCATOR = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def actor_runtime_env(
    base: Mapping[str, Any] | None, jax_devices: int, *, gpus: bool, threads: int
) -> dict[str, Any] | None:
    """An actor's runtime environment: ``base``, and on CPU what its process reads when it
    starts: ``jax_devices`` host devices (whatever count the driver's own ``XLA_FLAGS``
    asks for, which the actor would otherwise inherit), a compute thread pool of
    ``threads`` (``NPROC``, which XLA's CPU client sizes its pool by) and glibc's
    allocator thresholds (:data:`_ALLOCATOR`); ``base`` may set its own pool and
    thresholds.

    Why the pool: by default every actor's XLA takes a thread per core of the node, so
    actors sharing a node run more compute threads than it has cores, and an operation
    split over threads waits for its slowest part while another actor holds that core.
    Sized to the actor's share of the cores (as Ray sizes ``OMP_NUM_THREADS`` by the CPUs
    an actor reserves), a two-actor 1F1B step on two cores took 0.80-0.88 of the time.

    Why the thresholds: a CPU actor's buffers (activations, gradients, their sums) are
    freed and made again every step, and with glibc's defaults the freed memory often
    went back to the system, to be faulted in and zeroed anew the next step (up to a
    quarter of an actor's time, in the kernel). Kept, an actor holds its largest step's
    memory, as JAX's own device allocators do, and a two-actor 1F1B step on two cores
    took 0.80-0.99 of the time (median 0.85 over eight runs taking turns)."""
    env = dict(base) if base else {}
    if not gpus:
        variables = dict(env.get("env_vars", {}))
        variables["XLA_FLAGS"] = with_device_count(variables.get("XLA_FLAGS", ""), jax_devices)
        variables.setdefault("NPROC", str(threads))
        for name, value in _ALLOCATOR.items():
            variables.setdefault(name, value)
        env["env_vars"] = variables
    return env or None


def _threads_per_actor(config: RayConfig, num_devices: int) -> int:
    """The compute threads each actor's XLA gets on CPU: its share of a local instance's
    cores, or the whole CPUs it reserves on a joined cluster; at least one."""
    if owns_instance():
        return max(1, _local_cpus(config) // num_devices)
    return max(1, int(config.cpus_per_device))


def _local_cpus(config: RayConfig) -> int:
    """The CPUs of a local instance pipedsl starts."""
    return config.local_cpus or os.cpu_count() or 1


def _node_alive(node_id: str) -> bool:
    import ray

    try:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    except Exception:  # the cluster itself may be unreachable; then say nothing more
        return True


def _clock_offset(actor: Any, timeout: float) -> float:
    """The actor's wall clock minus this process's, in seconds: of three round trips,
    the shortest, assuming the actor read its clock halfway through (Cristian's method)."""
    import ray

    best = (float("inf"), 0.0)
    for _ in range(3):
        sent = time.time()
        theirs = ray.get(actor.clock.remote(), timeout=timeout)
        back = time.time()
        best = min(best, (back - sent, theirs - (sent + back) / 2))
    return best[1]
