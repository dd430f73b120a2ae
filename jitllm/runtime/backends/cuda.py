"""CUDA devices through TVM's CUDA runtime; artifacts are compiled for the device's own arch."""

from __future__ import annotations

import ctypes
import os

import tvm

from jitllm.core.errors import JitllmError
from jitllm.lowering.targets.cuda import CudaTarget
from jitllm.runtime.backends import cuda_driver
from jitllm.runtime.backends.base import BackendCaps
from jitllm.runtime.backends.buffer_pool import pool_from_env
from jitllm.runtime.backends.tvm_tensors import TvmBackend
from jitllm.runtime.device import Device

CAPS = BackendCaps("tvm", page_locked_host=True, peer_copies=True, captured_steps=True, async_copies=True)


class CudaBackend(TvmBackend):
    """TVM tensors on a CUDA device, with a copy queue beside its kernels (backends/cuda_copies.py)."""

    def copy_queue(self):
        from jitllm.runtime.backends.cuda_copies import CudaCopyQueue

        return CudaCopyQueue(self.tvm_device, f"cuda:{self.tvm_device.index}")


def cuda_arch(ordinal: int) -> str:
    version = tvm.cuda(ordinal).compute_version  # e.g. "9.0"
    major, minor = version.split(".")
    return f"sm_{major}{minor}"


def make_device(choice, cpu_kernels: str, gpu_kernels: str) -> Device:
    """The registry's constructor: a CUDA device in the GPU kernel family (jitllm.lowering.targets.cuda)."""
    return cuda_device(choice, gpu_kernels)


def cuda_device(choice, kernels: str = "fast") -> Device:
    """`kernels`: the CUDA kernel family (jitllm.lowering.targets.cuda.CudaTarget)."""
    from jitllm.lowering.targets.cuda_runtime import ensure_cuda_runtime

    ensure_cuda_runtime(allow_stub=False)
    ordinal = choice.device.ordinal
    dev = tvm.cuda(ordinal)
    if not dev.exist:
        raise JitllmError(f"{choice.name}: no such CUDA device")
    backend = CudaBackend("cuda", dev, CAPS)
    device = Device(choice.name, backend, CudaTarget(cuda_arch(ordinal), kernels), choice.budget_bytes)
    if os.environ.get("JITLLM_PINNED_HOST", "1") != "0":
        from jitllm.runtime.backends.pinned import pinned_pool

        device.host_allocator = pinned_pool(ordinal).tensor
    device.weight_pool = pool_from_env()  # weights that left the card, kept for the next to arrive
    if os.environ.get("JITLLM_CUDA_GRAPHS", "1") != "0":
        from jitllm.runtime.backends.cuda_graph import CudaGraphRecorder

        device.graphs = CudaGraphRecorder(dev, choice.name)
    return device


CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


def link_peers(devices: list[Device]) -> list[tuple[str, str]]:
    """Direct copies between every pair of these CUDA devices the driver lets reach each other (moves
    and seams between cards); the (from, to) device names now linked."""
    names = {device.backend.tvm_device.index: device.name for device in devices}
    return [(names[a], names[b]) for a, b in enable_peer_access(list(names))]


def enable_peer_access(ordinals: list[int]) -> list[tuple[int, int]]:
    """Let every pair of the given CUDA devices that can reach each other directly (NVLink or PCIe
    peer-to-peer) do so: TVM copies between two cards with cudaMemcpyPeer, which stages through host
    memory unless peer access is on. Returns the (from, to) pairs now enabled; a pair the driver
    refuses is left staged (copies still work, only slower)."""
    if len(ordinals) < 2:
        return []
    driver = cuda_driver.driver()
    handles = {ordinal: cuda_driver.primary_context(ordinal) for ordinal in ordinals}
    if None in handles.values():
        return []
    current = ctypes.c_void_p()
    driver.cuCtxGetCurrent(ctypes.byref(current))
    enabled = []
    try:
        for a in ordinals:
            for b in ordinals:
                can = ctypes.c_int()
                if a != b and driver.cuDeviceCanAccessPeer(ctypes.byref(can), handles[a][0], handles[b][0]) == 0 \
                        and can.value:
                    driver.cuCtxSetCurrent(handles[a][1])
                    if driver.cuCtxEnablePeerAccess(handles[b][1], 0) in (0, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                        enabled.append((a, b))
    finally:
        driver.cuCtxSetCurrent(current)
    return enabled

