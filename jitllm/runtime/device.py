"""A device as the engine sees it: a backend (memory, copies, loading artifacts), the target that
compiles for it, and its memory budgets. The engine reaches tensors only through these methods."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.config import BlockKind
from jitllm.lowering.target import Target
from jitllm.runtime.backends.base import Backend, Layout, Tensor
from jitllm.runtime.program import Program

T = TypeVar("T")


@dataclass(eq=False)
class Device:
    """Where blocks run. `budget_bytes` None = unbounded."""

    name: str
    backend: Backend
    target: Target
    budget_bytes: int | None = None
    """Weight budget (the planner's: -devices X=SIZE, -vram, or free memory less headroom)."""
    used_bytes: int = 0
    kv_budget_bytes: int | None = None
    """KV page pools live in the headroom the weight budget leaves; None = as much as allocation gives."""
    kv_bytes: int = 0
    graphs: object | None = field(default=None, repr=False)
    """A GraphRecorder (jitllm.runtime.engine.step_graphs) where decode steps are captured and replayed."""
    allocator: Callable[[tuple[int, ...], str], Tensor] | None = field(default=None, repr=False)
    """Where `empty` (weights, KV pools, step inputs) takes memory from, when not the backend's own: the
    host's page-locked pool while a CUDA device is in use (backends/pinned.py)."""
    host_allocator: Callable[[tuple[int, ...], str], Tensor] | None = field(default=None, repr=False)
    """Host memory this device copies to and from fastest (CUDA: page-locked), for the host's `allocator`."""
    weight_pool: object | None = field(default=None, repr=False)
    """Where the weights buffers of units that left this device are kept for the next ones to arrive
    (backends/buffer_pool.py): CUDA devices, and the host while its memory is page-locked."""
    place_weights: Callable[[Tensor], None] | None = field(default=None, repr=False)
    """Applied to each new weights buffer before its weights are written (the host's NUMA interleaving:
    runtime/numa.py); None: where the allocator put it."""
    twins: list["Device"] = field(default_factory=list, repr=False)
    """The other views of its card (one card through two APIs, `cuda:0,vulkan:0`): their weights and KV
    are charged to the same budgets as this device's (DeviceChoice.shares_budget_of)."""

    @property
    def memory_on_touch(self) -> bool:
        """Its new allocations take memory only as they are written (BackendCaps.memory_on_touch), no
        allocator of other memory (the page-locked host pool, which locks it all at once) standing in."""
        return self.backend.caps.memory_on_touch and self.allocator is None

    def room(self, kv: bool = False) -> int | None:
        """Bytes its weight budget (or, with `kv`, its KV budget) has left, its twins' use counted; None:
        unbounded."""
        budget = self.kv_budget_bytes if kv else self.budget_bytes
        if budget is None:
            return None
        return budget - sum(d.kv_bytes if kv else d.used_bytes for d in (self, *self.twins))

    def reserve(self, nbytes: int, what: str, kv: bool = False, leaving: int = 0) -> None:
        """Charge `nbytes` of weights (or, with `kv`, of KV pages) to its budget, or raise charging nothing.
        `leaving`: bytes of the same budget that this charge replaces once done (a unit moving between two
        views of one card: the card holds both copies only while the move runs, within its headroom)."""
        left = self.room(kv)
        if left is not None and nbytes - leaving > left:
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

    # -- tensors ----------------------------------------------------------------------------------
    def upload(self, array: np.ndarray) -> Tensor:
        return self.with_room(lambda: self.backend.upload(array))

    def empty(self, shape: tuple[int, ...], dtype: str) -> Tensor:
        if self.allocator is not None:
            return self.with_room(lambda: self.allocator(tuple(shape), dtype))
        return self.with_room(lambda: self.backend.empty(tuple(shape), dtype))

    def download(self, tensor: Tensor) -> np.ndarray:
        return self.backend.download(tensor)

    def write(self, tensor: Tensor, array: np.ndarray) -> None:
        self.backend.write(tensor, array)

    def region(self, buffer: Tensor, shape: tuple[int, ...], dtype: str, offset: int) -> Tensor:
        return self.backend.region(buffer, shape, dtype, offset)

    def aliases(self, buffer: Tensor, layout: Layout) -> list[Tensor]:
        return self.backend.aliases(buffer, layout)

    def copy_from(self, dst: Tensor, src: Tensor, source: "Device") -> None:
        """`src` (a tensor of `source`) into `dst` (one of this device): directly between backends of one
        tensor family, through the host between others."""
        if source.backend.caps.tensors == self.backend.caps.tensors:
            self.backend.copy(dst, src)
        else:
            self.backend.write(dst, source.backend.download(src))

    def receive(self, tensor: Tensor, source: "Device") -> Tensor:
        """The same values on this device (no copy when they already are)."""
        if source is self:
            return tensor
        if source.backend.caps.tensors == self.backend.caps.tensors:
            return self.with_room(lambda: self.backend.receive(tensor))
        return self.upload(source.backend.download(tensor))

    def last_rows(self, hidden: Tensor) -> Tensor:
        return self.backend.last_rows(hidden)

    def weights_buffer(self, nbytes: int, layout: tuple) -> tuple[Tensor, list[Tensor] | None]:
        """A uint8 buffer of `nbytes` for a unit's weights laid out by `layout`: one the weight pool kept,
        with its aliases where they were made for that layout, else a new allocation (and None)."""
        if self.weight_pool is not None:
            kept = self.weight_pool.take(nbytes, layout)
            if kept is not None:
                return kept
        buffer = self.empty((nbytes,), "uint8")
        if self.place_weights is not None:
            self.place_weights(buffer)
        return buffer, None

    def with_room(self, allocate: Callable[[], T]) -> T:
        """`allocate()`; where it fails while the weight pool keeps buffers, again once they are let go."""
        try:
            return allocate()
        except Exception:  # backends report a failed allocation as their own error types
            if self.weight_pool is None or not self.weight_pool.clear():
                raise
        return allocate()

    def load(self, path: Path, kind: BlockKind, page_kernels: bool) -> Program:
        return self.backend.load(path, kind, page_kernels)

    def synchronize(self) -> None:
        self.backend.synchronize()
