"""Each node's hardware (its own `jitllm hardware`, run there), and `NODE/DEVICE` entries of the -devices
grammar as devices of the remote backend (backend name `ray`)."""

from __future__ import annotations

import dataclasses

from jitllm.core.errors import JitllmError
from jitllm.runtime.cluster.connection import Cluster, Node, timeout
from jitllm.runtime.inventory import GpuDevice, Inventory

REMOTE_BACKEND = "ray"


@dataclasses.dataclass(frozen=True)
class RemoteSpec:
    """Where a remote device is: its node and its name there (`cpu`, `cuda:0`)."""

    node: Node
    local: str


def node_inventory(cluster: Cluster, node: Node) -> Inventory:
    """What `jitllm hardware` finds on `node`, detected there (once per process and node)."""
    cache = cluster.inventories
    if node.node_id not in cache:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from jitllm.runtime.inventory import detect_inventory

        task = ray.remote(num_cpus=0, max_retries=0)(detect_inventory).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))
        try:
            cache[node.node_id] = ray.get(task.remote(), timeout=timeout())
        except Exception as e:  # a dead node, a timeout, jitllm missing there: Ray's own error types
            raise JitllmError(f"node {node.label()}: cannot list its hardware: "
                              f"{(str(e).strip().splitlines() or [type(e).__name__])[-1]}") from None
    return cache[node.node_id]


def remote_specs(cluster: Cluster) -> dict[str, RemoteSpec]:
    """Every remote device named so far in this process: its canonical name (`node2/cpu`) -> where it is."""
    return cluster.remote


def remote_device(cluster: Cluster, spec: str, entry: str) -> GpuDevice:
    """The device `NODE/DEVICE` names (`node2/cpu`, `node2/cuda:0`, `node2/gpu:1`), with that node's memory."""
    from jitllm.runtime.device_spec import parse_devices

    node_text, _, local = spec.partition("/")
    node = cluster.node(node_text, entry)
    if not local.strip() or local.strip().lower() in ("auto", "all"):
        raise JitllmError(f"{entry}: name one device of node {node.name} (NODE/cpu, NODE/cuda:0, NODE/gpu:1)")
    inventory = node_inventory(cluster, node)
    position = cluster.nodes.index(node)
    if local.strip().lower() == "cpu":
        cpu = inventory.cpu
        found = GpuDevice(index=-3000 - 100 * position, backend=REMOTE_BACKEND, ordinal=0,
                          name=f"{node.name}: {cpu.model}", total_bytes=cpu.total_bytes, free_bytes=cpu.free_bytes,
                          spec=f"{node.name.lower()}/cpu")
        local = "cpu"
    else:
        try:
            (choice,) = parse_devices(local, inventory)
        except JitllmError as e:
            raise JitllmError(f"{entry}: on node {node.name}: {e}") from None
        gpu = choice.device
        found = dataclasses.replace(gpu, index=-3001 - 100 * position - max(gpu.index, 0), backend=REMOTE_BACKEND,
                                    spec=f"{node.name.lower()}/{gpu.spec_name}", name=f"{node.name}: {gpu.name}",
                                    unified=False)
        local = gpu.spec_name
    remote_specs(cluster)[found.spec_name.lower()] = RemoteSpec(node, local)
    return found
