"""The one place kernels convert between f32 and the KV pool's dtype (BlockKind.kv_type: f32 or f16).

Every kernel computes in f32: K and V enter the pool through `stored` (rounded to nearest even, as numpy's
and CUDA's f32 -> f16 conversions are) and leave it through `loaded` / `vload`. The llvm (kernels/cpu) and
CUDA (kernels/cuda) kernels take their pool buffers' dtype from `kind.kv_dtype`; the ONNX reference bodies
(jitllm.ir.ops) cast what they gather from the pool the same way.
"""

from __future__ import annotations

from tvm.script import tirx as T

F32 = "float32"


def _lanes(dtype: str, lanes: int) -> str:
    return dtype if lanes == 1 else f"{dtype}x{lanes}"


def stored(value, dtype: str):
    """An f32 expression (scalar or vector) as a pool of `dtype` holds it."""
    if dtype == F32:
        return value
    return T.Cast(_lanes(dtype, value.ty.dtype.lanes), value)


def loaded(value):
    """A pool element (or vector of them) as f32."""
    dtype = value.ty.dtype
    if str(dtype).startswith(F32):
        return value
    return T.Cast(_lanes(F32, dtype.lanes), value)


def vload(buffer, index, lanes: int):
    """`lanes` consecutive elements of `buffer` (a pool or an f32 tensor) from `index`, as an f32 vector."""
    return loaded(buffer.vload(index, _lanes(str(buffer.dtype), lanes)))
