"""The explicit table from a -devices choice's backend to the module that makes its Device."""

from __future__ import annotations

from jitllm.core.errors import JitllmError
from jitllm.runtime.device_spec import DeviceChoice
from jitllm.runtime.devices.base import Device


def make_device(choice: DeviceChoice, gpu_kernels: str = "fast") -> Device:
    backend = choice.device.backend
    if backend == "cuda":
        from jitllm.runtime.devices.cuda import cuda_device

        return cuda_device(choice, gpu_kernels)
    raise JitllmError(f"{choice.name}: running blocks on {backend} is not supported yet (cuda and the host are)")
