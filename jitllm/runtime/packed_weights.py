"""A unit's weights in one allocation per device, so loading or moving a block is one allocation and
one copy whatever the number of its tensors (a small block's move was mostly per-tensor costs).

The tensors the programs take are aliases into that allocation (jitllm.runtime.dlpack.aliases: TVM's
kernels reject TVM's own views, which keep their offset in the DLTensor's byte_offset).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tvm

from jitllm.runtime.dlpack import aliases

ALIGN = 256
"""Byte alignment of each tensor in the allocation (vector loads, and the CUDA allocator's own)."""

Layout = tuple[tuple[tuple[int, ...], str, int], ...]
"""(shape, dtype, byte offset) of each tensor, in the order the unit's program takes them."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PackedWeights(list):
    """The unit's weight tensors, in its program's order, all aliases into `buffer` (one uint8
    allocation laid out by `layout`)."""

    def __init__(self, buffer: tvm.runtime.Tensor, layout: Layout) -> None:
        super().__init__(aliases(buffer, layout))
        self.buffer, self.layout = buffer, layout

    @classmethod
    def upload(cls, device, groups: list[list[np.ndarray]]) -> "PackedWeights":
        """One tensor per group, its parts stacked along axis 0, each copied straight into its rows."""
        layout, end = [], 0
        for parts in groups:
            layout.append(((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), str(parts[0].dtype), end))
            end = _aligned(end + sum(p.nbytes for p in parts))
        buffer = device.empty((max(end, ALIGN),), "uint8")
        for parts, (_, dtype, at) in zip(groups, layout):
            for part in parts:
                buffer._create_view(part.shape, dtype, at).copyfrom(np.ascontiguousarray(part))
                at += part.nbytes
        return cls(buffer, tuple(layout))

    def to(self, device, mark: Callable[[str], None] = lambda phase: None) -> "PackedWeights":
        """The same weights on `device`: one allocation and one copy of it (`mark` is called after the
        allocation, the copy and the aliases, for a move's phase clock)."""
        buffer = device.empty(self.buffer.shape, "uint8")
        mark("weights alloc")
        buffer.copyfrom(self.buffer)
        mark("weights copy")
        moved = PackedWeights(buffer, self.layout)
        mark("weights aliases")
        return moved
