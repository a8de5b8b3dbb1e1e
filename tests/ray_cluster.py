"""A real multi-node Ray cluster on this machine for the tests: a head and one worker node, 1 CPU each.

The `ray_cluster` fixture (tests/conftest.py) starts one per test session; importing this
module skips the importing test module when the ray extra is not installed.

`ray.cluster_utils.Cluster` starts each node as its own raylet, so removing one kills
its actors for real. (Ray listens on this machine's own address, not on loopback: it
replaces 127.0.0.1 with a reachable address by design, and its nodes fail to find each
other when forced onto loopback.) Health checks are fast, so a removed node is noticed in seconds.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from ray.cluster_utils import Cluster  # noqa: E402

from blackjack_rl.cluster import NAMESPACE  # noqa: E402

NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024**2}
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 4}


@contextlib.contextmanager
def running_cluster() -> Iterator[Cluster]:
    """A head and one worker node on 127.0.0.1, and this process connected to it (the `ray_cluster` fixture)."""
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False,
                                                            "_system_config": FAST_HEALTH})
    try:
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
