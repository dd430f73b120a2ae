"""The host CPU as a device: TVM tensors in host memory, llvm artifacts."""

from __future__ import annotations

from collections.abc import Callable

import tvm

from jitllm.lowering.targets.llvm import LlvmTarget
from jitllm.runtime.backends.base import BackendCaps
from jitllm.runtime.backends.dlpack import data_pointer
from jitllm.runtime.backends.tvm_tensors import HOST_ALLOCATOR, TvmBackend
from jitllm.runtime.device import Device

HOST = "host"
CAPS = BackendCaps("tvm", unified_memory=True, memory_on_touch=True)


def pool_size() -> int:
    """The calling thread's TVM worker pool size (TVM starts the pool here if no kernel has yet: size it
    first, runtime/workers.py)."""
    return int(tvm.get_global_func("runtime.NumThreads")())


def host_device(kernels: str = "exact") -> Device:
    """The host CPU; `kernels` is the CPU kernel family ("exact" f32 activations, "fast" int8 activations,
    see jitllm/lowering/targets/llvm.py)."""
    return Device(HOST, TvmBackend("host", tvm.cpu(0), CAPS, HOST_ALLOCATOR), LlvmTarget(kernels))


def placed_by_address(place: Callable[[int, int], None]) -> Callable[[tvm.runtime.Tensor], None]:
    """A Device.place_weights for the host from a placement of (address, bytes) (runtime/numa.py)."""
    return lambda buffer: place(data_pointer(buffer), int(buffer.shape[0]))
