"""A device as the executor sees it: a TVM device, the target that compiles for it, and its memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, TypeVar

import numpy as np
import tvm

from jitllm.core.errors import JitllmError
from jitllm.runtime.devices.buffer_pool import BufferPool

T = TypeVar("T")


@dataclass
class Device:
    """Where blocks run. `target` is a jitllm.lowering target object; `budget_bytes` None = unbounded."""

    name: str
    target: object
    tvm_device: tvm.runtime.Device
    budget_bytes: int | None = None
    """Weight budget (the planner's: -devices X=SIZE, -vram, or free memory less headroom)."""
    used_bytes: int = 0
    kv_budget_bytes: int | None = None
    """KV page pools live in the headroom the weight budget leaves; None = as much as allocation gives."""
    kv_bytes: int = 0
    graphs: object | None = field(default=None, repr=False)
    """A GraphRecorder (jitllm.runtime.step_graphs) where decode steps can be captured and replayed."""
    fail_next_alloc: bool = field(default=False, repr=False)
    """Fault injection for tests: the next allocation raises as if the device were out of memory."""
    inject_fault: bool = field(default=False, repr=False)
    """Fault injection for tests: the next block run on this device fails as a kernel launch would."""
    allocator: Callable[[tuple[int, ...], str], tvm.runtime.Tensor] | None = field(default=None, repr=False)
    """Where `empty` (weights, KV pools, step inputs) takes memory from, when not TVM's allocator: the
    host's page-locked pool while a CUDA device is in use (jitllm.runtime.devices.pinned)."""
    host_allocator: Callable[[tuple[int, ...], str], tvm.runtime.Tensor] | None = field(default=None, repr=False)
    """Host memory this device copies to and from fastest (CUDA: page-locked), for the host's `allocator`."""
    weight_pool: BufferPool | None = field(default=None, repr=False)
    """Where the weights buffers of units that left this device are kept for the next ones to arrive
    (jitllm.runtime.devices.buffer_pool): CUDA devices, and the host while its memory is page-locked."""

    def reserve(self, nbytes: int, what: str, kv: bool = False) -> None:
        """Charge `nbytes` of weights (or, with `kv`, of KV pages) to its budget, or raise charging nothing."""
        if self.fail_next_alloc:
            self.fail_next_alloc = False
            raise JitllmError(f"{self.name}: allocation of {what} failed (injected fault)")
        used, budget = (self.kv_bytes, self.kv_budget_bytes) if kv else (self.used_bytes, self.budget_bytes)
        if budget is not None and used + nbytes > budget:
            left = budget - used
            raise JitllmError(f"{self.name}: {what} needs {nbytes / 2**20:.1f} MiB, {left / 2**20:.1f} MiB left")
        if kv:
            self.kv_bytes += nbytes
        else:
            self.used_bytes += nbytes

    def release(self, nbytes: int, kv: bool = False) -> None:
        if kv:
            self.kv_bytes = max(0, self.kv_bytes - nbytes)
        else:
            self.used_bytes = max(0, self.used_bytes - nbytes)

    def upload(self, array: np.ndarray) -> tvm.runtime.Tensor:
        return self.with_room(lambda: tvm.runtime.tensor(np.ascontiguousarray(array), self.tvm_device))

    def empty(self, shape: tuple[int, ...], dtype: str) -> tvm.runtime.Tensor:
        if self.allocator is not None:
            return self.with_room(lambda: self.allocator(tuple(shape), dtype))
        return self.with_room(lambda: tvm.runtime.empty(shape, dtype, self.tvm_device))

    def weights_buffer(self, nbytes: int, layout: tuple) -> tuple[tvm.runtime.Tensor, list[tvm.runtime.Tensor] | None]:
        """A uint8 buffer of `nbytes` for a unit's weights laid out by `layout`: one the weight pool kept,
        with its aliases where they were made for that layout, else a new allocation (and None)."""
        if self.weight_pool is not None:
            kept = self.weight_pool.take(nbytes, layout)
            if kept is not None:
                return kept
        return self.empty((nbytes,), "uint8"), None

    def with_room(self, allocate: Callable[[], T]) -> T:
        """`allocate()`; where it fails while the weight pool keeps buffers, again once they are let go."""
        try:
            return allocate()
        except Exception:  # TVM reports a failed allocation as its own error types
            if self.weight_pool is None or not self.weight_pool.clear():
                raise
        return allocate()

    def synchronize(self) -> None:
        self.tvm_device.sync()


def to_device(tensor: tvm.runtime.Tensor, device: Device) -> tvm.runtime.Tensor:
    """The same values on `device` (no copy when already there)."""
    if tensor.device == device.tvm_device:
        return tensor
    return device.with_room(lambda: tensor.copyto(device.tvm_device))


def last_positions(hidden: tvm.runtime.Tensor) -> tvm.runtime.Tensor:
    """[B, 1, D]: each sequence's last row of a float32 [B, S, D] hidden state, copied on its own device
    (a prefill's whole hidden state never crosses to the host; kernels take no offset views)."""
    batch, seq, width = (int(v) for v in hidden.shape)
    out = tvm.runtime.empty((batch, 1, width), "float32", hidden.device)
    row = width * 4
    for b in range(batch):
        source = hidden._create_view((1, 1, width), "float32", (b * seq + seq - 1) * row)
        out._create_view((1, 1, width), "float32", b * row).copyfrom(source)
    return out
