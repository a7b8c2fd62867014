"""Reserving a Ray device group's resources: one placement group bundle per device.

:func:`reserve` asks for the bundles and waits for them. On a local instance pipedsl
started, a bundle is one device slot (:data:`~pipedsl.executor.ray.connection.SLOT`), which
never runs out; on a joined cluster it is the CPUs and GPUs each device reserves. When
the group is not placed within a moment, the cluster's free resources are compared with
the request: if they are short, the reservation fails at once (waiting would not help:
nothing in pipedsl frees them), and the message names the placement groups holding the
resources (pipedsl names its own after the pipeline and the process that made them) and
what is held outside any group. Otherwise (a strategy that the free resources cannot
satisfy yet, a node still joining) it waits up to the start timeout.

``ray`` is imported inside the functions (see :mod:`pipedsl.executor.ray.connection`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipedsl.executor.errors import ExecutionError
from pipedsl.executor.ray.connection import SLOT, owns_instance

__all__ = ["Reservation", "reserve"]

# Seconds a group gets to be placed before the free resources are checked.
_QUICK_WAIT = 2.0
# Resources named in messages (Ray also tracks memory, object store and node labels).
_SHOWN = ("CPU", "GPU")
# Numbers this process's groups: Ray's placement group names are unique in a cluster, and
# one process may hold several groups of one label (two pipelines of one schedule).
_GROUP_NUMBERS = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A placed group: the placement group handle, one device's bundle, and the
    ``num_cpus``/``num_gpus``/``resources`` options each device actor starts with."""

    group: Any
    bundle: Mapping[str, float]
    actor_options: Mapping[str, Any]


def reserve(
    num_devices: int,
    *,
    cpus: float,
    gpus: float | None,
    strategy: str,
    timeout: float,
    label: str,
) -> Reservation:
    """Place ``num_devices`` bundles under ``strategy`` (see the module docstring); the
    group is named after ``label``, this process and the group's number in it. Raises
    :class:`ExecutionError`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    if owns_instance():
        bundle: dict[str, float] = {SLOT: 1.0}
        options: dict[str, Any] = {"num_cpus": 0, "num_gpus": gpus, "resources": {SLOT: 1.0}}
    else:
        bundle = {"CPU": cpus} if cpus else {}
        options = {"num_cpus": cpus, "num_gpus": gpus}
    if gpus:
        bundle["GPU"] = gpus
    if not bundle:
        raise ExecutionError("a device must reserve some CPUs or GPUs on a joined cluster; raise cpus_per_process")
    name = f"pipedsl {label} ({num_devices} devices, process {os.getpid()}, group {next(_GROUP_NUMBERS)})"
    group = placement_group([dict(bundle) for _ in range(num_devices)], strategy=strategy, name=name)
    try:
        if not group.wait(timeout_seconds=min(_QUICK_WAIT, timeout)):
            short = _shortfall(bundle, num_devices)
            if short is not None:
                raise ExecutionError(short + _holders(group))
            if not group.wait(timeout_seconds=max(0.0, timeout - _QUICK_WAIT)):
                have = {k: v for k, v in ray.cluster_resources().items() if k in _SHOWN}
                hint = "fewer devices or a smaller cpus_per_process"
                if strategy != "PACK":
                    hint += ", or strategy PACK"
                raise ExecutionError(
                    f"the cluster cannot place {num_devices} devices of {_fmt(bundle)} each under strategy "
                    f"{strategy} within {timeout:g} s (start_timeout; it has {_fmt(have)} over "
                    f"{len(ray.nodes())} node(s)); use {hint}"
                )
    except BaseException:
        remove_placement_group(group)
        raise
    return Reservation(group, bundle, options)


def _shortfall(bundle: Mapping[str, float], count: int) -> str | None:
    """Why ``count`` bundles do not fit in the cluster's free resources, or None if they do."""
    import ray

    free, total = ray.available_resources(), ray.cluster_resources()
    for resource, amount in bundle.items():
        need = amount * count
        if need <= free.get(resource, 0.0) + 1e-9:
            continue
        if need > total.get(resource, 0.0) + 1e-9:
            return (
                f"the cluster cannot hold {count} devices of {_fmt(bundle)} each: they need {need:g} {resource} "
                f"and it has {total.get(resource, 0.0):g} in all; use fewer devices or a smaller cpus_per_process"
            )
        return (
            f"the cluster is full: {count} devices of {_fmt(bundle)} each need {need:g} {resource}, "
            f"{free.get(resource, 0.0):g} of its {total.get(resource, 0.0):g} are free. "
            "Close pipelines you no longer use (Pipeline.close(), or a `with` block), or use a "
            "smaller cpus_per_process"
        )
    return None


def _holders(pending: Any) -> str:
    """Who holds the cluster's CPUs and GPUs: its placement groups, and the rest."""
    import ray
    from ray.util.placement_group import placement_group_table

    held: dict[str, float] = {}
    lines = []
    for group_id, info in placement_group_table().items():
        if group_id == pending.id.hex() or info.get("state") != "CREATED":
            continue
        sums: dict[str, float] = {}
        for bundle in info.get("bundles", {}).values():
            for resource, amount in bundle.items():
                if resource in _SHOWN:
                    sums[resource] = sums.get(resource, 0.0) + amount
        for resource, amount in sums.items():
            held[resource] = held.get(resource, 0.0) + amount
        if sums:
            lines.append(f"placement group {info.get('name') or group_id[:12]!r}: {_fmt(sums)}")
    free, total = ray.available_resources(), ray.cluster_resources()
    rest = {r: total.get(r, 0.0) - free.get(r, 0.0) - held.get(r, 0.0) for r in _SHOWN}
    rest = {r: v for r, v in rest.items() if v > 1e-9}
    if rest:
        lines.append(f"tasks and actors outside placement groups: {_fmt(rest)}")
    return ". Held now: " + "; ".join(lines) if lines else ""


def _fmt(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items()) or "nothing"
