"""CPU TIR kernels for y = x @ W.T reading W in the row-interleaved layouts of core/layouts.py.

One output row group (R = 8 rows) is the unit of work: R accumulators live in one vector register and
the weights stay quantized. x is [M, K] (or [M, K/32, 32]) with symbolic M, so one kernel serves
prefill and decode. Every kernel is parallel over row groups (TVM's thread pool, see llvm.py).

Two families, chosen by the target's `kernels` setting:
- exact: f32 activations times the exactly dequantized weights, accumulated in f32 (per output the
  same order as the reference loop: block by block). Portable TIR, any llvm target.
- fast: llama.cpp's trick for the GGML formats on AVX2 hosts: the activations are quantized per
  32-block to int8 (scale d_x = max|x|/127, round to nearest even), and each 32-block dot product is
  an exact integer sum computed with `vpmaddubsw`/`vpmaddwd` straight on the stored bytes; the f16
  block scales are applied once per block in f32. The relative error against the exact kernel is
  that of 8-bit activations (~1e-2 of the largest output for random data, see tests). Prefill tiles 4
  tokens per weight decode and walks the tokens in L2-sized chunks. Float weights (f32, f16, bf16)
  keep f32 activations (the fast float kernel only splits the K sum over 4 accumulators).
  Without AVX2 (`isa="generic"`) the quantized formats use the exact kernels: no x86 intrinsic is
  ever emitted for a target that lacks it. With AVX-512 VNNI and VBMI (`isa="avx512vnni"`) the Q4_0/Q4_1
  dot products are `vpdpbusd` straight into 32-bit row sums (the same integers, fewer instructions:
  SmolLM2-shaped and 1B-shaped matrices 1.4-2.7x faster on one core here); the other formats keep the AVX2
  code, which that target runs too. On aarch64 with the dot-product extension (`isa="neon-dotprod"`)
  Q4_0/Q4_1/Q8_0 use `sdot` in the same VNNI byte order (kernels/cpu/neon.py; compiled and checked
  here, never run: no Arm machine) and the wider formats the exact kernels. INT8_DOTS says which is which.

The AVX2 machinery (intrinsics, activation quantization, the loop nest) is in kernels/cpu/avx2.py; the
5-bit, 6-bit and K-quant formats' kernels (both families) in kernels/cpu/linear_wide.py. bf16 weights are
their uint16 bits, widened by a 16-bit shift.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import FLOAT_TYPES, QUANT_BLOCK, ROW_GROUP, WIDE_TYPES
from jitllm.lowering.kernels.cpu.avx2 import (
    PREFETCH_BYTES,
    UNPACK_HI,
    UNPACK_LO,
    W_SHUFFLE,
    W_VNNI,
    X_PATTERN,
    X_VNNI,
    avx2_driver,
    dpbusd,
    maddubs,
    maddwd,
    prefetch,
    psign,
    widen_halves,
)
from jitllm.lowering.kernels.cpu.linear_wide import linear_wide_kernel
from jitllm.lowering.kernels.cpu.neon import sdot8
from jitllm.lowering.kernels.formats import FLOAT_STORAGE, float_weight

R = ROW_GROUP
KERNELS = ("exact", "fast")

INT8_DOTS = {
    "avx2": {"q4": "avx2", "q8_0": "avx2", "wide": "avx2"},
    "avx512vnni": {"q4": "vnni", "q8_0": "avx2", "wide": "avx2"},
    "neon-dotprod": {"q4": "sdot", "q8_0": "sdot"},
}
"""Per kernel ISA (targets/llvm.py), the int8 dot product of the fast family's kernels for Q4_0/Q4_1, Q8_0
and the wide formats (kernels/cpu/linear_wide.py); a format missing here takes the exact kernel."""
DOT4 = {"avx2": None, "vnni": dpbusd, "sdot": sdot8}
"""Each dot product's 4-byte multiply-add into int32x8 row sums (None: AVX2's vpmaddubsw/vpmaddwd pairs)."""


def linear_kernel(wtype: str, n: int, k: int, kernels: str = "exact", isa: str = "generic"
                  ) -> tuple[str, tvm.tirx.PrimFunc]:
    """(global symbol, PrimFunc) computing y[M, N/R, R] from x[M, K] (or [M, K/32, 32]) and the weight parts.
    The fast kernels split a single token's rows over the workers the pool has when they run (avx2.py)."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown CPU kernels {kernels!r} (known: {', '.join(KERNELS)})")
    g, variant = n // R, "exact"
    dots = INT8_DOTS.get(isa, {}) if kernels == "fast" else {}
    if kernels == "fast" and wtype in FLOAT_TYPES:
        func, variant = _float_fast(wtype, g, k), "fast"
    elif wtype in WIDE_TYPES:
        fast = dots.get("wide") == "avx2"
        func, variant = linear_wide_kernel(wtype, g, k, fast), "avx2" if fast else "exact"
    elif wtype in ("q4_0", "q4_1") and "q4" in dots:
        variant = dots["q4"]
        func = _q4_int8(wtype, g, k, dot4=DOT4[variant])
    elif wtype == "q8_0" and "q8_0" in dots:
        variant = dots["q8_0"]
        func = _q8_0_int8(g, k, dot4=DOT4[variant])
    else:
        factory = {"f32": _float, "f16": _float, "bf16": _float, "q8_0": _q8_0, "q4_0": _q4, "q4_1": _q4}[wtype]
        func = factory(wtype, g, k)
    symbol = f"jl_linear_{wtype}_{n}x{k}" + ("" if variant == "exact" else f"_{variant}")
    return symbol, func.with_attr("global_symbol", symbol)


