"""DLPack-level access to TVM tensors: their data pointers, and aliases with a byte offset folded in.

TVM's kernels reject a tensor whose DLTensor has a nonzero `byte_offset`, and TVM's own views keep
the offset there; an alias is a view whose exported DLPack tensor has the offset moved into its data
pointer, imported back as a tensor of its own (the import keeps the view, and so its memory, alive).
Half of an alias's cost was converting its shape and dtype for TVM (~4 of ~8 us here), so `aliases`
converts each layout's once.
"""

from __future__ import annotations

import ctypes
import functools

import tvm
import tvm_ffi


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def _dltensor(capsule: object) -> _DLTensor:
    return _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))


def data_pointer(tensor: tvm.runtime.Tensor) -> int:
    """Address of the tensor's first element (on its device)."""
    capsule = tensor._to_dlpack()  # alive while its DLTensor is read (the capsule owns it)
    dl = _dltensor(capsule)
    return dl.data + dl.byte_offset


def aliases(buffer: tvm.runtime.Tensor, layout: tuple[tuple[tuple[int, ...], str, int], ...]) -> list[tvm.runtime.Tensor]:
    """A tensor over `buffer`'s bytes for each (shape, dtype, offset) of `layout`, in order, each with
    byte_offset 0 (the offset in its data pointer)."""
    return [_alias(buffer, shape, dtype, offset) for shape, dtype, offset in _converted(layout)]


@functools.lru_cache(maxsize=64)  # a model has a few layouts (one per block kind and the head)
def _converted(layout: tuple) -> tuple:
    return tuple((tvm_ffi.Shape(shape), tvm_ffi.dtype(dtype), offset) for shape, dtype, offset in layout)


def _alias(buffer: tvm.runtime.Tensor, shape: tvm_ffi.Shape, dtype: tvm_ffi.dtype, offset: int) -> tvm.runtime.Tensor:
    capsule = buffer._create_view(shape, dtype, offset)._to_dlpack()
    dl = _dltensor(capsule)
    dl.data, dl.byte_offset = dl.data + dl.byte_offset, 0
    return tvm_ffi.from_dlpack(capsule)  # (takes the capsule; the view lives as long as the import)
