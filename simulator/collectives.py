"""Collectives priced as NCCL runs them: by algorithm, by the group's place in the nodes.

A communication group is ``ranks`` GPUs spread over ``nodes`` nodes with the same number
``k = ranks / nodes`` of members in each (:class:`Group`). Inside a node the members talk
over NVLink/NVSwitch at ``B_nv`` per GPU per direction. Between nodes each GPU reaches
the network through the node's adapters: every GPU of a node communicates at once in
training (each tensor-parallel rank runs its own data-parallel ring), so a GPU's share
is ``B_nic · nics_per_node / gpus_per_node``, and a group with k members per node moves
``k`` such shares across each node boundary (NCCL runs one ring or tree per adapter).

Algorithms, for ``S`` bytes (the whole buffer; ``n`` ranks, ``N`` nodes, ``α`` the
per-message latency of the slower link the algorithm crosses):

- ring all-reduce: ``2(n−1)·α + 2(n−1)/n · S / B_ring`` with ``B_ring = B_nv`` inside one
  node and ``min(B_nv, k · B_share)`` across nodes (the ring's inter-node hops carry the
  whole ring's traffic, k adapters' worth at a time);
- hierarchical all-reduce (NCCL's tree: reduce-scatter inside the node, all-reduce of
  each GPU's ``S/k`` slice across nodes on a double binary tree, all-gather inside the
  node): ``2(k−1)·α_nv + 2(k−1)/k · S / B_nv + 2·⌈log₂ N⌉·α_net + 2(N−1)/N · (S/k) / B_share``;
- all-gather and reduce-scatter: ring only, ``(n−1)·α + (n−1)/n · S / B_ring``;
- point-to-point: ``α + S / B`` on NVLink inside a node, at the GPU's adapter share
  between nodes.

Every collective over two ranks or more costs the cluster's ``collective_latency_s`` once
more, whatever its algorithm: its launch and the rendezvous of its ranks (0 in the GPU
presets; on devices that share a host's cores the rendezvous waits for each of them to be
scheduled, which ``pipedsl calibrate`` measures).

Between nodes, a group's bandwidth and latency are those of the network tier its span
reaches (:mod:`~pipedsl.simulator.network`: the leaf switches, or the spine beyond them).

:func:`all_reduce_seconds` takes the faster algorithm for the size, as NCCL's tuner
does: the tree's logarithmic latency wins for small buffers over many nodes, the ring's
pipelined intra-node part for large ones.

On a TPU cluster (``Cluster.torus``) a plan's groups are :class:`~pipedsl.simulator.torus.TorusGroup` s
(:func:`plan_group`), priced as rings per torus axis and DCN between slices
(:mod:`~pipedsl.simulator.torus`).
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

from pipedsl.simulator.hardware import Cluster
from pipedsl.simulator.network import network_link
from pipedsl.simulator.plan import Plan
from pipedsl.simulator.torus import (
    MESH_AXES,
    TorusGroup,
    mesh_sizes,
    torus_all_reduce_seconds,
    torus_gather_seconds,
    torus_group,
)

__all__ = [
    "Algorithm",
    "Group",
    "group_of",
    "plan_group",
    "ring_all_reduce_seconds",
    "ring_gather_seconds",
    "all_reduce_seconds",
    "all_reduce_choice",
    "gather_seconds",
    "send_seconds",
]


class Algorithm(enum.Enum):
    """How an all-reduce is run."""

    RING = "ring"
    HIERARCHICAL = "hierarchical"
    TORUS = "torus"


@dataclass(frozen=True, slots=True)
class Group:
    """A communication group: ``ranks`` GPUs in ``nodes`` nodes, at least ``per_node`` of
    them in each (the node with the fewest members carries the traffic on the fewest
    adapters, so it sets the pace)."""

    ranks: int
    nodes: int = 1
    per_node: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= self.ranks or not 1 <= self.per_node * self.nodes <= self.ranks:
            raise ValueError(f"a group of {self.ranks} ranks cannot have {self.per_node} in each of {self.nodes} nodes")

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1


def group_of(ranks: int, stride: int, cluster: Cluster) -> Group:
    """The group of ``ranks`` GPUs whose global ranks are ``0, stride, 2·stride, …``
    (ranks numbered node by node), as tensor-, data- and pipeline-parallel groups are."""
    return _group_of(ranks, stride, cluster.gpus_per_node)


def plan_group(plan: Plan, axes: tuple[str, ...], cluster: Cluster) -> Group | TorusGroup:
    """The group of one device's peers along the plan's mesh ``axes`` (consecutive names
    from ``pipeline``, ``data``, ``fsdp``, ``context``, ``tensor``): on a torus as the mesh lays out
    (:func:`~pipedsl.simulator.torus.torus_group`), else by rank (:func:`group_of`, ranks
    tensor-parallel innermost)."""
    if cluster.torus:
        return torus_group(plan, axes, cluster)
    sizes = mesh_sizes(plan)
    inner = MESH_AXES[MESH_AXES.index(axes[-1]) + 1 :]
    return group_of(math.prod(sizes[a] for a in axes), math.prod(sizes[a] for a in inner), cluster)


# A plan search asks for the same few groups tens of thousands of times.
@functools.lru_cache(maxsize=1024)
def _group_of(ranks: int, stride: int, node: int) -> Group:
    counts: dict[int, int] = {}
    for i in range(ranks):
        counts[i * stride // node] = counts.get(i * stride // node, 0) + 1
    return Group(ranks=ranks, nodes=len(counts), per_node=min(counts.values()))


def ring_all_reduce_seconds(num_bytes: float, ranks: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``ranks``: 2(n−1)·α + 2(n−1)/n · S/B seconds."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * num_bytes / bandwidth


def ring_gather_seconds(num_bytes: float, ranks: int, *, bandwidth: float, latency: float) -> float:
    """Ring all-gather or reduce-scatter of ``num_bytes`` (the whole, unsharded size) over
    ``ranks``: (n−1)·α + (n−1)/n · S/B seconds."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    return (ranks - 1) * latency + (ranks - 1) / ranks * num_bytes / bandwidth


