"""Weights between GGML block formats, plain arrays and jitllm's row-interleaved part layouts (core/layouts.py)."""

from __future__ import annotations

import numpy as np

from jitllm.core import ggml_repack, kquant_encode
from jitllm.core.layouts import K_QUANTS, QUANT_BLOCK, ROW_GROUP, WIDE_TYPES, weight_parts

# GGML block layouts: (bytes per 32-block, byte offset of the quants, number of f16 scale fields)
_GGML_BLOCKS = {"q8_0": (34, 2, 1), "q4_0": (18, 2, 1), "q4_1": (20, 4, 2)}
REPACK_ROWS = 4096
"""Rows repacked at a time (bounds the temporary arrays of a large embedding's repack)."""


def _interleave(a: np.ndarray) -> np.ndarray:
    """[N, ...] -> [N/R, ..., R]: groups of R rows, row index innermost."""
    n = a.shape[0]
    grouped = a.reshape(n // ROW_GROUP, ROW_GROUP, *a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(grouped, 1, -1))


def _deinterleave(a: np.ndarray) -> np.ndarray:
    """Inverse of _interleave."""
    rows = np.moveaxis(a, -1, 1)
    return rows.reshape(a.shape[0] * ROW_GROUP, *a.shape[1:-1])


def parts_from_ggml(wtype: str, raw: np.ndarray, n: int, k: int) -> dict[str, np.ndarray]:
    """GGML bytes of a [n, k] matrix (rows of blocks; BF16: the 16-bit values) -> layout parts, without
    dequantizing."""
    if wtype == "bf16":
        return {"w": _interleave(np.ascontiguousarray(raw).view(np.uint16).reshape(n, k))}
    if wtype in WIDE_TYPES:
        raw = np.ascontiguousarray(raw).reshape(n, -1)
        chunks = [ggml_repack.unpack(wtype, raw[i:i + REPACK_ROWS], min(REPACK_ROWS, n - i), k)
                  for i in range(0, n, REPACK_ROWS)]
        return {name: _interleave(np.concatenate([c[name] for c in chunks])) for name in chunks[0]}
    block_bytes, q_off, n_scales = _GGML_BLOCKS[wtype]
    blocks = np.ascontiguousarray(raw).reshape(n, k // QUANT_BLOCK, block_bytes)
    scales = blocks[..., : 2 * n_scales].copy().view(np.float16)  # [n, nb, n_scales]
    qs = blocks[..., q_off:]
    if wtype == "q8_0":
        qs = qs.view(np.int8)
    parts = {"qs": _interleave(qs), "d": _interleave(scales[..., 0])}
    if wtype == "q4_1":
        parts["m"] = _interleave(scales[..., 1])
    return parts


def parts_from_float(wtype: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """A float [n, k] matrix -> layout parts of `wtype` (quantizing with gguf's reference quantizers, and
    with core/kquant_encode's for the K-quants, which gguf cannot quantize)."""
    n, k = w.shape
    if wtype in ("f32", "f16"):
        dtype = np.float32 if wtype == "f32" else np.float16
        return {"w": _interleave(w.astype(dtype))}
    w = np.ascontiguousarray(w, dtype=np.float32)
    if wtype in K_QUANTS:
        return parts_from_ggml(wtype, kquant_encode.quantize(wtype, w), n, k)
    import gguf

    return parts_from_ggml(wtype, gguf.quants.quantize(w, gguf.GGMLQuantizationType[wtype.upper()]), n, k)


def dequantize(wtype: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """Layout parts -> float32 [n, k]."""
    return _dequantize_rows(wtype, {name: _deinterleave(arr) for name, arr in parts.items()})


def dequantize_rows(wtype: str, parts: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """Only the given rows of the matrix, float32 [len(rows), k] (embedding lookups)."""
    group, lane = np.divmod(np.asarray(rows, dtype=np.int64), ROW_GROUP)
    return _dequantize_rows(wtype, {name: arr[group, ..., lane] for name, arr in parts.items()})


def _dequantize_rows(wtype: str, rows: dict[str, np.ndarray]) -> np.ndarray:
    if wtype in ("f32", "f16"):
        return rows["w"].astype(np.float32)
    if wtype == "bf16":
        return (rows["w"].astype(np.uint32) << 16).view(np.float32)
    if wtype in WIDE_TYPES:
        return ggml_repack.dequantize_rows(wtype, rows)
    d = rows["d"].astype(np.float32)[..., None]  # [n, nb, 1]
    qs = rows["qs"]
    if wtype == "q8_0":
        q = qs.astype(np.float32)
    else:
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
        if wtype == "q4_0":
            q -= 8.0
    w = q * d
    if wtype == "q4_1":
        w += rows["m"].astype(np.float32)[..., None]
    return w.reshape(w.shape[0], -1)


def check_parts(wtype: str, n: int, k: int, parts: dict[str, np.ndarray]) -> None:
    for name, shape, dtype in weight_parts(wtype, n, k):
        got = parts[name]
        assert got.shape == shape and got.dtype == np.dtype(dtype), (name, got.shape, shape, got.dtype, dtype)