# ---------------------------------------------------------------------------------------------------
# exact kernels (f32 activations)


def _float(wtype: str, G: int, K: int):
    wdtype = FLOAT_STORAGE[wtype]

    @T.prim_func
    def f(x_h: T.handle, w: T.Buffer((G, K, R), wdtype), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, K), "float32")
        y = T.match_buffer(y_h, (M, G, R), "float32")
        for g in T.parallel(G):
            for m in T.serial(M):
                for r in T.vectorized(R):
                    y[m, g, r] = T.float32(0)
                for kk in T.serial(K):
                    for r in T.vectorized(R):
                        y[m, g, r] = y[m, g, r] + float_weight(wtype, w[g, kk, r]) * x[m, kk]

    return f


def _q8_0(wtype: str, G: int, K: int):
    NB = K // QUANT_BLOCK

    @T.prim_func
    def f(x_h: T.handle, qs: T.Buffer((G, NB, 32, R), "int8"), d: T.Buffer((G, NB, R), "float16"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, NB, 32), "float32")
        y = T.match_buffer(y_h, (M, G, R), "float32")
        for g in T.parallel(G):
            for m in T.serial(M):
                for r in T.vectorized(R):
                    y[m, g, r] = T.float32(0)
                for b in T.serial(NB):
                    for j in T.serial(32):
                        for r in T.vectorized(R):
                            y[m, g, r] = y[m, g, r] + T.Cast("float32", d[g, b, r]) * (
                                T.Cast("float32", qs[g, b, j, r]) * x[m, b, j])

    return f


