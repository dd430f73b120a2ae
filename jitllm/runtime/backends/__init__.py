"""The explicit registry of device backends: a -devices choice's backend name -> its module, which makes
its devices (`make_device`) and declares what they offer (`CAPS`; with `peer_copies`, `link_peers`
links its devices). The host is always there (backends/host.py)."""

from __future__ import annotations

from jitllm.core.errors import JitllmError
from jitllm.runtime.backends import cuda, fake, ort, ray_remote, wgpu
from jitllm.runtime.device import Device
from jitllm.runtime.device_spec import DeviceChoice

BACKENDS = {
    "cuda": cuda,
    "ort": ort,
    "sim": fake,
    "vulkan": wgpu,
    "metal": wgpu,
    "ray": ray_remote,
}


def make_device(choice: DeviceChoice, cpu_kernels: str = "fast", gpu_kernels: str = "fast") -> Device:
    """The Device of a -devices choice, in the CPU or GPU kernel family its backend runs."""
    backend = choice.device.backend
    if backend not in BACKENDS:
        raise JitllmError(f"{choice.name}: running blocks on {backend} is not supported yet "
                          f"({', '.join(BACKENDS)} and the host are)")
    return BACKENDS[backend].make_device(choice, cpu_kernels, gpu_kernels)


def link_peers(devices: list[Device]) -> list[tuple[str, str]] | None:
    """Direct copies between the devices of each backend that offers them, where two or more are in use;
    the (from, to) names linked, or None where no backend had two devices to link."""
    linked = None
    for name, module in BACKENDS.items():
        same = [d for d in devices if d.backend.name == name]
        if module.CAPS.peer_copies and len(same) >= 2:
            linked = (linked or []) + module.link_peers(same)
    return linked
