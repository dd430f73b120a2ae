"""Float matrices -> GGML Q4_K, Q5_K and Q6_K bytes, for the types gguf.quants cannot quantize.

Plain round-to-nearest quantizers with llama.cpp's scale structure (not its search for the best scales,
make_qkx2_quants / make_qx_quants): good enough for random-weight models and tests, whose oracle is
gguf.quants.dequantize of these bytes. Q4_K/Q5_K: per 32-block a scale (max - min) / (2^bits - 1) and a
minimum -min(0, min), both as 6-bit multiples of the super-block's f16 d and dmin. Q6_K: per 16-block the
signed extreme maps to -32, its scale an int8 multiple of the super-block's d.
"""

from __future__ import annotations

import numpy as np

from jitllm.core.layouts import SUPER_BLOCK


def _nearest(a: np.ndarray) -> np.ndarray:
    return np.rint(a).astype(np.int32)


def _per_super(values: np.ndarray, top: float) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative sub-block values [.., 8] -> (their f16 unit per super-block, 6-bit multiples of it)."""
    unit = (values.max(-1) / top).astype(np.float16)
    u = unit.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.where(u > 0, _nearest(values / u), 0).clip(0, 63)
    return unit, steps.astype(np.uint8)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(sc, mn) [.., 8] 6-bit -> GGML's 12 bytes (inverse of ggml_repack._k_scales)."""
    return np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                           (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1).astype(np.uint8)


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)[..., None].view(np.uint8)


def _q4_5_k(x: np.ndarray, bits: int) -> np.ndarray:
    """x [blocks, 256] -> Q4_K (bits 4) or Q5_K (bits 5) blocks."""
    top = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    d, sc = _per_super((sub.max(-1) - low) / top, 63)
    dmin, mn = _per_super(-low, 63)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[..., None] > 0, _nearest((sub + offset[..., None]) / scale[..., None]), 0)
    q = q.clip(0, top).astype(np.uint8).reshape(-1, 4, 2, 32)  # 64 elements: low nibbles, then high
    qs = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128)
    head = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn)]
    if bits == 4:
        return np.concatenate([*head, qs], axis=-1)
    fifth = (q.reshape(-1, 8, 32) >> 4).astype(np.uint8)  # qh byte l, bit s: element 32 s + l
    qh = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    return np.concatenate([*head, qh, qs], axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    extreme = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]  # signed, [blocks, 16]
    scales = extreme / -32
    widest = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)  # [blocks, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(widest != 0, -128 / widest, 0)
        d = np.where(widest != 0, 1 / inv, 0)[:, 0].astype(np.float16)
        sc = _nearest(inv * scales).clip(-128, 127).astype(np.int8)
        scale = d.astype(np.float32)[:, None] * sc
        q = np.where(scale[..., None] != 0, _nearest(sub / scale[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [half, quarter, l]
    ql = ((q[:, :, :2] & 15) | ((q[:, :, 2:] & 15) << 4)).reshape(-1, 128)  # byte l: elements l, 64 + l
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1)


def quantize(wtype: str, w: np.ndarray) -> np.ndarray:
    """A float [n, k] matrix (k a multiple of 256) -> GGML blocks of `wtype`, uint8 [n, k / 256 * bytes]."""
    n, k = w.shape
    x = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, SUPER_BLOCK)
    blocks = {"q4_k": lambda: _q4_5_k(x, 4), "q5_k": lambda: _q4_5_k(x, 5), "q6_k": lambda: _q6_k(x)}[wtype]()
    return blocks.reshape(n, -1)