def _q4(wtype: str, G: int, K: int):
    """Q4_1 (value = d*q + m) and Q4_0 (value = d*(q-8), i.e. m = -8d): a per-block m term times sum(x)."""
    NB = K // QUANT_BLOCK
    if wtype == "q4_1":
        @T.prim_func
        def f(x_h: T.handle, qs: T.Buffer((G, NB, 16, R), "uint8"), d: T.Buffer((G, NB, R), "float16"),
              mn: T.Buffer((G, NB, R), "float16"), y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            M = T.int64()
            x = T.match_buffer(x_h, (M, NB, 32), "float32")
            y = T.match_buffer(y_h, (M, G, R), "float32")
            xs = T.alloc_buffer((M, NB), "float32")
            for m in T.serial(M):
                for b in T.serial(NB):
                    xs[m, b] = T.float32(0)
                    for j in T.serial(32):
                        xs[m, b] = xs[m, b] + x[m, b, j]
            for g in T.parallel(G):
                for m in T.serial(M):
                    for r in T.vectorized(R):
                        y[m, g, r] = T.float32(0)
                    for b in T.serial(NB):
                        for j in T.serial(16):
                            for r in T.vectorized(R):
                                y[m, g, r] = y[m, g, r] + T.Cast("float32", d[g, b, r]) * (
                                    T.Cast("float32", T.bitwise_and(qs[g, b, j, r], T.uint8(15))) * x[m, b, j]
                                    + T.Cast("float32", T.shift_right(qs[g, b, j, r], T.uint8(4))) * x[m, b, j + 16])
                        for r in T.vectorized(R):
                            y[m, g, r] = y[m, g, r] + T.Cast("float32", mn[g, b, r]) * xs[m, b]
        return f

    @T.prim_func
    def f0(x_h: T.handle, qs: T.Buffer((G, NB, 16, R), "uint8"), d: T.Buffer((G, NB, R), "float16"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, NB, 32), "float32")
        y = T.match_buffer(y_h, (M, G, R), "float32")
        xs = T.alloc_buffer((M, NB), "float32")
        for m in T.serial(M):
            for b in T.serial(NB):
                xs[m, b] = T.float32(0)
                for j in T.serial(32):
                    xs[m, b] = xs[m, b] + x[m, b, j]
        for g in T.parallel(G):
            for m in T.serial(M):
                for r in T.vectorized(R):
                    y[m, g, r] = T.float32(0)
                for b in T.serial(NB):
                    for j in T.serial(16):
                        for r in T.vectorized(R):
                            y[m, g, r] = y[m, g, r] + T.Cast("float32", d[g, b, r]) * (
                                T.Cast("float32", T.bitwise_and(qs[g, b, j, r], T.uint8(15))) * x[m, b, j]
                                + T.Cast("float32", T.shift_right(qs[g, b, j, r], T.uint8(4))) * x[m, b, j + 16])
                    for r in T.vectorized(R):
                        y[m, g, r] = y[m, g, r] - T.float32(8) * T.Cast("float32", d[g, b, r]) * xs[m, b]
    return f0


# ---------------------------------------------------------------------------------------------------
# fast kernels


def _float_fast(wtype: str, G: int, K: int):
    """f32 activations; the K sum is split over 4 interleaved accumulators (latency, not bandwidth, bound
    the single-accumulator loop), kept in a per-group scratch slice so LLVM holds them in registers."""
    wdtype = FLOAT_STORAGE[wtype]
    K4 = K // 4
    KT = K - 4 * K4

    @T.prim_func
    def f(x_h: T.handle, w: T.Buffer((G, K, R), wdtype), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, K), "float32")
        y = T.match_buffer(y_h, (M, G, R), "float32")
        acc = T.alloc_buffer((G, 4, R), "float32")
        for g in T.parallel(G):
            for m in T.serial(M):
                for u in T.unroll(4):
                    for r in T.vectorized(R):
                        acc[g, u, r] = T.float32(0)
                for i in T.serial(K4):
                    for u in T.unroll(4):
                        for r in T.vectorized(R):
                            acc[g, u, r] = acc[g, u, r] + float_weight(wtype, w[g, 4 * i + u, r]) * x[m, 4 * i + u]
                for r in T.vectorized(R):
                    y[m, g, r] = (acc[g, 0, r] + acc[g, 1, r]) + (acc[g, 2, r] + acc[g, 3, r])
                for t in T.serial(KT):
                    for r in T.vectorized(R):
                        y[m, g, r] = y[m, g, r] + float_weight(wtype, w[g, 4 * K4 + t, r]) * x[m, 4 * K4 + t]

    return f


