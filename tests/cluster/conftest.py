"""One local Ray cluster for the module that asks for it: a head node (this process drives it) and `node2`,
both real raylets on 127.0.0.1 with token authentication, one CPU and a small object store each, no
dashboard. Ray missing: a skip here, a failure under CI=true (setup_failed)."""

from __future__ import annotations

import os
import secrets

import pytest

ENV = {
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(16),
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # (loopback node addresses; read when ray is imported)
    "JITLLM_CLUSTER_TIMEOUT": "60",
}
NODE = dict(num_cpus=1, object_store_memory=80 << 20, node_ip_address="127.0.0.1")


@pytest.fixture(scope="module")
def ray_cluster(setup_failed):
    """(the cluster's address, the Cluster, node2's handle: remove_node(it) kills its raylet)."""
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        _restore(saved)
        setup_failed("ray is not installed (pip install 'jitllm[ray]')")
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**NODE, "node_name": "head", "include_dashboard": False})
        node2 = cluster.add_node(**NODE, node_name="node2")
    except Exception as e:  # Ray's own start-up errors
        _restore(saved)
        setup_failed(f"a local Ray cluster did not start: {e}")
    try:
        yield cluster.address, cluster, node2
    finally:
        from jitllm.runtime.backends import ray_remote
        from jitllm.runtime.cluster import connection

        ray_remote.reset()
        connection.reset()
        ray.shutdown()
        cluster.shutdown()
        _restore(saved)


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
