"""The 5-bit, 6-bit and K-quant GGML types (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) between GGML's blocks and
jitllm's parts (core/layouts.py), row-major here (core/quant.py interleaves the rows).

GGML packs each type its own way; here every one becomes the same pieces: the elements' integer values q
split into a nibble array in Q4_0's order and the high bits (qh, `layouts.high_bit_position`), plus the
scales exactly as GGML stores them (6-bit K-quant scales unpacked to one byte each). Nothing is rounded,
so `dequantize_rows` gives what `gguf.quants.dequantize` gives for the original bytes, to the bit.
"""

from __future__ import annotations

import numpy as np

from jitllm.core.layouts import HIGH_BITS, QUANT_BLOCK, SUPER_BLOCK, high_bit_position

BLOCK_BYTES = {"q5_0": 22, "q5_1": 24, "q4_k": 144, "q5_k": 176, "q6_k": 210}
"""Bytes of one GGML block of each of layouts.WIDE_TYPES (32 inputs for q5_0/q5_1, 256 for the K-quants)."""
_OFFSET = {"q5_0": 16, "q6_k": 32}
"""What the unsigned q of a symmetric type is stored above zero (value = scale * (q - offset))."""


def _high_bit_map(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(qh byte, bit) of each element 0..31 of a 32-block."""
    pos = np.array([high_bit_position(e, bits) for e in range(QUANT_BLOCK)])
    return pos[:, 0], pos[:, 1].astype(np.uint8)


def split_q(q: np.ndarray, bits: int) -> dict[str, np.ndarray]:
    """q [n, NB*32] (values < 2^(4+bits)) -> qs [n, NB, 16] (and qh [n, NB, 4*bits] when bits > 0)."""
    n = q.shape[0]
    q = q.reshape(n, -1, QUANT_BLOCK)
    parts = {"qs": (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)}
    if bits:
        byte, bit = _high_bit_map(bits)
        qh = np.zeros((n, q.shape[1], 4 * bits), np.uint8)
        high = q >> 4
        for e in range(QUANT_BLOCK):  # 32 strided ORs: the bytes of different elements overlap
            qh[..., byte[e]] |= high[..., e] << bit[e]
        parts["qh"] = qh
    return parts


def join_q(rows: dict[str, np.ndarray], bits: int) -> np.ndarray:
    """Inverse of split_q: qs [n, NB, 16] and qh -> q [n, NB, 32] uint8."""
    qs = rows["qs"]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if bits:
        byte, bit = _high_bit_map(bits)
        high = (rows["qh"][..., byte] >> bit) & np.uint8((1 << bits) - 1)
        q |= high << np.uint8(4)
    return q


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a Q4_K/Q5_K super-block -> (sc, mn) [.., 8]: eight 6-bit scales and mins
    (GGML's get_scale_min_k4: bytes 0-3 and 4-7 hold the low six bits of sc[0:4] and mn[0:4] and, in
    their top two bits, bits 4-5 of sc[4:8] and mn[4:8]; bytes 8-11 the low nibbles of sc[4:8], mn[4:8])."""
    lo_sc, lo_mn, nib = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (nib & 15) | ((lo_sc >> 2) & 48)], axis=-1)
    mn = np.concatenate([lo_mn & 63, (nib >> 4) | ((lo_mn >> 2) & 48)], axis=-1)
    return sc, mn


def unpack(wtype: str, raw: np.ndarray, n: int, k: int) -> dict[str, np.ndarray]:
    """GGML bytes of a [n, k] matrix -> its parts, row-major ([n, ...]: layouts.weight_parts without the
    row interleave)."""
    per = QUANT_BLOCK if wtype in ("q5_0", "q5_1") else SUPER_BLOCK
    blocks = np.ascontiguousarray(raw).reshape(n, k // per, BLOCK_BYTES[wtype])
    bits = HIGH_BITS.get(wtype, 0)
    if wtype in ("q5_0", "q5_1"):
        at = 6 if wtype == "q5_0" else 8
        high = blocks[..., at - 4:at].copy().view(np.uint32)  # [n, NB, 1]: bit e = element e's fifth bit
        q = (np.concatenate([blocks[..., at:] & 15, blocks[..., at:] >> 4], axis=-1)
             | (((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4))
        parts = {**split_q(q.reshape(n, k), bits), "d": _f16(blocks, 0)}
        if wtype == "q5_1":
            parts["m"] = _f16(blocks, 2)
        return parts
    if wtype in ("q4_k", "q5_k"):
        qs = blocks[..., -128:].reshape(n, -1, 4, 1, 32)  # 64 elements per 32 bytes: low nibbles first
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, -1, SUPER_BLOCK)
        if wtype == "q5_k":  # qh byte l, bit s: fifth bit of element 32 s + l
            qh = blocks[..., 16:48][:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]
            q |= ((qh & 1) << 4).reshape(n, -1, SUPER_BLOCK)
        sc, mn = _k_scales(blocks[..., 4:16])
        return {**split_q(q.reshape(n, k), bits), "sc": sc.reshape(n, -1), "mn": mn.reshape(n, -1),
                "d": _f16(blocks, 0), "dmin": _f16(blocks, 2)}
    # q6_k: per half of 128 elements, ql byte l holds elements l (low nibble) and 64 + l (high nibble), qh
    # byte l their two high bits at 2 s for element 32 s + l
    ql = blocks[..., :128].reshape(n, -1, 2, 1, 64)
    low = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(n, -1, 2, 128)
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    q = low | ((qh & 3).reshape(n, -1, 2, 128) << 4)
    sc = blocks[..., 192:208].copy().view(np.int8)
    return {**split_q(q.reshape(n, k), bits), "sc": sc.reshape(n, -1, 2), "d": _f16(blocks, 208)}


def dequantize_rows(wtype: str, rows: dict[str, np.ndarray]) -> np.ndarray:
    """Parts of some rows ([n, ...]) -> float32 [n, k], with the operations of gguf.quants.dequantize."""
    q = join_q(rows, HIGH_BITS.get(wtype, 0))  # [n, NB, 32]
    n, nb = q.shape[:2]
    if wtype in ("q5_0", "q5_1"):
        d = rows["d"].astype(np.float32)[..., None]
        if wtype == "q5_0":
            return (d * (q.astype(np.float32) - np.float32(_OFFSET[wtype]))).reshape(n, -1)
        return (d * q.astype(np.float32) + rows["m"].astype(np.float32)[..., None]).reshape(n, -1)
    per_super = SUPER_BLOCK // QUANT_BLOCK
    d = np.repeat(rows["d"].astype(np.float32), per_super, axis=1)  # [n, NB]
    if wtype == "q6_k":
        scale = d[..., None] * rows["sc"].astype(np.float32)  # [n, NB, 2]: per 16 elements
        q = q.reshape(n, nb, 2, 16).astype(np.float32) - np.float32(_OFFSET[wtype])
        return (scale[..., None] * q).reshape(n, -1)
    scale = d * rows["sc"].astype(np.float32)
    offset = np.repeat(rows["dmin"].astype(np.float32), per_super, axis=1) * rows["mn"].astype(np.float32)
    return (scale[..., None] * q.astype(np.float32) - offset[..., None]).reshape(n, -1)
