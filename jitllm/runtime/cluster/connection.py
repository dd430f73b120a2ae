"""Joining a running Ray cluster (`-cluster ADDRESS` or `auto`) with token authentication, and its nodes.

Ray is imported only here and in the remote backend (`pip install 'jitllm[ray]'`). The cluster's traffic
stays on the addresses its nodes were started with: where the user gives a loopback address, the driver
binds loopback too (Ray would otherwise advertise the machine's outward address, where nothing listens).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from dataclasses import dataclass, field

from jitllm.core.errors import JitllmError

TIMEOUT_ENV = "JITLLM_CLUSTER_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
"""Seconds any wait on another node may take (a step, a move's copy, an actor starting) before the node is
given up as failed."""

_REWRITTEN = ("127.0.0.1", "localhost", "::1")
"""Loopback addresses Ray replaces by the machine's outward one (unless told it runs on one machine)."""


def _loopback(host: str) -> bool:
    """A loopback address: every node of such a cluster is this machine, the driver's node IP is it too."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def timeout() -> float:
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise JitllmError(f"{TIMEOUT_ENV}={text!r}: give seconds, a positive number")
    return value


@dataclass(frozen=True)
class Node:
    """A live node of the cluster: `name` as `ray start --node-name` gave it (its id where none was)."""

    node_id: str
    name: str
    address: str
    resources: dict

    def label(self) -> str:
        return f"{self.name} ({self.address}, id {self.node_id[:8]})"


@dataclass
class Cluster:
    address: str
    nodes: list[Node]
    local: Node
    """The node this process (the coordinator) runs on."""
    inventories: dict = field(default_factory=dict)
    """Node id -> what `jitllm hardware` found there (jitllm.runtime.cluster.nodes)."""
    remote: dict = field(default_factory=dict)
    """Every remote device named so far: its canonical name (`node2/cpu`) -> a RemoteSpec."""

    def node(self, text: str, entry: str) -> Node:
        """The node named `text`: a node name, else a unique prefix of a node id."""
        key = text.strip()
        named = [n for n in self.nodes if n.name.lower() == key.lower()]
        if named:
            return named[0]
        by_id = [n for n in self.nodes if key and n.node_id.lower().startswith(key.lower())]
        if len(by_id) == 1:
            return by_id[0]
        names = ", ".join(n.name for n in self.nodes)
        if by_id:
            raise JitllmError(f"{entry}: node id prefix '{key}' matches {len(by_id)} nodes; give more of it")
        raise JitllmError(f"{entry}: no node '{key}' in the cluster at {self.address} (its nodes: {names})")


_connected: Cluster | None = None


def connect(address: str) -> Cluster:
    """The Ray cluster at `address` (`host:port`, or `auto` for the one this machine belongs to), joined
    once per process; a second address is refused."""
    global _connected
    if not address.strip() or not address.isprintable():
        raise JitllmError(f"-cluster {address!r}: give the cluster's host:port, or auto")
    address = address.strip()
    if _connected is not None:
        if address not in (_connected.address, "auto"):
            raise JitllmError(f"-cluster {address}: this process already joined the cluster at {_connected.address}")
        return _connected
    mode = os.environ.setdefault("RAY_AUTH_MODE", "token")
    if mode != "token":
        raise JitllmError(f"RAY_AUTH_MODE={mode}: jitllm joins only clusters with token authentication "
                          f"(RAY_AUTH_MODE=token on every node; docs/cluster.md)")
    host = address.rpartition(":")[0].strip("[]") if address != "auto" else ""
    if host in _REWRITTEN and "ray" not in sys.modules:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # (read when ray is imported: loopback node IPs)
    if address != "auto":
        _reachable(address)
    try:
        import ray
    except ImportError:
        raise JitllmError("-cluster needs Ray: pip install 'jitllm[ray]'") from None
    kwargs = {"_node_ip_address": "127.0.0.1" if host == "localhost" else host} if _loopback(host) else {}
    try:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, logging_level="ERROR", **kwargs)
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, ValueError... for a cluster it cannot join
        raise JitllmError(f"-cluster {address}: cannot join the Ray cluster: {_first_line(e)} (a token that is not "
                          f"the cluster's is refused so: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)") from None
    _connected = Cluster(address, [], None)  # type: ignore[arg-type]
    refresh(_connected)
    return _connected


def _reachable(address: str) -> None:
    """The cluster's GCS port answers within the timeout (Ray itself retries for minutes)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise JitllmError(f"-cluster {address}: give the cluster's host:port (the head's --port), or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout(), 10.0)).close()
    except OSError as e:
        raise JitllmError(f"-cluster {address}: nothing answers there ({e.strerror or e})") from None


def refresh(cluster: Cluster) -> None:
    """The cluster's live nodes, read again (and which of them this process runs on)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    cluster.nodes = sorted((Node(n["NodeID"], n.get("NodeName") or n["NodeID"], n["NodeManagerAddress"],
                                 dict(n.get("Resources", {})))
                            for n in ray.nodes() if n.get("Alive")), key=lambda n: (n.node_id != here, n.name))
    cluster.local = next(n for n in cluster.nodes if n.node_id == here)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def reset() -> None:
    """Forget the cluster joined (after ray.shutdown: a test's cluster is gone)."""
    global _connected
    _connected = None
