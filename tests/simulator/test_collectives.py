"""Collectives against closed forms worked by hand (simulator/collectives.py).

The cluster: 8 GPUs per node on NVLink at 100 GB/s (1 µs per message), one 10 GB/s
adapter per GPU (5 µs per message), every efficiency 1. A GPU's network share is
8 × 10 / 8 = 10 GB/s; with four adapters per node it is 4 × 10 / 8 = 5 GB/s.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipedsl.simulator.collectives import (
    Algorithm,
    Group,
    all_reduce_choice,
    all_reduce_seconds,
    gather_seconds,
    group_of,
    ring_all_reduce_seconds,
    ring_gather_seconds,
    send_seconds,
)
from pipedsl.simulator.hardware import Cluster, DescriptionError

NET = Cluster(
    name="net",
    gpu="test",
    peak_flops=100e12,
    matmul_efficiency=1.0,
    memory_bytes=2**30,
    hbm_bandwidth=1e12,
    gpus_per_node=8,
    intra_node_bandwidth=100e9,
    intra_node_latency=1e-6,
    inter_node_bandwidth=10e9,
    inter_node_latency=5e-6,
)
FOUR_NICS = dataclasses.replace(NET, nics_per_node=4)
GB = 1e9


def test_ring_formulas() -> None:
    # 2(n-1)α + 2(n-1)/n · S/B and (n-1)α + (n-1)/n · S/B.
    assert ring_all_reduce_seconds(GB, 8, bandwidth=100e9, latency=1e-5) == pytest.approx(14e-5 + 0.0175)
    assert ring_gather_seconds(GB, 8, bandwidth=100e9, latency=1e-5) == pytest.approx(7e-5 + 0.00875)
    assert ring_all_reduce_seconds(GB, 1, bandwidth=100e9, latency=1e-5) == 0.0


def test_groups_by_stride() -> None:
    assert group_of(8, 1, NET) == Group(ranks=8, nodes=1, per_node=8)  # tp 8: one node
    assert group_of(16, 2, NET) == Group(ranks=16, nodes=4, per_node=4)  # dp 16 over tp 2
    assert group_of(32, 8, NET) == Group(ranks=32, nodes=32, per_node=1)  # dp 32 over tp 8
    assert group_of(12, 1, NET) == Group(ranks=12, nodes=2, per_node=4)  # 8 + 4: the 4 set the pace
    with pytest.raises(ValueError, match="cannot have"):
        Group(ranks=4, nodes=2, per_node=4)


def test_ring_inside_a_node_runs_on_nvlink() -> None:
    group = group_of(8, 1, NET)
    assert all_reduce_choice(GB, group, NET) == (Algorithm.RING, pytest.approx(14e-6 + 2 * 7 / 8 * GB / 100e9))
    assert gather_seconds(GB, group, NET) == pytest.approx(7e-6 + 7 / 8 * GB / 100e9)


def test_ring_across_nodes_uses_one_adapter_share_per_member() -> None:
    # 16 ranks, 4 in each of 4 nodes: the ring crosses each node boundary on 4 adapters.
    group = group_of(16, 2, NET)
    ring = 2 * 15 * 5e-6 + 2 * 15 / 16 * GB / (4 * 10e9)
    hierarchical = 2 * (3 * 1e-6 + 3 / 4 * GB / 100e9) + 2 * 2 * 5e-6 + 2 * 3 / 4 * (GB / 4) / 10e9
    assert ring < hierarchical
    assert all_reduce_choice(GB, group, NET) == (Algorithm.RING, pytest.approx(ring))
    # Four adapters for eight GPUs halve each GPU's share; then the hierarchical scheme,
    # which sends only (N-1)/N of each GPU's quarter across nodes, is faster.
    ring = 2 * 15 * 5e-6 + 2 * 15 / 16 * GB / 20e9
    hierarchical = 2 * (3 * 1e-6 + 3 / 4 * GB / 100e9) + 2 * 2 * 5e-6 + 2 * 3 / 4 * (GB / 4) / 5e9
    assert hierarchical < ring
    assert all_reduce_choice(GB, group, FOUR_NICS) == (Algorithm.HIERARCHICAL, pytest.approx(hierarchical))
    assert gather_seconds(GB, group, NET) == pytest.approx(15 * 5e-6 + 15 / 16 * GB / 40e9)


def test_ring_is_capped_by_nvlink() -> None:
    # 8 members per node would move 80 GB/s across nodes; with 16 adapters per node 160,
    # above NVLink's 100, so NVLink sets the pace.
    wide = dataclasses.replace(NET, nics_per_node=16)
    group = group_of(16, 1, wide)
    assert all_reduce_choice(GB, group, wide)[0] is Algorithm.RING
    assert all_reduce_seconds(GB, group, wide) == pytest.approx(2 * 15 * 5e-6 + 2 * 15 / 16 * GB / 100e9)


def test_hierarchical_wins_for_small_buffers_over_many_nodes() -> None:
    group = group_of(512, 1, NET)  # 64 nodes of 8
    size = 1e6
    ring = 2 * 511 * 5e-6 + 2 * 511 / 512 * size / 80e9
    hierarchical = 2 * (7 * 1e-6 + 7 / 8 * size / 100e9) + 2 * 6 * 5e-6 + 2 * 63 / 64 * (size / 8) / 10e9
    assert hierarchical < ring
    assert all_reduce_choice(size, group, NET) == (Algorithm.HIERARCHICAL, pytest.approx(hierarchical))


def test_point_to_point() -> None:
    assert send_seconds(GB, NET, inter_node=False) == pytest.approx(1e-6 + GB / 100e9)
    assert send_seconds(GB, NET, inter_node=True) == pytest.approx(5e-6 + GB / 10e9)
    assert send_seconds(GB, FOUR_NICS, inter_node=True) == pytest.approx(5e-6 + GB / 5e9)


def test_cluster_checks_nics() -> None:
    with pytest.raises(DescriptionError, match="nics_per_node must be >= 1"):
        dataclasses.replace(NET, nics_per_node=0)
    assert NET.adapters_per_node == 8 and FOUR_NICS.adapters_per_node == 4
    assert FOUR_NICS.network_share == pytest.approx(5e9)


def test_every_collective_pays_its_fixed_cost_once_whatever_its_algorithm() -> None:
    fixed = dataclasses.replace(NET, collective_latency_s=3e-4)
    size = 1 << 20
    inside, across = Group(ranks=4), Group(ranks=32, nodes=4, per_node=8)
    for group in (inside, across, Group(ranks=2)):
        assert gather_seconds(size, group, fixed) == pytest.approx(gather_seconds(size, group, NET) + 3e-4)
    # Small over many nodes: the tree wins either way, and pays it once, not per message.
    assert all_reduce_choice(4096, across, fixed) == (
        Algorithm.HIERARCHICAL,
        pytest.approx(all_reduce_seconds(4096, across, NET) + 3e-4),
    )
    assert all_reduce_seconds(size, inside, fixed) == pytest.approx(all_reduce_seconds(size, inside, NET) + 3e-4)
    # One rank, or nothing to move: no collective runs; a send is not a collective.
    assert all_reduce_seconds(size, Group(ranks=1), fixed) == gather_seconds(size, Group(ranks=1), fixed) == 0.0
    assert gather_seconds(0, inside, fixed) == 0.0
    assert send_seconds(size, fixed, inter_node=False) == send_seconds(size, NET, inter_node=False)
