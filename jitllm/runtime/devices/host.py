"""The host CPU as a device (llvm target), and simulated devices backed by it for tests and demos."""

from __future__ import annotations

import tvm

from jitllm.lowering.targets.llvm import LlvmTarget
from jitllm.runtime.devices.base import Device

HOST = "host"


def host_device(kernels: str = "exact") -> Device:
    """The host CPU; `kernels` is the CPU kernel family ("exact" f32 activations, "fast" int8 activations,
    see jitllm/lowering/targets/llvm.py)."""
    return Device(HOST, LlvmTarget(kernels), tvm.cpu(0))


def simulated_device(name: str, budget_bytes: int | None = None) -> Device:
    """A device with its own memory accounting and page pool that computes on the host.

    It stands for a second device wherever the hardware is missing (migration and placement tests)."""
    return Device(name, LlvmTarget(), tvm.cpu(0), budget_bytes)
