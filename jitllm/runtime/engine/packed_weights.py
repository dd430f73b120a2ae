"""A unit's weights in one allocation per device, so loading or moving a block is one allocation and
one copy whatever the number of its tensors (a small block's move was mostly per-tensor costs).

The tensors the programs take are aliases into that allocation (Device.aliases: TVM's kernels reject
TVM's own views, which keep their offset in the DLTensor's byte_offset).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jitllm.runtime.backends.base import Layout, Tensor
from jitllm.runtime.device import Device

ALIGN = 256
"""Byte alignment of each tensor in the allocation (vector loads, and the CUDA allocator's own)."""

def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PackedWeights(list):
    """The unit's weight tensors, in its program's order, all aliases into `buffer` (one uint8
    allocation laid out by `layout`). Where the device keeps weights buffers for reuse (its
    `weight_pool`), the buffer and its aliases go back there when these weights are gone, and the next
    weights of the same size there take them (jitllm.runtime.backends.buffer_pool)."""

    def __init__(self, device: Device, buffer: Tensor, layout: Layout, views: list[Tensor] | None = None) -> None:
        """`layout`: (shape, dtype, byte offset) of each tensor, in the order the unit's program takes them;
        `views`: aliases of `buffer` already made for `layout` (a buffer from the pool), else made here.
        The buffer goes back to the device's weight pool, where it has one, when these weights are gone."""
        super().__init__(aliases(device, buffer, layout) if views is None else views)
        self.device, self.buffer, self.layout, self._pool = device, buffer, layout, device.weight_pool

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.give_back(self.buffer, self.layout, tuple(self))

    @classmethod
    def upload(cls, device: Device, groups: list[list[np.ndarray]]) -> "PackedWeights":
        """One tensor per group, its parts stacked along axis 0, each copied straight into its rows."""
        layout, end = pack_layout(groups)
        buffer, views = device.weights_buffer(end, layout)
        write_parts(device, buffer, groups, layout)
        return cls(device, buffer, layout, views)

    def to(self, device: Device, mark: Callable[[str], None] = lambda phase: None) -> "PackedWeights":
        """The same weights on `device`: one allocation (or a buffer its pool kept) and one copy of it
        (`mark` is called after the allocation, the copy and the aliases, for a move's phase clock)."""
        buffer, views = device.weights_buffer(int(self.buffer.shape[0]), self.layout)
        mark("weights alloc")
        device.copy_from(buffer, self.buffer, self.device)
        mark("weights copy")
        moved = PackedWeights(device, buffer, self.layout, views)
        mark("weights aliases")
        return moved


def pack_layout(groups: list[list[np.ndarray]]) -> tuple[Layout, int]:
    """The layout of one tensor per group (its parts stacked along axis 0), each aligned, and the bytes
    the allocation needs."""
    layout, end = [], 0
    for parts in groups:
        layout.append(((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), str(parts[0].dtype), end))
        end = _aligned(end + sum(p.nbytes for p in parts))
    return tuple(layout), max(end, ALIGN)


def part_offsets(groups: list[list[np.ndarray]], layout: Layout) -> list[tuple[np.ndarray, int]]:
    """Each part with its byte offset in an allocation laid out by `layout`."""
    out = []
    for parts, (_, _, at) in zip(groups, layout):
        for part in parts:
            out.append((part, at))
            at += part.nbytes
    return out


def write_parts(device: Device, buffer: Tensor, groups: list[list[np.ndarray]], layout: Layout) -> None:
    """Every part of `groups` copied into its rows of `buffer` (laid out by `layout`)."""
    for part, at in part_offsets(groups, layout):
        device.write(device.region(buffer, part.shape, str(part.dtype), at), part)


def aliases(device: Device, buffer: Tensor, layout: Layout) -> list[Tensor]:
    """The aliases a unit's program takes over its buffer (one place, so tests can count them)."""
    return device.aliases(buffer, layout)
