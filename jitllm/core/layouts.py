"""Weight layouts: how each weight type of a linear layer [N, K] is stored as parts.

Rows are interleaved in groups of ROW_GROUP (R) so a kernel can vectorise over R output rows:
- f32 / f16:  w  [N/R, K, R]
- q8_0:       qs [N/R, K/32, 32, R] int8,  d [N/R, K/32, R] f16         value = d * q
- q4_0:       qs [N/R, K/32, 16, R] uint8, d [N/R, K/32, R] f16         value = d * (nibble - 8)
- q4_1:       qs [N/R, K/32, 16, R] uint8, d, m [N/R, K/32, R] f16      value = d * nibble + m
A q4 byte j of a 32-block holds element j in its low nibble and element j+16 in its high nibble (GGML order).
"""

from __future__ import annotations

ROW_GROUP = 8
"""Output rows interleaved in every weight layout (see docs/model-format.md): kernels vectorise over them."""

QUANT_BLOCK = 32
"""GGML quantization block length along the input dimension (Q4_0, Q4_1, Q8_0)."""

WEIGHT_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")


def weight_parts(wtype: str, n: int, k: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(part name, shape, numpy dtype name) of each stored part, in kernel argument order."""
    r, nb = ROW_GROUP, k // QUANT_BLOCK
    g = n // r
    if wtype == "f32":
        return [("w", (g, k, r), "float32")]
    if wtype == "f16":
        return [("w", (g, k, r), "float16")]
    if wtype == "q8_0":
        return [("qs", (g, nb, 32, r), "int8"), ("d", (g, nb, r), "float16")]
    if wtype == "q4_0":
        return [("qs", (g, nb, 16, r), "uint8"), ("d", (g, nb, r), "float16")]
    if wtype == "q4_1":
        return [("qs", (g, nb, 16, r), "uint8"), ("d", (g, nb, r), "float16"), ("m", (g, nb, r), "float16")]
    raise ValueError(f"unknown weight type {wtype!r}")


def check_linear_shape(name: str, wtype: str, n: int, k: int) -> str | None:
    """Why a [n, k] matrix of `wtype` cannot use these layouts, or None if it can."""
    if n % ROW_GROUP:
        return f"{name}: {n} output rows is not a multiple of {ROW_GROUP}"
    if wtype.startswith("q") and k % QUANT_BLOCK:
        return f"{name}: {k} inputs is not a multiple of {QUANT_BLOCK}"
    return None
