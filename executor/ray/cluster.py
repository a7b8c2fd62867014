"""A pipeline's processes on Ray: one ``jax.distributed`` world, started, placed and supervised.

Connecting is :mod:`pipedsl.executor.ray.connection`'s (:func:`connect` and :func:`disconnect`
are re-exported here): it joins a cluster or starts a local instance on 127.0.0.1, and bounds
every wait by ``start_timeout``.

:class:`RayWorld` is one Ray actor process (:class:`~pipedsl.executor.ray.actor.WorldProcess`)
per slot of ``devices_per_process`` JAX devices, reserved as one placement group with a bundle
per process (``PACK`` by default; ``SPREAD``/``STRICT_SPREAD`` put processes on different nodes).
On CPU each process gets that many forced host devices, set in its environment before JAX
starts; on GPU that many GPUs through Ray's ``num_gpus`` (Ray sets ``CUDA_VISIBLE_DEVICES``),
with JAX's memory options from :class:`RayConfig`. The first process picks the coordinator's
address (127.0.0.1 on a local instance pipedsl started, else its node's IP) and the others are
handed it by the driver; all join at once. The driver is not in the world. Each process is
bound to cores of its node (:mod:`pipedsl.executor.ray.cores`; on CPU unless
``bind_cores=False``), and serves the driver's step calls on a connection of its own
(:mod:`pipedsl.executor.ray.step_channel`).

:meth:`RayWorld.call` runs one method on every process with a time bound, as Ray tasks;
:meth:`RayWorld.step` runs a step the same way on those connections. A process that dies
(or whose node goes away) or that does not answer within ``step_timeout`` ends the call with
:class:`DeviceLost` naming its node, process and stage, and the world is torn down: a
collective whose partner is gone never returns, so no process of the world can take another
step. A pipeline after it needs a new world.

A pipeline normally starts its own world and ends it when it closes. A world started with
:meth:`RayWorld.start` may instead be handed to pipelines as their ``backend``, one after
another: each installs its programs in the world's processes and, when it closes, has them
forget its programs, parameters and state, while the processes and their ``jax.distributed``
world stay up for the next (a sweep over plans pays for starting the processes once). A
pipeline takes a world whose processes and devices its plan fits exactly; the world runs one
pipeline at a time, and a failure that tears it down ends it for every later pipeline too.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from pipedsl.executor.devices import with_device_count
from pipedsl.executor.errors import ExecutionError, first_line
from pipedsl.executor.ray.actor import WorldProcess
from pipedsl.executor.ray.connection import connect, disconnect, owns_instance
from pipedsl.executor.ray.placement import reserve
from pipedsl.executor.ray.step_channel import StepClient

__all__ = ["RayConfig", "NodeInfo", "DeviceSlot", "DeviceLost", "RayWorld", "connect", "disconnect", "STRATEGIES"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Placement group strategies (Ray's names) for the processes' bundles."""