def _q4_int8(wtype: str, G: int, K: int, prefetch_bytes: int = PREFETCH_BYTES, prefetch_scales: bool = False,
             warm: bool = True, dot4=None):
    """`dot4(acc, w, x)`: a 4-byte dot product into int32x8 row sums over the VNNI byte order (DOT4), or
    None for AVX2's vpmaddubsw over the pair order."""
    NB = K // QUANT_BLOCK
    vnni = dot4 is not None
    S = W_VNNI if vnni else W_SHUFFLE
    is_q4_1 = wtype == "q4_1"
    PF = max(1, round(prefetch_bytes / (NB * 16 * R)))

    def nib_sum(w0, w1, w2, w3, xe, t, b):
        lo = T.uint8x32(15)
        return (maddubs(T.bitwise_and(w0, lo), xe.vload([t, b, 0, 0], "int8x32"))
                + maddubs(T.shift_right(w0, T.uint8x32(4)), xe.vload([t, b, 4, 0], "int8x32"))
                + maddubs(T.bitwise_and(w1, lo), xe.vload([t, b, 1, 0], "int8x32"))
                + maddubs(T.shift_right(w1, T.uint8x32(4)), xe.vload([t, b, 5, 0], "int8x32"))
                + maddubs(T.bitwise_and(w2, lo), xe.vload([t, b, 2, 0], "int8x32"))
                + maddubs(T.shift_right(w2, T.uint8x32(4)), xe.vload([t, b, 6, 0], "int8x32"))
                + maddubs(T.bitwise_and(w3, lo), xe.vload([t, b, 3, 0], "int8x32"))
                + maddubs(T.shift_right(w3, T.uint8x32(4)), xe.vload([t, b, 7, 0], "int8x32")))

    def nib_dot(w0, w1, w2, w3, xe, t, b):
        """The VNNI form of widen_halves(nib_sum(...)): the row sums accumulated in 32 bits directly."""
        lo, acc = T.uint8x32(15), T.int32x8(0)
        for k, w in enumerate((w0, w1, w2, w3)):
            acc = dot4(acc, T.bitwise_and(w, lo), xe.vload([t, b, k, 0], "int8x32"))
            acc = dot4(acc, T.shift_right(w, T.uint8x32(4)), xe.vload([t, b, k + 4, 0], "int8x32"))
        return acc

    def row_sums(w0, w1, w2, w3, xe, t, b):
        return nib_dot(w0, w1, w2, w3, xe, t, b) if vnni else widen_halves(nib_sum(w0, w1, w2, w3, xe, t, b))

    def offset(d, mn, g, b):
        # the per-block term multiplying xs = d_x * sum(q_x): m (Q4_1) or -8 d (Q4_0)
        if is_q4_1:
            return T.Cast("float32x8", mn.vload([g, b, 0], "float16x8"))
        return T.Cast("float32x8", d.vload([g, b, 0], "float16x8")) * T.Broadcast(T.float32(-8), R)

    @T.macro
    def row_block(qs, d, mn, xe, xd, xs, y, g, b, m0, t0, cnt):
        T.evaluate(prefetch(qs, [T.min(g + PF, G - 1), b, 0, 0]))
        T.evaluate(prefetch(qs, [T.min(g + PF, G - 1), b, 8, 0]))
        if prefetch_scales:
            T.evaluate(prefetch(d, [T.min(g + PF, G - 1), b, 0]))
            T.evaluate(prefetch(mn, [T.min(g + PF, G - 1), b, 0]))
        w0: T.let = T.Shuffle([qs.vload([g, b, 0, 0], "uint8x32")], S)
        w1: T.let = T.Shuffle([qs.vload([g, b, 4, 0], "uint8x32")], S)
        w2: T.let = T.Shuffle([qs.vload([g, b, 8, 0], "uint8x32")], S)
        w3: T.let = T.Shuffle([qs.vload([g, b, 12, 0], "uint8x32")], S)
        dw: T.let = T.Cast("float32x8", d.vload([g, b, 0], "float16x8"))
        ow: T.let = offset(d, mn, g, b)
        for i in T.unroll(cnt):
            y[m0 + i, g, T.ramp(0, 1, R)] = (
                y[m0 + i, g, T.ramp(0, 1, R)]
                + T.Cast("float32x8", row_sums(w0, w1, w2, w3, xe, t0 + i, b))
                * (dw * T.Broadcast(xd[t0 + i, b], R))
                + ow * T.Broadcast(xs[t0 + i, b], R))

    @T.macro
    def warm_block(qs, d, mn, g, b):
        T.evaluate(prefetch(qs, [g, b, 0, 0]))
        T.evaluate(prefetch(qs, [g, b, 8, 0]))
        if b % 4 == 0:
            T.evaluate(prefetch(d, [g, b, 0]))
            if is_q4_1:
                T.evaluate(prefetch(mn, [g, b, 0]))

    body = avx2_driver(G, NB, G * NB * (16 + 2 * 2) * R, row_block, warm_block, PF if warm else 0,
                       pattern=X_VNNI if vnni else X_PATTERN)

    if is_q4_1:
        @T.prim_func
        def f(x_h: T.handle, qs: T.Buffer((G, NB, 16, R), "uint8"), d: T.Buffer((G, NB, R), "float16"),
              mn: T.Buffer((G, NB, R), "float16"), y_h: T.handle):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            M = T.int64()
            x = T.match_buffer(x_h, (M, NB, 32), "float32")
            y = T.match_buffer(y_h, (M, G, R), "float32")
            body(x, qs, d, mn, y)
        return f

    @T.prim_func
    def f0(x_h: T.handle, qs: T.Buffer((G, NB, 16, R), "uint8"), d: T.Buffer((G, NB, R), "float16"),
           y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, NB, 32), "float32")
        y = T.match_buffer(y_h, (M, G, R), "float32")
        body(x, qs, d, d, y)
    return f0


