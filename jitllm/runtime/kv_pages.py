"""Paged KV: a pool of fixed-size pages per device; each (block, session) owns a list of page ids.

The bookkeeping (free list, page lists) is plain integers; the pool tensor
[num_pages, 2, kv_heads, page_size, head_dim] lives on the device and is only touched by kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm

from jitllm.errors import JitllmError
from jitllm.runtime.devices.base import Device


class PagePool:
    """Hands out, frees and reports page ids of one device's pool."""

    def __init__(self, device: Device, num_pages: int, kv_heads: int, page_size: int, head_dim: int) -> None:
        self.device = device
        self.page_size = page_size
        self.num_pages = num_pages
        self.page_bytes = 2 * kv_heads * page_size * head_dim * 4
        device.reserve(num_pages * self.page_bytes, f"KV pool of {num_pages} pages")
        self.pages = device.empty((num_pages, 2, kv_heads, page_size, head_dim), "float32")
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise JitllmError(f"{self.device.name}: out of KV pages ({count} wanted, {len(self._free)} free)")
        return [self._free.pop() for _ in range(count)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))

    def close(self) -> None:
        self.device.release(self.num_pages * self.page_bytes)
        self.pages = None


@dataclass
class PageTable:
    """The pages of one (block, session), in position order, and its int32 tensor for the kernels."""

    pool: PagePool
    ids: list[int] = field(default_factory=list)
    _tensor: tvm.runtime.Tensor | None = None

    def ensure(self, positions: int) -> None:
        """Own enough pages for `positions` positions."""
        need = -(-positions // self.pool.page_size) - len(self.ids)
        if need > 0:
            self.ids += self.pool.allocate(need)
            self._tensor = None

    def tensor(self) -> tvm.runtime.Tensor:
        if self._tensor is None:
            self._tensor = self.pool.device.upload(np.asarray([self.ids or [0]], np.int32))
        return self._tensor

    def release(self) -> None:
        self.pool.free(self.ids)
        self.ids = []
        self._tensor = None
