"""CPU kernels for the 5-bit, 6-bit and K-quant weight types (q5_0, q5_1, q4_k, q5_k, q6_k), in the two
families of kernels/cpu/linear.py, reading the layouts of core/layouts.py.

Per 32-block (kernels/formats.py: q, scale and offset), y += scale_lo * sum(q x over the low half) +
scale_hi * (the high half) + offset * sum(x); the halves' scales differ only for q6_k.

- exact: f32 activations; per (block, half) the q * x sums accumulate in f32 over 8 rows at once.
- fast (AVX2): the activations quantized to int8 per 32-block (kernels/cpu/avx2.py, as for q4_0/q4_1);
  the high bits are moved onto the shuffled nibbles with one shift and mask per 32 bytes (the qh layout
  holds the high bits of qs's 4-byte columns in one byte, layouts.high_bit_position), and `vpmaddubsw`
  sums q * x exactly: 16-bit sums over at most 30 480 (q4_k: 8 products of 15 * 127 pairs), 31 496
  (q5: 4 of 31 * 127) and 32 004 (q6_k: 2 of 63 * 127) before they are widened to 32 bits.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import HIGH_BITS, K_QUANTS, QUANT_BLOCK, ROW_GROUP, WIDE_TYPES, weight_parts
from jitllm.lowering.kernels.cpu.avx2 import PREFETCH_BYTES, W_SHUFFLE, avx2_driver, maddubs, prefetch, widen_halves
from jitllm.lowering.kernels.formats import (
    PER_SUPER,
    block_offset,
    block_scale,
    q_value,
    to_f32,
    union_buffers,
    without_params,
)

R = ROW_GROUP


def linear_wide_kernel(wtype: str, G: int, K: int, fast: bool) -> tvm.tirx.PrimFunc:
    """x [M, K/32, 32], the parts of `wtype`, y [M, G, R]; `fast`: the AVX2 kernel (kernels/cpu/avx2.py)."""
    if wtype not in WIDE_TYPES:
        raise ValueError(f"{wtype} is not one of {', '.join(WIDE_TYPES)}")
    body = _fast(wtype, G, K) if fast else _exact(wtype, G, K)
    (qs_shape, qs_dtype), (qh_shape, qh_dtype), (sc_shape, sc_dtype), (mn_shape, mn_dtype), (d_shape, d_dtype), \
        (d2_shape, d2_dtype), unused = union_buffers(wtype, G, K)  # (TVMScript signatures take names, not subscripts)
    NB = K // QUANT_BLOCK

    @T.prim_func
    def f(x_h: T.handle, qs: T.Buffer(qs_shape, qs_dtype), qh: T.Buffer(qh_shape, qh_dtype),
          sc: T.Buffer(sc_shape, sc_dtype), mn: T.Buffer(mn_shape, mn_dtype), d: T.Buffer(d_shape, d_dtype),
          d2: T.Buffer(d2_shape, d2_dtype), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, NB, 32), "float32")
        y = T.match_buffer(y_h, (M, G, R), "float32")
        body(x, (qs, qh, sc, mn, d, d2), None, None, y)

    return without_params(f, unused)


def _exact(wtype: str, G: int, K: int):
    """The exact family's body(x, weights, _, _, y)."""
    NB = K // QUANT_BLOCK
    bits = HIGH_BITS.get(wtype, 0)

    @T.macro
    def body(x, ws, unused_d, unused_mn, y):
        qs, qh, sc, mn, d, d2 = ws
        M = x.shape[0]
        xh = T.alloc_buffer((M, NB, 2), "float32")
        acc = T.alloc_buffer((G, 2, R), "float32")  # per row group: outside the parallel loop (DESIGN.md §3)
        for m in T.serial(M):
            for b in T.serial(NB):
                for h in T.serial(2):
                    xh[m, b, h] = T.float32(0)
                    for j in T.serial(16):
                        xh[m, b, h] = xh[m, b, h] + x[m, b, 16 * h + j]
        for g in T.parallel(G):
            for m in T.serial(M):
                for r in T.vectorized(R):
                    y[m, g, r] = T.float32(0)
                for b in T.serial(NB):
                    for r in T.vectorized(R):
                        acc[g, 0, r] = T.float32(0)
                        acc[g, 1, r] = T.float32(0)
                    for j in T.unroll(16):
                        for r in T.vectorized(R):
                            acc[g, 0, r] = acc[g, 0, r] + to_f32(q_value(qs, qh, g, b, j, r, 0, bits)) * x[m, b, j]
                            acc[g, 1, r] = acc[g, 1, r] + to_f32(q_value(qs, qh, g, b, j, r, 1, bits)) * x[m, b, j + 16]
                    for r in T.vectorized(R):
                        y[m, g, r] = (y[m, g, r] + block_scale(wtype, sc, d, g, b, r, 0) * acc[g, 0, r]
                                      + block_scale(wtype, sc, d, g, b, r, 1) * acc[g, 1, r]
                                      + block_offset(wtype, sc, mn, d, d2, g, b, r, 0) * xh[m, b, 0]
                                      + block_offset(wtype, sc, mn, d, d2, g, b, r, 1) * xh[m, b, 1])

    return body


def _shifted(v, shift: int):
    """v << shift, or v >> -shift (uint8x32)."""
    if shift >= 0:
        return T.shift_left(v, T.uint8x32(shift))
    return T.shift_right(v, T.uint8x32(-shift))