def _nvlink(cluster: Cluster) -> tuple[float, float]:
    return cluster.link(inter_node=False)


def _ring_link(group: Group, cluster: Cluster) -> tuple[float, float]:
    """(bytes per second, seconds per message) of a ring over ``group``: between nodes at
    the tier its span reaches (:mod:`~pipedsl.simulator.network`)."""
    nv_bandwidth, nv_latency = _nvlink(cluster)
    if not group.spans_nodes:
        return nv_bandwidth, nv_latency
    net = network_link(group.nodes, cluster)
    return min(nv_bandwidth, group.per_node * net.bandwidth), net.latency


def _hierarchical_seconds(num_bytes: float, group: Group, cluster: Cluster) -> float:
    k, nodes = group.per_node, group.nodes
    nv_bandwidth, nv_latency = _nvlink(cluster)
    net = network_link(nodes, cluster)
    inside = 2 * ring_gather_seconds(num_bytes, k, bandwidth=nv_bandwidth, latency=nv_latency)
    across = 2 * math.ceil(math.log2(nodes)) * net.latency
    across += 2 * (nodes - 1) / nodes * (num_bytes / k) / net.bandwidth
    return inside + across


def all_reduce_choice(num_bytes: float, group: Group | TorusGroup, cluster: Cluster) -> tuple[Algorithm, float]:
    """(algorithm, seconds) of the faster all-reduce of ``num_bytes`` over ``group``."""
    if isinstance(group, TorusGroup):
        return Algorithm.TORUS, torus_all_reduce_seconds(num_bytes, group, cluster)
    if group.ranks <= 1 or num_bytes <= 0:
        return Algorithm.RING, 0.0
    bandwidth, latency = _ring_link(group, cluster)
    ring = ring_all_reduce_seconds(num_bytes, group.ranks, bandwidth=bandwidth, latency=latency)
    fixed = cluster.collective_latency_s
    if not group.spans_nodes:
        return Algorithm.RING, fixed + ring
    tree = _hierarchical_seconds(num_bytes, group, cluster)
    return (Algorithm.HIERARCHICAL, fixed + tree) if tree < ring else (Algorithm.RING, fixed + ring)


def all_reduce_seconds(num_bytes: float, group: Group | TorusGroup, cluster: Cluster) -> float:
    """Seconds of an all-reduce of ``num_bytes`` over ``group`` (see the module docstring)."""
    return all_reduce_choice(num_bytes, group, cluster)[1]


def gather_seconds(num_bytes: float, group: Group | TorusGroup, cluster: Cluster) -> float:
    """Seconds of a ring all-gather or reduce-scatter of ``num_bytes`` (the unsharded size)."""
    if isinstance(group, TorusGroup):
        return torus_gather_seconds(num_bytes, group, cluster)
    if group.ranks <= 1 or num_bytes <= 0:
        return 0.0
    bandwidth, latency = _ring_link(group, cluster)
    return cluster.collective_latency_s + ring_gather_seconds(
        num_bytes, group.ranks, bandwidth=bandwidth, latency=latency
    )


def send_seconds(num_bytes: float, cluster: Cluster, *, inter_node: bool) -> float:
    """Seconds of one point-to-point send of ``num_bytes``."""
    if inter_node:
        _, latency = cluster.link(inter_node=True)
        return latency + num_bytes / cluster.network_share
    bandwidth, latency = _nvlink(cluster)
    return latency + num_bytes / bandwidth
