"""A unit's weights in one allocation per device, so loading or moving a block is one allocation and
one copy whatever the number of its tensors (a small block's move was mostly per-tensor costs).

The tensors the programs take are aliases into that allocation. TVM's kernels reject a tensor whose
DLTensor has a nonzero `byte_offset`, and TVM's own views keep the offset there; so each alias is a
view whose exported DLPack tensor has the offset moved into its data pointer, imported back as a
tensor of its own. The import keeps the view (and so the allocation) alive until the alias dies.
"""

from __future__ import annotations

import ctypes

import numpy as np
import tvm
import tvm_ffi

ALIGN = 256
"""Byte alignment of each tensor in the allocation (vector loads, and the CUDA allocator's own)."""

Layout = tuple[tuple[tuple[int, ...], str, int], ...]
"""(shape, dtype, byte offset) of each tensor, in the order the unit's program takes them."""


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


class _Exported:
    """A DLPack producer handing out one prepared capsule."""

    def __init__(self, capsule: object, device: tuple[int, int]) -> None:
        self.capsule, self.device = capsule, device

    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def alias(buffer: tvm.runtime.Tensor, shape: tuple[int, ...], dtype: str, offset: int) -> tvm.runtime.Tensor:
    """A tensor over `buffer`'s bytes from `offset`, with byte_offset 0 (the offset in its data pointer)."""
    capsule = buffer._create_view(shape, dtype, offset)._to_dlpack()
    dl = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    dl.data, dl.byte_offset = dl.data + dl.byte_offset, 0
    return tvm_ffi.from_dlpack(_Exported(capsule, (dl.device_type, dl.device_id)))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PackedWeights(list):
    """The unit's weight tensors, in its program's order, all aliases into `buffer` (one uint8
    allocation laid out by `layout`)."""

    def __init__(self, buffer: tvm.runtime.Tensor, layout: Layout) -> None:
        super().__init__(alias(buffer, shape, dtype, at) for shape, dtype, at in layout)
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

    def to(self, device) -> "PackedWeights":
        """The same weights on `device`: one allocation and one copy of it."""
        return PackedWeights(self.buffer.copyto(device.tvm_device), self.layout)
