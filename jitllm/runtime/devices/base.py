"""A device as the executor sees it: a TVM device, the target that compiles for it, and its memory."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm

from jitllm.errors import JitllmError


@dataclass
class Device:
    """Where blocks run. `target` is a jitllm.lowering target object; `budget_bytes` None = unbounded."""

    name: str
    target: object
    tvm_device: tvm.runtime.Device
    budget_bytes: int | None = None
    used_bytes: int = 0
    fail_next_alloc: bool = field(default=False, repr=False)
    """Fault injection for tests: the next allocation raises as if the device were out of memory."""
    inject_fault: bool = field(default=False, repr=False)
    """Fault injection for tests: the next block run on this device fails as a kernel launch would."""

    def reserve(self, nbytes: int, what: str) -> None:
        """Charge `nbytes` to the budget or raise without charging anything."""
        if self.fail_next_alloc:
            self.fail_next_alloc = False
            raise JitllmError(f"{self.name}: allocation of {what} failed (injected fault)")
        if self.budget_bytes is not None and self.used_bytes + nbytes > self.budget_bytes:
            left = self.budget_bytes - self.used_bytes
            raise JitllmError(f"{self.name}: {what} needs {nbytes / 2**20:.1f} MiB, {left / 2**20:.1f} MiB left")
        self.used_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.used_bytes = max(0, self.used_bytes - nbytes)

    def upload(self, array: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.ascontiguousarray(array), self.tvm_device)

    def empty(self, shape: tuple[int, ...], dtype: str) -> tvm.runtime.Tensor:
        return tvm.runtime.empty(shape, dtype, self.tvm_device)

    def synchronize(self) -> None:
        self.tvm_device.sync()


def to_device(tensor: tvm.runtime.Tensor, device: Device) -> tvm.runtime.Tensor:
    """The same values on `device` (no copy when already there)."""
    if tensor.device == device.tvm_device:
        return tensor
    return tensor.copyto(device.tvm_device)
