"""The Ray tier's shared fixtures: a four-node Ray cluster on this machine, one per module,
and the worlds the module's pipelines run on.

A head and three nodes, one CPU each, all on 127.0.0.1: every process of a world reserves
one CPU, so four processes land on four nodes, and a stage mesh of dp = 2 over two
processes spans two nodes. The cluster holds one world at a time: ``worlds(n, k)`` gives the
world of ``n`` processes of ``k`` devices, the same one to consecutive tests that ask for
that shape (pipelines run on it one after another, as a sweep over plans would), a new one
after another shape or a failure tore it down.
"""

from __future__ import annotations

import os

# The tests start the cluster themselves, so they keep it on loopback the way pipedsl keeps
# the local instances it starts; Ray reads the variable when it is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from collections.abc import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from helpers import RAY_CONFIG  # noqa: E402
from pipedsl.executor.ray.cluster import RayWorld, connect, disconnect  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A four-node cluster that this process is connected to, for one test module."""
    head = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(3):
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    connect(cluster.address)
    try:
        yield cluster
    finally:
        disconnect()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def worlds(cluster: Cluster) -> Iterator[Callable[[int, int], RayWorld]]:
    """``worlds(n, k)``: a world of ``n`` processes of ``k`` devices on the module's cluster
    (see the module docstring)."""
    current: list[RayWorld] = []

    def world(n: int, k: int) -> RayWorld:
        if current and not current[0].closed and (current[0].num_processes, current[0].devices_per_process) == (n, k):
            return current[0]
        for old in current:
            old.close()
        current[:] = [RayWorld.start(n, devices_per_process=k, config=RAY_CONFIG, label="tests")]
        return current[0]

    try:
        yield world
    finally:
        for old in current:
            old.close()