def _fast(wtype: str, G: int, K: int):
    """The fast family's body(x, weights, _, _, y): avx2.avx2_driver around this format's block step."""
    NB = K // QUANT_BLOCK
    bits = HIGH_BITS.get(wtype, 0)
    S = W_SHUFFLE
    weight_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
                       for _, shape, dtype in weight_parts(wtype, G * R, K))
    PF = max(1, round(PREFETCH_BYTES / (NB * (16 + 4 * bits) * R)))  # row groups ahead
    mask = T.uint8x32(((1 << bits) - 1) << 4)
    k_quant = wtype in K_QUANTS
    has_qh = bits > 0  # (a TVMScript `if` takes a bool)

    def qvec(qs, qh, g, b, i):
        """Shuffled 32-byte vector i of the block's q: chunk c = i % 4 (elements 4c..4c+3), the low nibbles
        (i < 4) or the high ones, with their high bits from qh."""
        c, h = i % 4, i // 4
        w = T.Shuffle([qs.vload([g, b, 4 * c, 0], "uint8x32")], S)
        q = T.bitwise_and(w, T.uint8x32(15)) if h == 0 else T.shift_right(w, T.uint8x32(4))
        if not bits:
            return q
        s = bits * (2 * c + h)
        high = T.Shuffle([qh.vload([g, b, 4 * (s // 8), 0], "uint8x32")], S)
        return T.bitwise_or(q, T.bitwise_and(_shifted(high, 4 - s % 8), mask))

    def dot(q, xe, t, b, i):
        return maddubs(q[i], xe.vload([t, b, i, 0], "int8x32"))

    def half_sum(q, xe, t, b, h):
        """int32x8 row sums of q * x over the block's low (h = 0) or high half: q5 sums its 4 products in
        16 bits, q6_k 2 at a time."""
        p = [dot(q, xe, t, b, 4 * h + i) for i in range(4)]
        if bits == 1:
            return widen_halves(p[0] + p[1] + p[2] + p[3])
        return widen_halves(p[0] + p[1]) + widen_halves(p[2] + p[3])

    def block_sum(q, xe, t, b):
        """int32x8 row sums of q * x over the block (q4_k: its 8 products summed in 16 bits)."""
        if bits:
            return half_sum(q, xe, t, b, 0) + half_sum(q, xe, t, b, 1)
        total = dot(q, xe, t, b, 0)
        for i in range(1, 8):
            total = total + dot(q, xe, t, b, i)
        return widen_halves(total)

    def scales(ws, g, b, which):
        """float32x8 per row: the block's scale (which 0) and offset (1); for q6_k its halves' scales."""
        qs, qh, sc, mn, d, d2 = ws
        rows = T.ramp(0, 1, R)
        if wtype == "q6_k" or which == 0:
            return block_scale(wtype, sc, d, g, b, rows, which)
        return block_offset(wtype, sc, mn, d, d2, g, b, rows, 0)

    def update(q, a0, a1, xe, xd, xs, t, b):
        """What token t adds to the row group's 8 outputs for this block (q6_k: a0, a1 the halves' scales,
        whose offsets are -32 times them)."""
        xd8 = T.Broadcast(xd[t, b], R)
        if wtype == "q6_k":
            return (to_f32(half_sum(q, xe, t, b, 0)) * (a0 * xd8) + to_f32(half_sum(q, xe, t, b, 1)) * (a1 * xd8)
                    + (a0 * T.Broadcast(xs[t, 2 * b], R) + a1 * T.Broadcast(xs[t, 2 * b + 1], R))
                    * T.Broadcast(T.float32(-32), R))
        return to_f32(block_sum(q, xe, t, b)) * (a0 * xd8) + a1 * T.Broadcast(xs[t, b], R)

    @T.macro
    def row_block(ws, unused_d, unused_mn, xe, xd, xs, y, g, b, m0, t0, cnt):
        T.evaluate(prefetch(ws[0], [T.min(g + PF, G - 1), b, 0, 0]))
        T.evaluate(prefetch(ws[0], [T.min(g + PF, G - 1), b, 8, 0]))
        if has_qh:
            T.evaluate(prefetch(ws[1], [T.min(g + PF, G - 1), b, 0, 0]))
        q0: T.let = qvec(ws[0], ws[1], g, b, 0)
        q1: T.let = qvec(ws[0], ws[1], g, b, 1)
        q2: T.let = qvec(ws[0], ws[1], g, b, 2)
        q3: T.let = qvec(ws[0], ws[1], g, b, 3)
        q4: T.let = qvec(ws[0], ws[1], g, b, 4)
        q5: T.let = qvec(ws[0], ws[1], g, b, 5)
        q6: T.let = qvec(ws[0], ws[1], g, b, 6)
        q7: T.let = qvec(ws[0], ws[1], g, b, 7)
        a0: T.let = scales(ws, g, b, 0)
        a1: T.let = scales(ws, g, b, 1)
        for i in T.unroll(cnt):
            y[m0 + i, g, T.ramp(0, 1, R)] = (y[m0 + i, g, T.ramp(0, 1, R)]
                                             + update([q0, q1, q2, q3, q4, q5, q6, q7], a0, a1, xe, xd, xs, t0 + i, b))

    @T.macro
    def warm_block(ws, unused_d, unused_mn, g, b):
        T.evaluate(prefetch(ws[0], [g, b, 0, 0]))
        T.evaluate(prefetch(ws[0], [g, b, 8, 0]))
        if has_qh:
            T.evaluate(prefetch(ws[1], [g, b, 0, 0]))
        if b % 4 == 0:
            T.evaluate(prefetch(ws[4], [g, b // PER_SUPER if k_quant else b, 0]))

    return avx2_driver(G, NB, weight_bytes, row_block, warm_block, PF, half_sums=wtype == "q6_k")