def _q8_0_int8(G: int, K: int, dot4=None):
    """Signed x signed. AVX2 (dot4 None): |w| (u8) times sign(x, w) with vpmaddubsw; 16-bit pairs of two
    chunks are interleaved so one vpmaddwd adds them per row without overflow. A signed 4-byte dot product
    (sdot) takes the 8 chunks in the VNNI byte order straight into 32-bit row sums."""
    NB = K // QUANT_BLOCK
    vnni = dot4 is not None
    S = W_VNNI if vnni else W_SHUFFLE
    LO, HI = UNPACK_LO, UNPACK_HI
    ones = T.int16x16(1)
    PF = max(1, round(PREFETCH_BYTES / (NB * 32 * R)))

    def prod(w, xe, t, b, c):
        return maddubs(T.abs(w), psign(xe.vload([t, b, c, 0], "int8x32"), w))

    def pair_lo(p0, p1):
        return maddwd(T.Shuffle([p0, p1], LO), ones)

    def pair_hi(p0, p1):
        return maddwd(T.Shuffle([p0, p1], HI), ones)

    def pair_sums(w0, w1, w2, w3, w4, w5, w6, w7, xe, t, b):
        p0, p1, p2, p3 = prod(w0, xe, t, b, 0), prod(w1, xe, t, b, 1), prod(w2, xe, t, b, 2), prod(w3, xe, t, b, 3)
        p4, p5, p6, p7 = prod(w4, xe, t, b, 4), prod(w5, xe, t, b, 5), prod(w6, xe, t, b, 6), prod(w7, xe, t, b, 7)
        lo = (pair_lo(p0, p1) + pair_lo(p2, p3)) + (pair_lo(p4, p5) + pair_lo(p6, p7))
        hi = (pair_hi(p0, p1) + pair_hi(p2, p3)) + (pair_hi(p4, p5) + pair_hi(p6, p7))
        return T.Shuffle([lo, hi], [0, 1, 2, 3, 8, 9, 10, 11]) + T.Shuffle([lo, hi], [4, 5, 6, 7, 12, 13, 14, 15])

    def row_sums(*args):
        if not vnni:
            return pair_sums(*args)
        *ws, xe, t, b = args
        acc = T.int32x8(0)
        for c, w in enumerate(ws):
            acc = dot4(acc, w, xe.vload([t, b, c, 0], "int8x32"))
        return acc

    @T.macro
    def row_block(qs, d, mn, xe, xd, xs, y, g, b, m0, t0, cnt):
        T.evaluate(prefetch(qs, [T.min(g + PF, G - 1), b, 0, 0]))
        T.evaluate(prefetch(qs, [T.min(g + PF, G - 1), b, 8, 0]))
        T.evaluate(prefetch(qs, [T.min(g + PF, G - 1), b, 16, 0]))
        T.evaluate(prefetch(qs, [T.min(g + PF, G - 1), b, 24, 0]))
        w0: T.let = T.Shuffle([qs.vload([g, b, 0, 0], "int8x32")], S)
        w1: T.let = T.Shuffle([qs.vload([g, b, 4, 0], "int8x32")], S)
        w2: T.let = T.Shuffle([qs.vload([g, b, 8, 0], "int8x32")], S)
        w3: T.let = T.Shuffle([qs.vload([g, b, 12, 0], "int8x32")], S)
        w4: T.let = T.Shuffle([qs.vload([g, b, 16, 0], "int8x32")], S)
        w5: T.let = T.Shuffle([qs.vload([g, b, 20, 0], "int8x32")], S)
        w6: T.let = T.Shuffle([qs.vload([g, b, 24, 0], "int8x32")], S)
        w7: T.let = T.Shuffle([qs.vload([g, b, 28, 0], "int8x32")], S)
        dw: T.let = T.Cast("float32x8", d.vload([g, b, 0], "float16x8"))
        for i in T.unroll(cnt):
            y[m0 + i, g, T.ramp(0, 1, R)] = (
                y[m0 + i, g, T.ramp(0, 1, R)]
                + T.Cast("float32x8", row_sums(w0, w1, w2, w3, w4, w5, w6, w7, xe, t0 + i, b))
                * (dw * T.Broadcast(xd[t0 + i, b], R)))

    @T.macro
    def warm_block(qs, d, mn, g, b):
        T.evaluate(prefetch(qs, [g, b, 0, 0]))
        T.evaluate(prefetch(qs, [g, b, 8, 0]))
        T.evaluate(prefetch(qs, [g, b, 16, 0]))
        T.evaluate(prefetch(qs, [g, b, 24, 0]))
        if b % 4 == 0:
            T.evaluate(prefetch(d, [g, b, 0]))

    body = avx2_driver(G, NB, G * NB * (32 + 2) * R, row_block, warm_block, PF, pattern=X_VNNI if vnni else X_PATTERN)

    @T.prim_func
    def f(x_h: T.handle, qs: T.Buffer((G, NB, 32, R), "int8"), d: T.Buffer((G, NB, R), "float16"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, NB, 32), "float32")
        y = T.match_buffer(y_h, (M, G, R), "float32")
        body(x, qs, d, d, y)

    return f