# Threads per actor: one runs the step; another answers what it is doing.
_ACTOR_THREADS = 2
# Seconds a process that overran its step gets to say what it is doing.
_ASK_GRACE = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RayConfig:
    """How the Ray backend finds its cluster, and starts, places and bounds its processes.

    Attributes:
      address: the cluster to join (``"auto"``, ``"HOST:PORT"``, ``"ray://HOST:PORT"``);
        None joins the cluster named by ``RAY_ADDRESS``, else starts a local instance.
        Ignored when this process is already connected to Ray.
      devices_per_process: JAX devices of each process of the world. None: on a cluster
        with GPUs, every GPU of a node; on CPU, the plan's ``tp`` (1 without tensor
        parallelism). A pipeline device's ``dp x tp`` mesh spans ``dp * tp /
        devices_per_process`` processes, which must be whole and keep ``tp`` inside each.
      strategy: placement of the processes' bundles, one of :data:`STRATEGIES`.
      step_timeout: seconds the driver waits for one step of every process (the first
        step also compiles the stages) and for any other call; a process that takes
        longer is lost (:class:`DeviceLost`).
      start_timeout: seconds to wait for the cluster to answer (or a local instance to
        start), for the placement group, and for the processes to start and join.
      cpus_per_process: CPUs each process reserves on a joined cluster (on a local
        instance pipedsl started, a process reserves a slot instead).
      local_cpus: CPUs of a local instance pipedsl starts (default: the machine's count).
      runtime_env: Ray runtime environment of the processes (for example
        ``py_modules`` holding the model's code on a remote cluster).
      gpu_preallocate: on GPU, whether JAX takes its memory pool up front
        (``XLA_PYTHON_CLIENT_PREALLOCATE``); None keeps JAX's default (it does).
      gpu_memory_fraction: on GPU, the fraction of each GPU's memory that pool takes
        (``XLA_PYTHON_CLIENT_MEM_FRACTION``, JAX's default 0.75); None keeps the default.
      verbose: let Ray's own log lines and the processes' output reach this terminal.
      bind_cores: bind each process, all its threads, to cores of its node shared out
        among the node's pipedsl processes (as many as its XLA compute threads: its share
        of a local instance's cores, or ``cpus_per_process``; see
        :mod:`pipedsl.executor.ray.cores`). None: on CPU only (the collectives' host threads
        are the step's path there); on GPUs the operating system places them unless True.
    """

    address: str | None = None
    devices_per_process: int | None = None
    strategy: str = "PACK"
    step_timeout: float = 600.0
    start_timeout: float = 60.0
    cpus_per_process: float = 1.0
    local_cpus: int | None = None
    runtime_env: Mapping[str, Any] | None = None
    gpu_preallocate: bool | None = None
    gpu_memory_fraction: float | None = None
    verbose: bool = False
    bind_cores: bool | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ExecutionError(f"unknown placement strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
        for name in ("step_timeout", "start_timeout"):
            if not getattr(self, name) > 0:
                raise ExecutionError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")
        if self.cpus_per_process < 0:
            raise ExecutionError(f"cpus_per_process must be >= 0, got {self.cpus_per_process!r}")
        if self.devices_per_process is not None:
            _check_count("devices_per_process", self.devices_per_process)
        f = self.gpu_memory_fraction
        if f is not None and not 0 < f <= 1:
            raise ExecutionError(f"gpu_memory_fraction must be in (0, 1], got {f!r}")


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """Where one process runs: Ray node id, node IP address, OS process id, its rank in
    the world, and the CPU cores it is bound to (empty: wherever the system puts it)."""

    node_id: str
    ip: str
    pid: int
    rank: int
    cores: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"process {self.rank} (pid {self.pid}) on node {self.node_id[:12]} at {self.ip}"


@dataclass(frozen=True, slots=True)
class DeviceSlot:
    """One JAX device of a stage mesh: the Ray node it is on, the rank of its process in
    the world (``jax.process_index()``) and its global JAX device id."""

    node_id: str
    process_id: int
    device_id: int


class DeviceLost(ExecutionError):
    """A process of the world died, or its node went away, or it stopped answering.

    The world has been torn down: build a new pipeline (and restore the last
    checkpoint). ``node`` is where the lost process ran.
    """

    def __init__(self, message: str, *, stage: int | None, device: int | None, node: NodeInfo | None) -> None:
        self.node = node
        super().__init__(message, stage=stage, device=device)


class RayWorld:
    """``num_processes`` Ray actor processes, ``devices_per_process`` JAX devices each, in
    one ``jax.distributed`` world (see the module docstring). Start with :meth:`start`;
    :meth:`close` (or leaving a ``with`` block) kills them and frees their resources. Pass it
    as a pipeline's ``backend`` to run several pipelines on it one after another.

    Attributes:
      config: the options it was started with.
      actors: the actor handles by rank.
      nodes: where each process runs.
      devices: per process, the global ids of its JAX devices.
      platform: ``"cpu"`` or ``"gpu"``.
    """

    def __init__(
        self,
        config: RayConfig,
        actors: tuple[Any, ...],
        group: Any,
        nodes: tuple[NodeInfo, ...],
        devices: tuple[tuple[int, ...], ...],
        platform: str,
        steps: tuple[StepClient, ...],
    ) -> None:
        self.config = config
        self.actors = actors
        self.nodes = nodes
        self.devices = devices
        self.platform = platform
        self._group = group
        self._steps = steps
        self._closed = False
        self._user: object | None = None

    @classmethod
    def start(
        cls,
        num_processes: int,
        *,
        devices_per_process: int = 1,
        config: RayConfig | None = None,
        label: str = "pipedsl",
    ) -> RayWorld:
        """Connect (see :func:`connect`), reserve one bundle per process, start the
        processes and form the world (``config``: default :class:`RayConfig`). ``label``
        names the placement group."""
        config = RayConfig() if config is None else config
        _check_count("num_processes", num_processes)
        _check_count("devices_per_process", devices_per_process)
        connect(config.address, num_cpus=_local_cpus(config), timeout=config.start_timeout, verbose=config.verbose)
        try:
            return cls._start(num_processes, devices_per_process, config, label)
        except BaseException:
            disconnect()
            raise

    @classmethod
    def _start(cls, n: int, k: int, config: RayConfig, label: str) -> RayWorld:
        import ray
        from ray.util.placement_group import remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = ray.cluster_resources().get("GPU", 0) >= 1
        reservation = reserve(
            n, cpus=config.cpus_per_process, gpus=float(k) if gpu else 0.0, strategy=config.strategy,
            timeout=config.start_timeout, label=label,
        )  # fmt: skip
        group = reservation.group
        remote = ray.remote(WorldProcess)
        threads = _threads_per_process(config, n)
        env = process_env(config, k, gpu=gpu, threads=threads)
        bind = config.bind_cores if config.bind_cores is not None else not gpu
        # Ray's stubs type an actor class's handles loosely: they are handles here.
        actors: tuple[Any, ...] = tuple(
            remote.options(
                **reservation.actor_options,
                max_concurrency=_ACTOR_THREADS,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=r
                ),
                runtime_env=env,
            ).remote(r, n)
            for r in range(n)
        )
        timeout = config.start_timeout
        steps: list[StepClient] = []
        try:
            loopback = owns_instance()
            address = ray.get(actors[0].coordinator.remote(loopback), timeout=timeout)
            where = ray.get([a.join.remote(address, timeout=timeout) for a in actors], timeout=timeout)
            # One at a time in rank order, so that a node's processes take its cores in that
            # order: where they must share cores, consecutive ranks (neighbouring stages,
            # or a mesh's data-parallel rows) are on different ones.
            cores = [ray.get(a.bind.remote(threads), timeout=timeout) if bind else () for a in actors]
            key = os.urandom(32)
            served = ray.get([a.serve_steps.remote(key, loopback) for a in actors], timeout=timeout)
            steps.extend(StepClient(at, key, timeout=timeout) for at in served)
        except BaseException as err:
            for channel in steps:
                channel.close()
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(group)
            if not isinstance(err, Exception):
                raise
            raise ExecutionError(
                f"the {n} processes of the world did not start and join within {timeout:g} s (start_timeout): "
                f"{first_line(err)}"
            ) from err
        nodes = tuple(NodeInfo(node_id, ip, pid, r, cores[r]) for r, (node_id, ip, pid, _) in enumerate(where))
        devices = tuple(ids for *_, ids in where)
        for r, ids in enumerate(devices):
            if len(ids) != k:
                raise ExecutionError(f"process {r} has {len(ids)} JAX devices where {k} were asked for")
        return cls(config, actors, group, nodes, devices, "gpu" if gpu else "cpu", tuple(steps))

    @property
    def num_processes(self) -> int:
        return len(self.actors)

    @property
    def devices_per_process(self) -> int:
        """JAX devices of each process."""
        return len(self.devices[0])

    def attach(self, user: object, *, needs: int, what: str) -> None:
        """Let ``user`` (a pipeline's runner, whose plan ``what`` takes ``needs`` processes of
        :attr:`devices_per_process` devices) run on this world until it leaves
        (:meth:`detach`); refused while another is attached."""
        if self._closed:
            raise ExecutionError(
                "this Ray world is closed (a process was lost, a pipeline on it failed, or close() was called); "
                "start another"
            )
        if self._user is not None:
            raise ExecutionError("this Ray world runs another pipeline; close that pipeline first")
        if needs != self.num_processes:
            raise ExecutionError(
                f"{what} takes {needs} processes of devices_per_process={self.devices_per_process}; this Ray world "
                f"has {self.num_processes}: start a world of {needs} processes for it"
            )
        self._user = user

    def detach(self, user: object, *, stage_of: Callable[[int], int | None]) -> None:
        """``user`` is done: its processes forget its programs, parameters and state (when
        the world is still up; ``stage_of`` as for :meth:`call`), and the world can take
        another pipeline."""
        if self._user is not user:
            return
        self._user = None
        if self._closed:
            return
        try:
            self.call("release", [((), {})] * self.num_processes, what="releasing a pipeline", stage_of=stage_of)
        except ExecutionError:
            # A process lost or stuck while forgetting: call() has torn the world down, and
            # the next pipeline given it is told so; closing this one stays quiet, as
            # closing a pipeline's own world does.
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, value: Any) -> Any:
        """``value`` in Ray's object store, once, for several processes to read."""
        import ray

        return ray.put(value)

    def call(
        self,
        method: str,
        args: Sequence[tuple[tuple[Any, ...], dict[str, Any]] | None],
        *,
        what: str,
        stage_of: Callable[[int], int | None],
        timeout: float | None = None,
        stop_at: Callable[[Any], bool] | None = None,
    ) -> list[Any]:
        """Run ``method`` on every process ``r`` with ``args[r]`` (positional, keyword;
        None skips it) and return the results by rank. With ``stop_at``, the first result
        for which it is true returns at once (the others are then None): a process that
        failed may leave its partners waiting in a collective that never comes.

        Waits at most ``timeout`` seconds (default ``step_timeout``). A dead process or
        node, or one that does not answer in time, raises :class:`DeviceLost` after the
        world is torn down. ``what`` names the call and ``stage_of(r)`` process r's
        first stage in messages.
        """
        import ray
        from ray.exceptions import RayActorError, RayError

        self._check_open()
        limit = self.config.step_timeout if timeout is None else timeout
        pending = {
            getattr(self.actors[r], method).remote(*a[0], **a[1]): r for r, a in enumerate(args) if a is not None
        }
        results: list[Any] = [None] * len(args)
        deadline = time.monotonic() + limit
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._timed_out(sorted(pending.values()), what, limit, stage_of)
            for ref in ready:
                r = pending.pop(ref)
                try:
                    results[r] = ray.get(ref, timeout=limit)
                    if stop_at is not None and stop_at(results[r]):
                        return results
                except RayActorError as err:
                    self._lost(r, what, err, stage_of)
                except RayError as err:
                    self.close()
                    raise ExecutionError(
                        f"{what}: {self.nodes[r]} raised {first_line(err)}; the world has been torn down: "
                        "build a new Pipeline",
                        device=None,
                    ) from err
        return results

    def step(
        self,
        args: Sequence[tuple[tuple[Any, ...], dict[str, Any]] | None],
        *,
        what: str,
        stage_of: Callable[[int], int | None],
        stop_at: Callable[[Any], bool] | None = None,
        method: str = "run_step",
    ) -> list[Any]:
        """:meth:`call` of ``method`` (``run_step``, or another call a step's connection
        serves: reading a kept loss, waiting for what was dispatched), made on the driver's
        own connections to the processes (:mod:`pipedsl.executor.ray.step_channel`) rather
        than as Ray tasks: the same arguments, results, ``stop_at``, ``step_timeout`` and
        errors (a process whose connection closes is lost). A process answers its calls in
        the order they were made. A call that returns at ``stop_at``, or is interrupted,
        leaves answers unread: the world is then torn down, as its processes may still be
        waiting in the step's collectives."""
        self._check_open()
        limit = self.config.step_timeout
        deadline = time.monotonic() + limit
        pending: dict[StepClient, int] = {}
        results: list[Any] = [None] * len(args)
        try:
            for r, a in enumerate(args):
                if a is not None:
                    try:
                        self._steps[r].send((method, *a))
                    except OSError as err:
                        self._lost(r, what, err, stage_of)
                    pending[self._steps[r]] = r
            while pending:
                ready, _, _ = select.select(list(pending), [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    self._timed_out(sorted(pending.values()), what, limit, stage_of)
                for channel in ready:
                    r = pending.pop(channel)
                    try:
                        results[r] = channel.receive(timeout=max(0.0, deadline - time.monotonic()))
                    except (OSError, EOFError) as err:
                        self._lost(r, what, err, stage_of)
                    if stop_at is not None and stop_at(results[r]):
                        return results
        finally:
            if pending:
                self.close()
        return results

    def close(self) -> None:
        """Kill the processes, free their placement group, release the connection."""
        if self._closed:
            return
        self._closed = True
        for channel in self._steps:
            channel.close()
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
                "this pipeline's Ray world is closed (a process was lost, or close() was called); "
                "build a new Pipeline and restore the last checkpoint"
            )

    def _describe(self, r: int, stage_of: Callable[[int], int | None]) -> str:
        stage = stage_of(r)
        return f"{self.nodes[r]}" + (f", stage {stage}" if stage is not None else "")

    def _lost(self, r: int, what: str, err: BaseException, stage_of: Callable[[int], int | None]) -> None:
        reason = first_line(err)
        if not _node_alive(self.nodes[r].node_id):
            reason = f"its node is gone ({reason})"
        self.close()
        raise DeviceLost(
            f"{what}: {self._describe(r, stage_of)} was lost: {reason}. The world has been torn down; "
            "build a new Pipeline and restore the last checkpoint",
            stage=stage_of(r),
            device=None,
            node=self.nodes[r],
        ) from err

    def _timed_out(
        self, running: Sequence[int], what: str, limit: float, stage_of: Callable[[int], int | None]
    ) -> None:
        doing = self._doing(running)
        where = "; ".join(self._describe(r, stage_of) + doing[r] for r in running)
        first = running[0]
        self.close()
        raise DeviceLost(
            f"{what} did not finish within {limit:g} s (step_timeout): still running: {where}. The world "
            "has been torn down; build a new Pipeline and restore the last checkpoint",
            stage=stage_of(first),
            device=None,
            node=self.nodes[first],
        )

    def _doing(self, ranks: Sequence[int]) -> dict[int, str]:
        """``", <what process r says it is doing>"`` for each rank; one that does not
        answer within :data:`_ASK_GRACE` seconds is said not to answer."""
        import ray
        from ray.exceptions import RayError

        asked = {r: self.actors[r].doing.remote() for r in ranks}
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=_ASK_GRACE)
        answers = {}
        for r, ref in asked.items():
            try:
                answers[r] = (
                    f", {ray.get(ref, timeout=0)}" if ref in ready else f", not answering within {_ASK_GRACE:g} s"
                )
            except RayError as err:
                answers[r] = f", not answering ({first_line(err)})"
        return answers


