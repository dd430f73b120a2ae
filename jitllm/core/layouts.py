"""Weight layouts: how each weight type of a linear layer [N, K] is stored as parts.

Rows are interleaved in groups of ROW_GROUP (R) so a kernel can vectorise over R output rows
(G = N/R groups, NB = K/32 blocks of 32 inputs, NS = K/256 super-blocks):
- f32 / f16:  w  [G, K, R]
- bf16:       w  [G, K, R] uint16 (the bf16 bits)                       value = float32(bits << 16)
- q8_0:       qs [G, NB, 32, R] int8,  d [G, NB, R] f16                 value = d * q
- q4_0:       qs [G, NB, 16, R] uint8, d [G, NB, R] f16                 value = d * (nibble - 8)
- q4_1:       qs [G, NB, 16, R] uint8, d, m [G, NB, R] f16              value = d * nibble + m
- q5_0:       qs, qh [G, NB, 4, R] uint8, d                             value = d * (q - 16)
- q5_1:       qs, qh, d, m                                              value = d * q + m
- q4_k:       qs, sc, mn [G, NB, R] uint8, d, dmin [G, NS, R] f16       value = (d * sc) * q - dmin * mn
- q5_k:       qs, qh, sc, mn, d, dmin                                   value = (d * sc) * q - dmin * mn
- q6_k:       qs, qh [G, NB, 8, R] uint8, sc [G, NB, 2, R] int8, d [G, NS, R] f16
                                                                        value = (d * sc) * (q - 32)
A qs byte j of a 32-block holds element j in its low nibble and element j+16 in its high nibble (GGML's
Q4_0 order; the K-quants are repacked into it). The 5- and 6-bit types keep each element's low four bits
there and its B = 1 or 2 high bits in qh (see `high_bit_position`); q = nibble | high << 4. K-quant
scales stay as GGML stores them (6-bit sc/mn per 32, or int8 sc per 16 for q6_k, times f16 d/dmin per
256), so the repack from GGML bytes is lossless.
"""

from __future__ import annotations

ROW_GROUP = 8
"""Output rows interleaved in every weight layout (see docs/model-format.md): kernels vectorise over them."""

QUANT_BLOCK = 32
"""GGML quantization block length along the input dimension (the legacy types; the K-quants' sub-block)."""

SUPER_BLOCK = 256
"""GGML K-quant super-block length along the input dimension (one d, dmin per super-block)."""

WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
FLOAT_TYPES = ("f32", "f16", "bf16")
K_QUANTS = ("q4_k", "q5_k", "q6_k")
WIDE_TYPES = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
"""The types whose elements are q = nibble | high bits << 4 with per-block scales and offsets (the 5- and
6-bit types and the K-quants): one repack (core/ggml_repack.py) and one kernel arithmetic for all."""
HIGH_BITS = {"q5_0": 1, "q5_1": 1, "q5_k": 1, "q6_k": 2}
"""High bits (above the nibble) of each element in the 5- and 6-bit types."""


def high_bit_position(e: int, bits: int) -> tuple[int, int]:
    """(qh byte, bit) holding the lowest of the `bits` high bits of element e (0..31) of a 32-block, per row.

    With c = (e % 16) // 4 and h = e // 16 (the low or high nibble), s = bits * (2c + h): byte e % 4 +
    4 * (s // 8), bit s % 8. So a qh byte holds the high bits of the elements that one 4-byte column of qs
    holds (elements 4c + i and 16 + 4c + i share byte i), which the AVX2 kernels read with one shift."""
    s = bits * (2 * (e % 16 // 4) + e // 16)
    return e % 4 + 4 * (s // 8), s % 8


def weight_parts(wtype: str, n: int, k: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(part name, shape, numpy dtype name) of each stored part, in kernel argument order."""
    r, nb, ns = ROW_GROUP, k // QUANT_BLOCK, k // SUPER_BLOCK
    g = n // r
    qs = ("qs", (g, nb, 16, r), "uint8")
    scale = ("d", (g, nb, r), "float16")
    if wtype in FLOAT_TYPES:
        return [("w", (g, k, r), {"f32": "float32", "f16": "float16", "bf16": "uint16"}[wtype])]
    if wtype == "q8_0":
        return [("qs", (g, nb, 32, r), "int8"), scale]
    if wtype == "q4_0":
        return [qs, scale]
    if wtype == "q4_1":
        return [qs, scale, ("m", (g, nb, r), "float16")]
    qh = [("qh", (g, nb, 4 * HIGH_BITS[wtype], r), "uint8")] if wtype in HIGH_BITS else []
    if wtype == "q5_0":
        return [qs, *qh, scale]
    if wtype == "q5_1":
        return [qs, *qh, scale, ("m", (g, nb, r), "float16")]
    if wtype in ("q4_k", "q5_k"):
        return [qs, *qh, ("sc", (g, nb, r), "uint8"), ("mn", (g, nb, r), "uint8"), ("d", (g, ns, r), "float16"),
                ("dmin", (g, ns, r), "float16")]
    if wtype == "q6_k":
        return [qs, *qh, ("sc", (g, nb, 2, r), "int8"), ("d", (g, ns, r), "float16")]
    raise ValueError(f"unknown weight type {wtype!r}")


def input_block(wtype: str) -> int:
    """How many inputs one quantization block of `wtype` spans (1 for float types)."""
    if wtype in FLOAT_TYPES:
        return 1
    return SUPER_BLOCK if wtype in K_QUANTS else QUANT_BLOCK


def check_linear_shape(name: str, wtype: str, n: int, k: int) -> str | None:
    """Why a [n, k] matrix of `wtype` cannot use these layouts, or None if it can."""
    if n % ROW_GROUP:
        return f"{name}: {n} output rows is not a multiple of {ROW_GROUP}"
    if k % input_block(wtype):
        return f"{name}: {k} inputs is not a multiple of {input_block(wtype)} ({wtype})"
    return None
