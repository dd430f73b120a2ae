"""CUDA devices through TVM's CUDA runtime; artifacts are compiled for the device's own arch."""

from __future__ import annotations

import os

import tvm

from jitllm.errors import JitllmError
from jitllm.lowering.cuda import CudaTarget
from jitllm.runtime.devices.base import Device


def cuda_arch(ordinal: int) -> str:
    version = tvm.cuda(ordinal).compute_version  # e.g. "9.0"
    major, minor = version.split(".")
    return f"sm_{major}{minor}"


def cuda_device(choice) -> Device:
    from jitllm.lowering.cuda_runtime import ensure_cuda_runtime

    ensure_cuda_runtime(allow_stub=False)
    ordinal = choice.device.ordinal
    dev = tvm.cuda(ordinal)
    if not dev.exist:
        raise JitllmError(f"{choice.name}: no such CUDA device")
    device = Device(choice.name, CudaTarget(cuda_arch(ordinal)), dev, choice.budget_bytes)
    if os.environ.get("JITLLM_PINNED_HOST", "1") != "0":
        from jitllm.runtime.devices.pinned import pinned_pool

        device.host_allocator = pinned_pool(ordinal).tensor
    if os.environ.get("JITLLM_CUDA_GRAPHS", "1") != "0":
        from jitllm.runtime.devices.cuda_graph import CudaGraphRecorder

        device.graphs = CudaGraphRecorder(dev, choice.name)
    return device
