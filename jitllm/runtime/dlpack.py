"""DLPack-level access to TVM tensors: their data pointers, and aliases with a byte offset folded in.

TVM's kernels reject a tensor whose DLTensor has a nonzero `byte_offset`, and TVM's own views keep
the offset there; an alias is a view whose exported DLPack tensor has the offset moved into its data
pointer, imported back as a tensor of its own (the import keeps the view, and so its memory, alive).
"""

from __future__ import annotations

import ctypes

import tvm
import tvm_ffi


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


def _dltensor(capsule: object) -> _DLTensor:
    return _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))


def data_pointer(tensor: tvm.runtime.Tensor) -> int:
    """Address of the tensor's first element (on its device)."""
    capsule = tensor._to_dlpack()  # alive while its DLTensor is read (the capsule owns it)
    dl = _dltensor(capsule)
    return dl.data + dl.byte_offset


def alias(buffer: tvm.runtime.Tensor, shape: tuple[int, ...], dtype: str, offset: int) -> tvm.runtime.Tensor:
    """A tensor over `buffer`'s bytes from `offset`, with byte_offset 0 (the offset in its data pointer)."""
    capsule = buffer._create_view(shape, dtype, offset)._to_dlpack()
    dl = _dltensor(capsule)
    dl.data, dl.byte_offset = dl.data + dl.byte_offset, 0
    return tvm_ffi.from_dlpack(_Exported(capsule, (dl.device_type, dl.device_id)))
