"""TIR arithmetic of the 5-bit, 6-bit and K-quant weight formats (q5_0, q5_1, q4_k, q5_k, q6_k; layouts in
core/layouts.py), and of bf16 weights, shared by every target's kernels.

A 32-block of a row is q = nibble | high << 4 (q5: one high bit, q6_k: two, q4_k: none) times a scale plus
an offset; only where scale and offset come from differs:
- q5_0: d and -16 d;  q5_1: d and m;  q4_k / q5_k: d * sc and -dmin * mn (d, dmin per 256 inputs);
- q6_k: per half block h (16 elements, the low or the high nibbles) d * sc[h] and -32 d * sc[h].
The functions take buffers or TE tensors and indices that may be PrimExprs or T.ramp vectors (the 8 rows
of a row group at once), so CPU and GPU kernels, TE compute definitions and gathers share them.
"""

from __future__ import annotations

import tvm
from tvm import te
from tvm.script import tirx as T

from jitllm.core.layouts import FLOAT_TYPES, HIGH_BITS, QUANT_BLOCK, ROW_GROUP, SUPER_BLOCK, weight_parts

R = ROW_GROUP
PER_SUPER = SUPER_BLOCK // QUANT_BLOCK
UNION = (("qs", "qs"), ("qh", "qh"), ("sc", "sc"), ("mn", "mn"), ("d", "d"), ("d2", "dmin"))
"""(kernel parameter, part) of the union of the wide formats' parts, in kernel argument order: a kernel is
written once over all six and drops the absent ones (without_params); d2 is q5_1's m or the K-quants' dmin."""


def union_buffers(wtype: str, G: int, K: int) -> tuple:
    """(shape, dtype) of each UNION parameter in order (a placeholder where absent), then the absent ones."""
    parts = {name: (shape, dtype) for name, shape, dtype in weight_parts(wtype, G * R, K)}
    if "m" in parts:
        parts["dmin"] = parts.pop("m")
    return (*[parts.get(part, ((1,), "uint8")) for _, part in UNION],
            {param for param, part in UNION if part not in parts})


def union_parts(wtype: str, parts: list) -> tuple:
    """A format's parts (buffers or TE tensors, in layouts.weight_parts order) as the UNION tuple
    (qs, qh, sc, mn, d, d2), None where absent."""
    names = [name for name, _, _ in weight_parts(wtype, R, SUPER_BLOCK)]
    by_name = dict(zip(["dmin" if n == "m" else n for n in names], parts))
    return tuple(by_name.get(part) for _, part in UNION)


def without_params(func: tvm.tirx.PrimFunc, unused: set[str]) -> tvm.tirx.PrimFunc:
    """`func` without the named parameters: a kernel written once for every variant takes the union
    of their inputs, and each variant drops those its body never reads."""
    return tvm.tirx.PrimFunc([p for p in func.params if p.name not in unused], func.body, func.ret_type,
                             func.attrs)


def to_f32(v):
    """A scalar or vector value (or a TE tensor element) as float32 (as many lanes)."""
    if isinstance(v, te.TensorSlice):
        v = v.asobject()
    lanes = tvm.DataType(str(v.ty)).lanes
    return T.Cast("float32" if lanes == 1 else f"float32x{lanes}", v)


FLOAT_STORAGE = {"f32": "float32", "f16": "float16", "bf16": "uint16"}
"""The dtype float weights are stored in (layouts.weight_parts)."""


def float_weight(wtype: str, w):
    """A float-type weight (f32, f16, or bf16 stored as its uint16 bits) as float32."""
    if wtype == "bf16":
        return T.reinterpret("float32", T.shift_left(T.Cast("uint32", w), T.uint32(16)))
    return T.Cast("float32", w)


