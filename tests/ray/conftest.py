"""A local Ray cluster of two nodes on this machine, started once per test module.

The head has the custom resource ``node_a``, the second node ``node_b``; an actor asking for a
fraction of one of them is placed on that node. Object stores are small and CPUs few, so the
cluster fits a 2-core CI machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
STORE_BYTES = 200 * 1024 * 1024


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray.actor")  # not this folder, which a bare "ray" can name
    import ray
    from ray.cluster_utils import Cluster

    # Ray workers import the test actor classes by module name: every node's processes inherit
    # this environment when the cluster starts.
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), old_path) if p)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"node_a": 1},
            "object_store_memory": STORE_BYTES,
            "include_dashboard": False,
            # A node that stops answering is declared dead after ~1.5 s, not ~15 s.
            "_system_config": {
                "health_check_period_ms": 500,
                "health_check_failure_threshold": 3,
            },
        },
    )
    try:
        cluster.add_node(num_cpus=2, resources={"node_b": 1}, object_store_memory=STORE_BYTES)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
