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
times of coefficient of variation ``straggler_cv`` the slowest of N takes
``1 + straggler_cv·E[max of N]`` times the mean, E[max of N] the expected maximum of N
standard normal draws (:func:`expected_maximum`), a loss that grows with the number of nodes
(:func:`straggler_factor`).

On a TPU cluster of several slices (``Cluster.slices``) a slice's chips move in lock step
over ICI, and the slices meet wherever a layer's traffic crosses DCN between them: with the
data-parallel ranks across the slices, at each layer's gradient reduction, which XLA runs
layer by layer behind the backward (the MaxText runs' ``xla_tpu_enable_data_parallel_all_reduce_opt``
and ``xla_tpu_data_parallel_opt_different_sized_ops`` pipeline these DCN all-reduces across
the iterations of the scanned layers), so a step of L layers meets them L times, not once.
At each meeting the slices wait for the slowest of them: with a slice's time between two
meetings spread by ``slice_jitter_s`` seconds (a standard deviation in seconds, the same
whatever the layer's size, where ``straggler_cv`` is a fraction of the step), the step
takes ``L·slice_jitter_s·E[max of m]`` longer over m slices (:func:`slice_wait_s`). Its
size is fitted to the published runs; what makes the slices' times spread so is not
identified. The published multi-slice runs show its form: on v5e the slowdown from one
slice to m, per layer and per E[max of m], is 10-23 ms for models of 32 and of 64 layers
alike from 2 to 32 slices (data/README.md), where as a fraction of the step it is twice as
large for the 64-layer ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from statistics import NormalDist

from pipedsl.simulator.hardware import Cluster

__all__ = ["Tier", "Link", "network_link", "expected_maximum", "straggler_factor", "straggler_units", "slice_wait_s"]


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
    """The nodes whose step times vary apart and whose slowest a step waits for (a TPU
    cluster's slices wait for each other per layer instead: :func:`slice_wait_s`)."""
    return -(-gpus // cluster.gpus_per_node)


def expected_maximum(n: int) -> float:
    """The expected maximum of ``n`` standard normal draws (0 for one), by Blom's formula
    ``Φ⁻¹((n - 0.375) / (n + 0.25))``: 0.59 for two (0.56 exactly), 2.07 for 32, 4.5% above
    the exact value at two and within 0.5% of it from 16 to 10,000 (``sqrt(2·ln n)``, the
    bound for large n, is twice it at two and 13% above it at 2,048)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def straggler_factor(nodes: int, cluster: Cluster) -> float:
    """How many times its priced seconds a step over ``nodes`` nodes
    (:func:`straggler_units`) takes, waiting for the slowest: ``1 + straggler_cv·E[max of
    nodes]`` (1 for one)."""
    if nodes <= 1 or cluster.straggler_cv <= 0:
        return 1.0
    return 1.0 + cluster.straggler_cv * expected_maximum(nodes)


def slice_wait_s(meetings: int, cluster: Cluster) -> float:
    """Seconds a step of ``meetings`` meetings of the slices (the layers whose traffic
    crosses DCN between them) waits for the slowest slice: ``meetings·slice_jitter_s·E[max
    of slices]``; 0 in one slice."""
    return meetings * cluster.slice_jitter_s * expected_maximum(cluster.slices)
