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
def hardware(as_json: bool) -> None:
    """List every device, each backend that reaches it, and the CPU."""
    from jitllm.runtime.inventory import detect_inventory

    inventory = detect_inventory()
    if as_json:
        click.echo(json.dumps(inventory.to_dict(), indent=2))
    else:
        click.echo(render(inventory))


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
