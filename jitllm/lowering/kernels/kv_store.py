"""The one place kernels convert between f32 and the KV pool's type (BlockKind.kv_type: f32, f16 or q8_0).

Every kernel computes in f32: K and V enter the pool through `stored` (f16: rounded to nearest even, as
numpy's and CUDA's f32 -> f16 conversions are) or, for q8_0, `store_q8_row` / `store_q8_element` (llama.cpp's
block_q8_0 over the head dim, laid out as jitllm.ir.kv_quant says: the row's int8 quants, then one f16 scale
per 32 values), and leave it through `load` / `vload` (`loaded` for an element already read from an f32 or f16
pool). The llvm (kernels/cpu) and CUDA (kernels/cuda) kernels take their pool buffers' dtype and row width
from `kind.kv_dtype` and `kind.kv_row`; the ONNX reference bodies (jitllm.ir.ops) decode what they gather
from the pool the same way.
"""

from __future__ import annotations

import functools

from tvm.script import tirx as T

from jitllm.ir.kv_quant import Q8_BLOCK

F32 = "float32"
Q8 = "int8"
"""The q8_0 pool's dtype (jitllm.ir.config.KV_DTYPES)."""


def _lanes(dtype: str, lanes: int) -> str:
    return dtype if lanes == 1 else f"{dtype}x{lanes}"


def stored(value, dtype: str):
    """An f32 expression (scalar or vector) as an f32 or f16 pool holds it."""
    if dtype == F32:
        return value
    return T.Cast(_lanes(dtype, value.ty.dtype.lanes), value)


def loaded(value):
    """An element (or vector of them) of an f32 or f16 pool as f32."""
    dtype = value.ty.dtype
    if str(dtype).startswith(F32):
        return value
    return T.Cast(_lanes(F32, dtype.lanes), value)


def _head_dim(pages) -> int:
    """The head dim of a q8_0 pool's rows (its row width less the scales' bytes)."""
    return int(pages.shape[-1]) * Q8_BLOCK // (Q8_BLOCK + 2)


def q8_scale(pages, index, block):
    """Block `block`'s scale (f16 bytes after the row's quants) of the q8_0 row at `index`[:-1], as f32."""
    at = _head_dim(pages) + 2 * block
    lo = T.Cast("uint16", T.Cast("uint8", pages[(*index[:-1], at)]))
    hi = T.Cast("uint16", T.Cast("uint8", pages[(*index[:-1], at + 1)]))
    return T.Cast(F32, T.reinterpret("float16", T.bitwise_or(T.shift_left(hi, T.uint16(8)), lo)))