def high_bit_slot(j, h, bits: int):
    """(qh byte, bit) of the high bits of element 16 h + j of a block (layouts.high_bit_position); the byte
    is the same for both halves."""
    s = bits * (2 * (j // 4) + h)
    return j % 4 + 4 * (s // 8), s % 8


def assemble_q(byte, high_byte, h, bit, bits: int):
    """q (uint8) from the qs byte holding it (nibble h) and, where `bits`, the qh byte holding its high
    bits at `bit`."""
    nibble = T.bitwise_and(T.shift_right(byte, T.Cast("uint8", 4 * h)), T.uint8(15))
    if not bits:
        return nibble
    high = T.bitwise_and(T.shift_right(high_byte, T.Cast("uint8", bit)), T.uint8((1 << bits) - 1))
    return T.bitwise_or(nibble, T.shift_left(high, T.uint8(4)))


def q_value(qs, qh, g, b, j, r, h, bits: int):
    """q of element 16 h + j of block b (uint8), row r."""
    byte, bit = high_bit_slot(j, h, bits)
    return assemble_q(qs[g, b, j, r], qh[g, b, byte, r] if bits else None, h, bit, bits)


def block_scale(wtype: str, sc, d, g, b, r, h):
    """The scale of block b (q6_k: of its half h), row r."""
    if wtype in ("q5_0", "q5_1"):
        return to_f32(d[g, b, r])
    if wtype == "q6_k":
        return to_f32(d[g, b // PER_SUPER, r]) * to_f32(sc[g, b, h, r])
    return to_f32(d[g, b // PER_SUPER, r]) * to_f32(sc[g, b, r])


def block_offset(wtype: str, sc, mn, d, d2, g, b, r, h):
    """What a weight of block b (q6_k: of its half h) adds to scale * q, row r."""
    if wtype == "q5_0":
        return T.float32(-16) * to_f32(d[g, b, r])
    if wtype == "q5_1":
        return to_f32(d2[g, b, r])
    if wtype == "q6_k":
        return T.float32(-32) * block_scale(wtype, sc, d, g, b, r, h)
    return T.float32(0) - to_f32(d2[g, b // PER_SUPER, r]) * to_f32(mn[g, b, r])


def weight_value(wtype: str, ws: tuple, g, r, col):
    """Weight `col` of row r of row group g, float32, from the UNION parts ws = (qs, qh, sc, mn, d, d2)."""
    qs, qh, sc, mn, d, d2 = ws
    b, h, j = col // QUANT_BLOCK, col % QUANT_BLOCK // 16, col % 16
    q = to_f32(q_value(qs, qh, g, b, j, r, h, HIGH_BITS.get(wtype, 0)))
    return block_scale(wtype, sc, d, g, b, r, h) * q + block_offset(wtype, sc, mn, d, d2, g, b, r, h)


WEIGHT_PARAMS = ("w", "qs", "qh", "sc", "mn", "d", "d2")
"""The union of every layout's parts (d2: q4_1/q5_1's m, the K-quants' dmin), in the argument order of a
kernel written once for every weight type (the routed-experts kernels)."""


def expert_buffers(wtype: str, n: int, k: int) -> tuple[list[tuple[tuple[int, ...], str]], set[str]]:
    """(shape, dtype) of each WEIGHT_PARAMS entry for an [n, k] `wtype` matrix (a placeholder where
    absent), and the absent ones."""
    parts = {("d2" if name in ("m", "dmin") else name): (shape, dtype)
             for name, shape, dtype in weight_parts(wtype, n, k)}
    return [parts.get(p, ((1,), "uint8")) for p in WEIGHT_PARAMS], {p for p in WEIGHT_PARAMS if p not in parts}


def weight_at(wtype: str, w, qs, qh, sc, mn, d, d2, g, col, r):
    """Weight `col` of row r of row group g, float32, from the buffers of WEIGHT_PARAMS (any weight type)."""
    if wtype in FLOAT_TYPES:
        return float_weight(wtype, w[g, col, r])
    b, j = col // QUANT_BLOCK, col % QUANT_BLOCK
    if wtype == "q8_0":
        return to_f32(d[g, b, r]) * T.Cast("float32", qs[g, b, j, r])
    if wtype in ("q4_0", "q4_1"):
        q = T.Cast("float32", assemble_q(qs[g, b, j % 16, r], None, j // 16, 0, 0))
        if wtype == "q4_0":
            return to_f32(d[g, b, r]) * (q - T.float32(8))
        return to_f32(d[g, b, r]) * q + to_f32(d2[g, b, r])
    return weight_value(wtype, (qs, qh, sc, mn, d, d2), g, r, col)
