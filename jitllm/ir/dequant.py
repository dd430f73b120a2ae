"""The reference dequantization of every weight type as standard ONNX ops (the body of each
`Linear_<wtype>` function, jitllm.ir.ops): parts in the layouts of core/layouts.py -> W [N, K] float32,
computed as core.quant.dequantize computes it, so ONNX Runtime checks the layouts independently of
the kernels."""

from __future__ import annotations

import numpy as np

from jitllm.core.layouts import HIGH_BITS, QUANT_BLOCK, ROW_GROUP, SUPER_BLOCK, high_bit_position
from jitllm.ir.graph import F32, GraphBuilder

R = ROW_GROUP
PER_SUPER = SUPER_BLOCK // QUANT_BLOCK


def dequantize(g: GraphBuilder, wtype: str, parts: list[str]) -> str:
    """Body of the dequantization: parts -> W [N, K] float32."""
    if wtype in ("f32", "f16"):
        w = g.op("Cast", parts[0], to=F32)
        return g.op("Flatten", g.op("Transpose", w, perm=[0, 2, 1]), axis=2)
    if wtype == "bf16":
        return g.op("Flatten", g.op("Transpose", _bf16(g, parts[0]), perm=[0, 2, 1]), axis=2)
    if wtype in HIGH_BITS or wtype == "q4_k":
        w = _wide(g, wtype, parts)
        return g.op("Flatten", g.op("Transpose", w, perm=[0, 3, 1, 2]), axis=2)
    if wtype == "q8_0":
        q = g.op("Cast", parts[0], to=F32)  # [G, NB, 32, R]
    else:
        lo = g.op("BitwiseAnd", parts[0], g.const(15, "uint8"))
        hi = g.op("BitShift", parts[0], g.const(4, "uint8"), direction="RIGHT")
        q = g.op("Cast", g.op("Concat", lo, hi, axis=2), to=F32)
        if wtype == "q4_0":
            q = g.op("Sub", q, g.const(8.0, "float32"))
    axis2 = g.const([2])
    d = g.op("Unsqueeze", g.op("Cast", parts[1], to=F32), axis2)
    w = g.op("Mul", q, d)
    if wtype == "q4_1":
        w = g.op("Add", w, g.op("Unsqueeze", g.op("Cast", parts[2], to=F32), axis2))
    return g.op("Flatten", g.op("Transpose", w, perm=[0, 3, 1, 2]), axis=2)


def _bf16(g: GraphBuilder, u: str) -> str:
    """uint16 bf16 bits u -> float32 without a bit cast (opset 18 has none): sign, exponent e and mantissa m
    give (-1)^sign * (m + 128 [e > 0]) * 2^(max(e, 1) - 134), exact for every finite value."""
    sign = g.op("Cast", g.op("BitShift", u, g.const(15, "uint16"), direction="RIGHT"), to=F32)
    exponent = g.op("BitwiseAnd", g.op("BitShift", u, g.const(7, "uint16"), direction="RIGHT"), g.const(255, "uint16"))
    e = g.op("Cast", exponent, to=F32)
    m = g.op("Cast", g.op("BitwiseAnd", u, g.const(127, "uint16")), to=F32)
    one = g.const(1.0, "float32")
    implicit = g.op("Mul", g.op("Cast", g.op("Greater", e, g.const(0.0, "float32")), to=F32), g.const(128.0, "float32"))
    power = g.op("Pow", g.const(2.0, "float32"), g.op("Sub", g.op("Max", e, one), g.const(134.0, "float32")))
    signed = g.op("Sub", one, g.op("Mul", sign, g.const(2.0, "float32")))
    return g.op("Mul", g.op("Mul", g.op("Add", m, implicit), power), signed)


def _q(g: GraphBuilder, qs: str, qh: str | None, bits: int) -> str:
    """The elements' unsigned integers q [G, NB, 32, R] as float32: nibbles, and the high bits above them."""
    lo = g.op("BitwiseAnd", qs, g.const(15, "uint8"))
    hi = g.op("BitShift", qs, g.const(4, "uint8"), direction="RIGHT")
    q = g.op("Concat", lo, hi, axis=2)
    if qh is not None:
        positions = np.array([high_bit_position(e, bits) for e in range(QUANT_BLOCK)])
        per_element = g.op("Gather", qh, g.const(positions[:, 0]), axis=2)  # [G, NB, 32, R]
        shift = g.const(positions[:, 1].reshape(1, 1, QUANT_BLOCK, 1), "uint8")
        high = g.op("BitwiseAnd", g.op("BitShift", per_element, shift, direction="RIGHT"),
                    g.const((1 << bits) - 1, "uint8"))
        q = g.op("BitwiseOr", q, g.op("BitShift", high, g.const(4, "uint8"), direction="LEFT"))
    return g.op("Cast", q, to=F32)


def _per_block(g: GraphBuilder, per_super: str, sub: str, count: int) -> str:
    """f16 per_super [G, NS, R] times the sub-block scales sub [G, NS*count, R] (int) -> f32 [G, NS*count, R]."""
    sub = g.op("Reshape", g.op("Cast", sub, to=F32), g.const([0, -1, count, R]))
    scaled = g.op("Mul", g.op("Unsqueeze", g.op("Cast", per_super, to=F32), g.const([2])), sub)
    return g.op("Reshape", scaled, g.const([0, -1, R]))


def _wide(g: GraphBuilder, wtype: str, parts: list[str]) -> str:
    """q5_0, q5_1, q4_k, q5_k, q6_k -> W [G, NB, 32, R]."""
    bits = HIGH_BITS.get(wtype, 0)
    qh = parts[1] if bits else None
    rest = parts[2:] if bits else parts[1:]
    q = _q(g, parts[0], qh, bits)
    axis2 = g.const([2])
    if wtype in ("q5_0", "q5_1"):
        d = g.op("Unsqueeze", g.op("Cast", rest[0], to=F32), axis2)
        if wtype == "q5_0":
            return g.op("Mul", d, g.op("Sub", q, g.const(16.0, "float32")))
        return g.op("Add", g.op("Mul", d, q), g.op("Unsqueeze", g.op("Cast", rest[1], to=F32), axis2))
    if wtype == "q6_k":
        sc, d = rest
        scale = g.op("Reshape", _per_block(g, d, g.op("Reshape", sc, g.const([0, -1, R])), 2 * PER_SUPER),
                     g.const([0, -1, 2, 1, R]))  # [G, NB, 2, 1, R]: per 16 elements
        halves = g.op("Reshape", g.op("Sub", q, g.const(32.0, "float32")), g.const([0, 0, 2, 16, R]))
        return g.op("Reshape", g.op("Mul", scale, halves), g.const([0, 0, QUANT_BLOCK, R]))
    sc, mn, d, dmin = rest
    scale = g.op("Unsqueeze", _per_block(g, d, sc, PER_SUPER), axis2)
    offset = g.op("Unsqueeze", _per_block(g, dmin, mn, PER_SUPER), axis2)
    return g.op("Sub", g.op("Mul", scale, q), offset)
