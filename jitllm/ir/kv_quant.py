"""The byte layout of a KV pool row and the host's conversions between KV cache types (numpy).

A pool is [num_pages, 2, kv_heads, page_size, row] of the type's dtype (jitllm.ir.config.KV_DTYPES); a row
holds one position's head_dim values of one KV head. f32 and f16 rows are the values themselves. A q8_0 row
is llama.cpp's block_q8_0 over the head dim (blocks of 32 values, d = amax / 127 as f16, q = round(x / d),
rounded half away from zero), laid out for the kernels' vector loads: the head_dim int8 quants first, then
one f16 scale per block (head_dim / 32 of them, little-endian bytes), so a row is head_dim * 17 / 16 bytes.
The kernels (jitllm.lowering.kernels.kv_store) read and write this layout; the host converts pages between
pools of two types with `convert_pages` (moves, spill/resume).
"""

from __future__ import annotations

import numpy as np

from jitllm.core.errors import JitllmError

Q8_BLOCK = 32
"""Values per q8_0 block (llama.cpp's QK8_0)."""
QUANTIZED = ("q8_0",)


def row_width(kv_type: str, head_dim: int) -> int:
    """Elements of the pool's dtype in one row (one position of one KV head)."""
    if kv_type in QUANTIZED:
        return head_dim + 2 * (head_dim // Q8_BLOCK)
    return head_dim


def check_head_dim(kv_type: str, head_dim: int) -> None:
    """q8_0 blocks must tile the head dim."""
    if kv_type in QUANTIZED and head_dim % Q8_BLOCK:
        raise JitllmError(f"KV cache type {kv_type} needs a head dim that is a multiple of {Q8_BLOCK} "
                          f"(this model's is {head_dim}): use -ctk f16 or f32")


def _roundf(x: np.ndarray) -> np.ndarray:
    """C's roundf (half away from zero), as ggml's reference quantizer rounds."""
    a = np.abs(x)
    floored = np.floor(a)
    return np.sign(x) * (floored + np.floor(2 * (a - floored)))


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """f32 rows [..., head_dim] -> q8_0 rows [..., row_width] (int8)."""
    x = np.asarray(values, np.float32)
    head_dim = x.shape[-1]
    blocks = x.reshape(*x.shape[:-1], head_dim // Q8_BLOCK, Q8_BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    quants = _roundf(blocks * inv).astype(np.int8).reshape(x.shape)
    scales = d[..., 0].astype("<f2").view(np.int8)
    return np.concatenate([quants, scales], axis=-1)


def dequantize_q8_0(rows: np.ndarray) -> np.ndarray:
    """q8_0 rows [..., row_width] (int8) -> f32 rows [..., head_dim]."""
    width = rows.shape[-1]
    head_dim = width * Q8_BLOCK // (Q8_BLOCK + 2)
    quants = rows[..., :head_dim].astype(np.float32)
    scales = np.ascontiguousarray(rows[..., head_dim:]).view("<f2").astype(np.float32)
    blocks = quants.reshape(*rows.shape[:-1], head_dim // Q8_BLOCK, Q8_BLOCK) * scales[..., None]
    return blocks.reshape(*rows.shape[:-1], head_dim)


def to_f32(data: np.ndarray, kv_type: str) -> np.ndarray:
    """Pool contents of `kv_type` as f32 values [..., head_dim]."""
    return dequantize_q8_0(data) if kv_type in QUANTIZED else data.astype(np.float32, copy=False)


def from_f32(values: np.ndarray, kv_type: str, dtype: str) -> np.ndarray:
    """f32 values [..., head_dim] as a pool of `kv_type` (numpy dtype `dtype`) holds them."""
    return quantize_q8_0(values) if kv_type in QUANTIZED else values.astype(dtype, copy=False)


def convert_pages(data: np.ndarray, source: str, dest: str, dtype: str) -> np.ndarray:
    """Pages of KV type `source` as a pool of `dest` (numpy dtype `dtype`) holds them: rounded or widened
    between f32 and f16 as numpy's astype does, through f32 values to and from q8_0."""
    if source == dest:
        return data
    if source not in QUANTIZED and dest not in QUANTIZED:
        return data.astype(dtype)
    return from_f32(to_f32(data, source), dest, dtype)
