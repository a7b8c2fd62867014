"""The network between nodes in tiers, and the stragglers a step waits for.

Three tiers carry a collective's messages, by the group's span:

- NVLink, inside one node (:mod:`~pipedsl.simulator.collectives` prices it);
- the leaf tier, for a group within ``Cluster.leaf_nodes`` nodes (one scalable unit of a
  DGX SuperPOD: its nodes' adapters meet at the same leaf switches, rail by rail): the
  adapters' achieved bandwidth and ``inter_node_latency`` per message;
- the spine, for a group spanning more nodes: each message crosses two more switch
  levels (``spine_latency_s`` more) and shares the spine's links with the other groups
  doing the same (``spine_efficiency`` of the bandwidth).

A cluster without ``leaf_nodes`` is one flat network (every group at the leaf tier's
figures). Stragglers: a synchronous step ends when its slowest node does; with node step
times of coefficient of variation ``straggler_cv`` the expected slowest of N is about
``1 + straggler_cv·sqrt(2·ln N)`` times the mean (the expected maximum of N normal
draws), a loss that grows with the number of nodes (:func:`straggler_factor`). On a TPU
cluster the units are its slices (:func:`straggler_units`): a slice's chips move in lock
step over ICI, and the slices meet over DCN once per step.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pipedsl.simulator.hardware import Cluster

__all__ = ["Tier", "Link", "network_link", "straggler_factor", "straggler_units"]


class Tier(enum.Enum):
    """Which switches a group's messages cross."""

    NVLINK = "nvlink"
    LEAF = "leaf"
    SPINE = "spine"


@dataclass(frozen=True, slots=True)
class Link:
    """What one GPU gets between nodes at a tier: achieved bytes per second (its share of
    the node's adapters) and seconds per message."""

    tier: Tier
    bandwidth: float
    latency: float


def network_link(nodes: int, cluster: Cluster) -> Link:
    """The link of a group spanning ``nodes`` nodes (more than one)."""
    share, latency = cluster.network_share, cluster.inter_node_latency
    if cluster.leaf_nodes and nodes > cluster.leaf_nodes:
        return Link(Tier.SPINE, share * cluster.spine_efficiency, latency + cluster.spine_latency_s)
    return Link(Tier.LEAF, share, latency)


def straggler_units(gpus: int, cluster: Cluster) -> int:
    """The units whose step times vary apart and whose slowest a step waits for: the nodes
    of a GPU cluster; the slices of a TPU cluster (``Cluster.torus``), whose chips the ICI
    collectives of every layer keep in step with each other, while slices meet only where
    their data-parallel reduction crosses DCN."""
    if cluster.torus:
        return cluster.slices
    return -(-gpus // cluster.gpus_per_node)


def straggler_factor(nodes: int, cluster: Cluster) -> float:
    """How many times its priced seconds a step over ``nodes`` nodes (or slices:
    :func:`straggler_units`) takes, waiting for the slowest: ``1 + straggler_cv·sqrt(2·ln
    nodes)`` (1 for one)."""
    if nodes <= 1 or cluster.straggler_cv <= 0:
        return 1.0
    return 1.0 + cluster.straggler_cv * math.sqrt(2.0 * math.log(nodes))