# glibc's allocator, as a CPU process starts with it: keep up to this many free bytes at the
# top of a heap rather than give them back to the system, and serve blocks up to 32 MiB
# from the heaps rather than from a mapping of their own (a process's buffers are freed and
# made again every step; given back, they were faulted in and zeroed anew each time).
_ALLOCATOR = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ExecutionError(f"{name} must be a positive integer, got {value!r}")


def process_env(config: RayConfig, devices: int, *, gpu: bool, threads: int) -> dict[str, Any]:
    """A process's runtime environment: ``config.runtime_env``, and what its JAX reads when
    it starts. On CPU: ``devices`` host devices (whatever the driver's own ``XLA_FLAGS``
    asks), the CPU platform only, a compute pool of ``threads`` (``NPROC``, which XLA's
    CPU client sizes its pool by: processes sharing a node would otherwise each take a
    thread per core) and glibc's allocator thresholds. On GPU: the memory options."""
    env = dict(config.runtime_env) if config.runtime_env else {}
    variables = dict(env.get("env_vars", {}))
    if gpu:
        if config.gpu_preallocate is not None:
            variables["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if config.gpu_preallocate else "false"
        if config.gpu_memory_fraction is not None:
            variables["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{config.gpu_memory_fraction:g}"
    else:
        variables["XLA_FLAGS"] = with_device_count(variables.get("XLA_FLAGS", ""), devices)
        variables["JAX_PLATFORMS"] = "cpu"
        variables.setdefault("NPROC", str(threads))
        for name, value in _ALLOCATOR.items():
            variables.setdefault(name, value)
    env["env_vars"] = variables
    return env


def _threads_per_process(config: RayConfig, num_processes: int) -> int:
    """Compute threads of each process's XLA on CPU: its share of a local instance's
    cores, or the CPUs it reserves on a joined cluster; at least one."""
    if owns_instance():
        return max(1, _local_cpus(config) // num_processes)
    return max(1, int(config.cpus_per_process))


def _local_cpus(config: RayConfig) -> int:
    return config.local_cpus or os.cpu_count() or 1


def _node_alive(node_id: str) -> bool:
    import ray

    try:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    except Exception:  # the cluster itself may be unreachable; then say nothing more
        return True
