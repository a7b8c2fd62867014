"""The Ray tier's shared fixture: a four-node Ray cluster on this machine, one per module.

A head and three nodes, one CPU each, all on 127.0.0.1: every process of a world reserves
one CPU, so four processes land on four nodes, and a stage mesh of dp = 2 over two
processes spans two nodes.
"""

from __future__ import annotations

import os

# The tests start the cluster themselves, so they keep it on loopback the way pipedsl keeps
# the local instances it starts; Ray reads the variable when it is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from pipedsl.executor.ray_cluster import connect, disconnect  # noqa: E402


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