def load(pages, index):
    """The pool element at `index` (its last coordinate a position in the head dim) as f32."""
    if str(pages.dtype) != Q8:
        return loaded(pages[tuple(index)])
    return T.Cast(F32, pages[tuple(index)]) * q8_scale(pages, index, index[-1] // Q8_BLOCK)


def vload(buffer, index, lanes: int):
    """`lanes` consecutive elements of `buffer` (a pool or an f32 tensor) from `index`, as an f32 vector
    (from a q8_0 pool: `lanes` a multiple of 32 from a block's start)."""
    if str(buffer.dtype) != Q8:
        return loaded(buffer.vload(index, _lanes(str(buffer.dtype), lanes)))
    quants = T.Cast(_lanes(F32, lanes), buffer.vload(index, _lanes(Q8, lanes)))
    first = index[-1] // Q8_BLOCK
    scales = [T.Broadcast(q8_scale(buffer, index, first + j), Q8_BLOCK) for j in range(lanes // Q8_BLOCK)]
    return quants * (scales[0] if len(scales) == 1 else T.Shuffle(scales, list(range(lanes))))


def _broadcast(value, lanes: int):
    return value if lanes == 1 else T.Broadcast(value, lanes)


def q8_delta(amax):
    """A block's scale d from its largest magnitude (f32, before its rounding to f16), as ggml's
    quantize_row_q8_0_ref: amax / 127."""
    return amax / T.float32(127)


def q8_quant(x, d):
    """f32 value(s) x as int8 quants of scale d: roundf(x / d) as ggml's reference computes it (x times
    1 / d, 0 where d is 0; rounded half away from zero)."""
    lanes = x.ty.dtype.lanes
    inv = _broadcast(T.Select(d == T.float32(0), T.float32(0), T.float32(1) / d), lanes)
    y = x * inv
    a = T.abs(y)
    whole = T.floor(a)
    rounded = whole + T.floor((a - whole) * _broadcast(T.float32(2), lanes))
    signed = T.Select(y < _broadcast(T.float32(0), lanes), T.float32(0) - rounded if lanes == 1
                      else _broadcast(T.float32(0), lanes) - rounded, rounded)
    return T.Cast(_lanes(Q8, lanes), signed)


def block_amax(value_of, args, e):
    """max |value_of(*args, d)| over the 32 positions d of the head-dim block holding position e: each
    thread of a GPU append computes its own block's (the values are a few loads each)."""
    start = e // Q8_BLOCK * Q8_BLOCK
    return functools.reduce(T.max, [T.abs(value_of(*args, start + j)) for j in range(Q8_BLOCK)])


def buffer_amax(buffer, lead, e):
    """block_amax over an f32 tensor's row buffer[*lead, :]."""
    return block_amax(lambda *index: buffer[index], tuple(lead), e)


def _hmax(v, lanes: int):
    """Largest lane of a float vector expression (halving maxima)."""
    while lanes > 1:
        half = lanes // 2
        v = T.max(T.Shuffle([v], list(range(half))), T.Shuffle([v], list(range(half, lanes))))
        lanes = half
    return v


@T.macro
def _store_scale(pages, page, two, h, slot, block, d, head_dim):
    """Block `block`'s scale d as f16 into its two bytes, in one 16-bit store of the f16 bits (the offset
    is even, as every row width and head dim is). Not two byte stores: nvcc 13.0's ptxas (sm_80, sm_90)
    compiles the store of a half's low byte (`(signed char)(bits & 255)` after `cvt.rn.f16.f32`, whatever
    integer steps come between) as F2I.U8.F16, the half's value truncated to an integer, so every scale
    below 1 lost its low byte on the GPU (docs/model-format.md)."""
    pages[page, two, h, slot, T.ramp(head_dim + 2 * block, 1, 2)] = T.reinterpret(_lanes(Q8, 2), T.Cast("float16", d))


def q8_row_store(head_dim: int):
    """A macro quantizing one f32 row src[i0, i1, i2, :] into the q8_0 row pages[page, two, h, slot]:
    per block of 32 a vector max, the scale and the quants (the llvm appends)."""
    V = _lanes(F32, Q8_BLOCK)

    @T.macro
    def store(pages, page, two, h, slot, src, i0, i1, i2):
        for blk in T.serial(head_dim // Q8_BLOCK):
            xs: T.let = src.vload([i0, i1, i2, blk * Q8_BLOCK], V)
            d: T.let = q8_delta(_hmax(T.abs(xs), Q8_BLOCK))
            pages[page, two, h, slot, T.ramp(blk * Q8_BLOCK, 1, Q8_BLOCK)] = q8_quant(xs, d)
            _store_scale(pages, page, two, h, slot, blk, d, head_dim)

    return store


@T.macro
def store_q8_element(pages, page, two, h, slot, e, x, amax, head_dim):
    """Position e of a q8_0 row from its f32 value x and its block's largest magnitude (block_amax): the
    quant, and the scale where e starts its block (a GPU append's thread per position)."""
    d: T.let = q8_delta(amax)
    pages[page, two, h, slot, e] = q8_quant(x, d)
    if e % Q8_BLOCK == 0:
        _store_scale(pages, page, two, h, slot, e // Q8_BLOCK, d, head_dim)
