"""`jitllm hardware`: list devices and the CPU."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from jitllm.commands.common import opt

if TYPE_CHECKING:
    from jitllm.runtime.inventory import Inventory


@click.command()
@opt("json", "as_json", is_flag=True, help="machine-readable output")
@opt("cluster", default=None, help="list every node of a Ray cluster (host:port or auto), each as NODE/...")
def hardware(as_json: bool, cluster: str | None) -> None:
    """List every device, each backend that reaches it, and the CPU (with -cluster: of every node)."""
    from jitllm.runtime.inventory import detect_inventory

    if cluster is not None:
        return _cluster_hardware(cluster, as_json)
    inventory = detect_inventory()
    if as_json:
        click.echo(json.dumps(inventory.to_dict(), indent=2))
    else:
        click.echo(render(inventory))


def _cluster_hardware(address: str, as_json: bool) -> None:
    """Each node's own listing (detected there), headed by its -devices prefix; the coordinator's first."""
    from jitllm.runtime.cluster.connection import connect
    from jitllm.runtime.cluster.nodes import node_inventory

    found = connect(address)
    listed = [(node, node_inventory(found, node)) for node in found.nodes]
    if as_json:
        click.echo(json.dumps([{"node": n.name, "node_id": n.node_id, "address": n.address,
                                "coordinator": n is found.local, "devices_prefix": f"{n.name.lower()}/",
                                **inv.to_dict()} for n, inv in listed], indent=2))
        return
    parts = []
    for node, inventory in listed:
        here = "  (this process: its devices need no prefix)" if node is found.local else ""
        names = ", ".join(f"{node.name.lower()}/{d}" for d in ["cpu", *(g.spec_name for g in inventory.gpus)])
        parts.append(f"node {node.label()}: -devices {names}{here}\n"
                     + "\n".join("  " + line for line in render(inventory).splitlines()))
    click.echo("\n".join(parts))


def render(inventory: Inventory) -> str:
    """The inventory as aligned plain text."""
    from jitllm.runtime.device_spec import format_bytes
    from jitllm.runtime.inventory import format_cpu_list

    lines = []
    if not inventory.gpus:
        lines.append("GPUs: none (a CPU machine: -devices auto runs on the CPU)")
    for gpu in inventory.gpus:
        also = [v.spec_name for v in inventory.other_backends if v.index == gpu.index]
        where = f"UUID {gpu.uuid}" if gpu.uuid else f"PCI {gpu.pci_bus}" if gpu.pci_bus else "no UUID"
        traits = [t for t, on in (("unified memory", gpu.unified), ("software", gpu.software)) if on]
        if gpu.speed:
            traits.append(f"~{gpu.speed:.0f} GB/s")
        if also:
            traits.append("also " + ", ".join(also))
        memory = (f"{format_bytes(gpu.total_bytes)} total, {format_bytes(gpu.free_bytes)} free"
                  if gpu.total_bytes else "memory unknown (give a budget: =BYTES)")
        lines.append(f"gpu:{gpu.index}  {gpu.spec_name:<9} {gpu.name}")
        lines.append(f"        {memory}; {where}" + (f"; {', '.join(traits)}" if traits else ""))
    cpu = inventory.cpu

    def cpus(ids: list[int]) -> str:
        return f"{len(ids)} ({format_cpu_list(ids)})" if ids else "none"

    numa = "; ".join(f"node{n}: {format_cpu_list(c)}" for n, c in cpu.numa_nodes.items())
    lines += [
        f"CPU: {cpu.model}",
        f"  performance cores      {cpus(cpu.performance_cores)}  <- one worker each",
        f"  hyperthread siblings   {cpus(cpu.hyperthread_siblings)}  (left alone)",
        f"  efficiency cores       {cpus(cpu.efficiency_cores)}  (left alone)",
        f"  NUMA nodes             {numa or 'not reported'}",
        f"  process CPU mask       {format_cpu_list(cpu.cpu_mask)}",
        f"  memory                 {format_bytes(cpu.total_bytes)} total, "
        f"{format_bytes(cpu.free_bytes)} available",
        f"  features               {' '.join(cpu.features) or 'none of note'}",
    ]
    return "\n".join(lines)
