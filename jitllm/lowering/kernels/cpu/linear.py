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
  tokens per weight decode and walks the tokens in L2-sized chunks. f16/f32 weights keep f32
  activations (the fast float kernel only splits the K sum over 4 accumulators).
  Without AVX2 (`isa="generic"`) the quantized formats use the exact kernels: no x86 intrinsic is
  ever emitted for a target that lacks it.

Byte order the AVX2 kernels rely on (layouts.py): a 32-byte load of qs[g, b, 4c:4c+4, :] holds
elements j = 4c..4c+3 (q4: also j+16 in the high nibbles) of the 8 rows, j-major. An in-lane byte
shuffle makes each 16-bit pair one row's two consecutive elements, so `vpmaddubsw` against the
activation pairs (prepared once per call in `xe`) sums within a row; the 16-bit lanes are then
[rows 0..7 of elements (4c, 4c+1) | rows 0..7 of (4c+2, 4c+3)] and the two halves are added in 32 bits.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import QUANT_BLOCK, ROW_GROUP

R = ROW_GROUP
KERNELS = ("exact", "fast")
ISAS = ("avx2", "generic")

MT = 4
"""Tokens per weight decode in the fast prefill path."""
MB = 64
"""Tokens per chunk in the fast prefill path (their int8 activations stay in L2 while all rows pass)."""

# In-lane byte shuffle of a 32-byte weight chunk: [j0: r0..r7, j1: r0..r7] -> [r0: j0 j1, r1: j0 j1, ...].
_PAIRS = [(p % 2) * 8 + p // 2 for p in range(16)]
W_SHUFFLE = _PAIRS + [16 + i for i in _PAIRS]
# Activation bytes matching W_SHUFFLE for the elements 4c..4c+3 of a 32-block (c = 0..7).
X_PATTERN = [[4 * c + 2 * (p // 16) + p % 2 for p in range(32)] for c in range(8)]
# 16-bit interleave of two vectors within each 128-bit lane (vpunpcklwd / vpunpckhwd).
_UNPACK_LO = [0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27]
_UNPACK_HI = [4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31]


def linear_kernel(wtype: str, n: int, k: int, kernels: str = "exact", isa: str = "generic", threads: int = 1
                  ) -> tuple[str, tvm.tirx.PrimFunc]:
    """(global symbol, PrimFunc) computing y[M, N/R, R] from x[M, K] (or [M, K/32, 32]) and the weight parts.

    `threads`: the thread pool size the fast kernels split a single token's rows over (part of the
    target's cache key)."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown CPU kernels {kernels!r} (known: {', '.join(KERNELS)})")
    g, variant = n // R, "exact"
    if kernels == "fast" and wtype in ("f32", "f16"):
        func, variant = _float_fast(wtype, g, k), "fast"
    elif kernels == "fast" and isa == "avx2" and wtype in ("q4_0", "q4_1"):
        func, variant = _q4_avx2(wtype, g, k, threads), "avx2"
    elif kernels == "fast" and isa == "avx2" and wtype == "q8_0":
        func, variant = _q8_0_avx2(g, k, threads), "avx2"
    else:
        factory = {"f32": _float, "f16": _float, "q8_0": _q8_0, "q4_0": _q4, "q4_1": _q4}[wtype]
        func = factory(wtype, g, k)
    symbol = f"jl_linear_{wtype}_{n}x{k}" + ("" if variant == "exact" else f"_{variant}")
    return symbol, func.with_attr("global_symbol", symbol)


# ---------------------------------------------------------------------------------------------------
# exact kernels (f32 activations)


def _float(wtype: str, G: int, K: int):
    wdtype = "float32" if wtype == "f32" else "float16"

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
                        y[m, g, r] = y[m, g, r] + T.Cast("float32", w[g, kk, r]) * x[m, kk]

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
    wdtype = "float32" if wtype == "f32" else "float16"
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
                            acc[g, u, r] = acc[g, u, r] + T.Cast("float32", w[g, 4 * i + u, r]) * x[m, 4 * i + u]
                for r in T.vectorized(R):
                    y[m, g, r] = (acc[g, 0, r] + acc[g, 1, r]) + (acc[g, 2, r] + acc[g, 3, r])
                for t in T.serial(KT):
                    for r in T.vectorized(R):
                        y[m, g, r] = y[m, g, r] + T.Cast("float32", w[g, 4 * K4 + t, r]) * x[m, 4 * K4 + t]

    return f


def _shuffle_reduce(v, lanes: int, op):
    """Reduce a vector expression to a scalar with a halving tree of shuffles."""
    while lanes > 1:
        half = lanes // 2
        v = op(T.Shuffle([v], list(range(half))), T.Shuffle([v], list(range(half, lanes))))
        lanes = half
    return v


def _hmax(v, lanes):
    return _shuffle_reduce(v, lanes, T.max)


def _hsum(v, lanes):
    return _shuffle_reduce(v, lanes, lambda a, b: a + b)


def _maddubs(a, b):
    """vpmaddubsw: u8 x s8 products, adjacent pairs summed to s16 (no saturation for our ranges)."""
    return T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", a, b)


def _maddwd(a, b):
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", a, b)


def _psign(a, b):
    return T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", a, b)


def _prefetch(buf, idx):
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(buf[tuple(idx)]), T.int32(0), T.int32(3),
                              T.int32(1))


def _widen_halves(s16):
    """[rows 0..7 | rows 0..7] int16x16 -> int32x8 row sums."""
    return (T.Cast("int32x8", T.Shuffle([s16], list(range(8))))
            + T.Cast("int32x8", T.Shuffle([s16], list(range(8, 16)))))


def _quantize_activations():
    """A macro quantizing the 32-block x[m, b] to int8: scale xd, xs = xd * sum(q), and the activation byte
    patterns xe[t, b, c] (X_PATTERN[c]) the AVX2 dot products read, stored at row t."""
    P = X_PATTERN

    @T.macro
    def quantize(x, xe, xd, xs, m, t, b):
        v: T.let = x.vload([m, b, 0], "float32x32")
        amax: T.let = _hmax(T.abs(v), 32)
        qf: T.let = T.nearbyint(v * T.Broadcast(T.if_then_else(amax > T.float32(0), T.float32(127) / amax,
                                                                 T.float32(0)), 32))
        xd[t, b] = amax / T.float32(127)
        xs[t, b] = _hsum(qf, 32) * (amax / T.float32(127))
        q8: T.let = T.Cast("int8x32", T.Cast("int32x32", qf))
        xe[t, b, 0, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[0])
        xe[t, b, 1, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[1])
        xe[t, b, 2, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[2])
        xe[t, b, 3, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[3])
        xe[t, b, 4, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[4])
        xe[t, b, 5, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[5])
        xe[t, b, 6, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[6])
        xe[t, b, 7, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[7])

    return quantize


SERIAL_BYTES = 160 * 1024
"""Decode (one token) runs single-threaded below this many weight bytes: a parallel launch costs ~2.5 us
on the 2-vCPU VM, more than it saves on the k/v projections."""
PREFETCH_BYTES = 6 * 1024
"""Software prefetch distance in the AVX2 kernels (a 1536x576 Q4_1 matvec: 41 -> 32 us on one thread)."""


MAIN_SHARE = 0.5
"""Share of a token's row groups the calling thread (task 0) takes: the worker threads start later."""


def _avx2_driver(G: int, NB: int, threads: int, weight_bytes: int, row_block, main_share: float | None = None,
                 warm=None, warm_groups: int = 0):
    """The loop nest shared by the AVX2 kernels around `row_block(qs, d, mn, xe, xd, xs, y, g, b, m0, t0, cnt)`
    (cnt tokens: y rows m0.., activation rows t0..).

    One token: each of `threads` tasks quantizes x itself (no serial section, no barrier) and takes a
    contiguous share of the row groups; small matrices run on the calling thread alone. Several tokens:
    x is quantized in parallel, then the tokens are walked in chunks of MB (their activations stay in L2)
    with MT tokens per weight decode, parallel over row groups.

    `warm(qs, d, mn, g, b)` prefetches one block of a row group: each one-token task first requests its
    first `warm_groups` groups, so their DRAM reads overlap the activation quantization instead of
    starting when the loop reaches them (every call starts its streams cold)."""
    quantize = _quantize_activations()
    serial = weight_bytes < SERIAL_BYTES or threads < 2
    NT = max(1, threads)
    # task 0 (the calling thread) takes rows [0, G0), the other tasks split the rest evenly
    G0 = G if NT == 1 else max(1, min(G, round(G * (MAIN_SHARE if main_share is None else main_share))))
    GC = (G - G0 + NT - 2) // max(1, NT - 1)
    NBP = (NB + 15) // 16 * 16 + 16  # per-token scale rows padded to whole cache lines (no false sharing)

    @T.macro
    def body(x, qs, d, mn, y):
        M = x.shape[0]
        xe = T.alloc_buffer((T.max(M, T.int64(NT)), NB, 8, 32), "int8")
        xd = T.alloc_buffer((T.max(M, T.int64(NT)), NBP), "float32")
        xs = T.alloc_buffer((T.max(M, T.int64(NT)), NBP), "float32")
        if M == 1:
            if serial:
                for g in T.serial(min(warm_groups, G)):
                    for b in T.serial(NB):
                        warm(qs, d, mn, g, b)
                for b in T.serial(NB):
                    quantize(x, xe, xd, xs, 0, 0, b)
                for g in T.serial(G):
                    for r in T.vectorized(R):
                        y[0, g, r] = T.float32(0)
                    for b in T.serial(NB):
                        row_block(qs, d, mn, xe, xd, xs, y, g, b, 0, 0, 1)
            else:
                for task in T.parallel(NT):
                    for g in T.serial(T.if_then_else(task == 0, 0, T.min(G0 + (task - 1) * GC, G)),
                                      T.if_then_else(task == 0, min(warm_groups, G0),
                                                     T.min(G0 + (task - 1) * GC + warm_groups, G))):
                        for b in T.serial(NB):
                            warm(qs, d, mn, g, b)
                    for b in T.serial(NB):
                        quantize(x, xe, xd, xs, 0, task, b)
                    for g in T.serial(T.if_then_else(task == 0, 0, G0 + (task - 1) * GC),
                                      T.if_then_else(task == 0, G0, T.min(G0 + task * GC, G))):
                        for r in T.vectorized(R):
                            y[0, g, r] = T.float32(0)
                        for b in T.serial(NB):
                            row_block(qs, d, mn, xe, xd, xs, y, g, b, 0, task, 1)
        else:
            for m in T.parallel(M):
                for b in T.serial(NB):
                    quantize(x, xe, xd, xs, m, m, b)
            for mb in T.serial((M + MB - 1) // MB):
                for g in T.parallel(G):
                    cnt: T.let = T.min(M - mb * MB, T.int64(MB))
                    for t in T.serial(cnt // MT):
                        for i in T.unroll(MT):
                            for r in T.vectorized(R):
                                y[mb * MB + t * MT + i, g, r] = T.float32(0)
                        for b in T.serial(NB):
                            row_block(qs, d, mn, xe, xd, xs, y, g, b, mb * MB + t * MT, mb * MB + t * MT, MT)
                    for t in T.serial(cnt % MT):
                        for r in T.vectorized(R):
                            y[mb * MB + cnt // MT * MT + t, g, r] = T.float32(0)
                        for b in T.serial(NB):
                            row_block(qs, d, mn, xe, xd, xs, y, g, b, mb * MB + cnt // MT * MT + t,
                                      mb * MB + cnt // MT * MT + t, 1)

    return body


def _q4_avx2(wtype: str, G: int, K: int, threads: int = 1, prefetch_bytes: int = PREFETCH_BYTES,
             prefetch_scales: bool = False, main_share: float | None = None, warm: bool = True):
    NB = K // QUANT_BLOCK
    S = W_SHUFFLE
    is_q4_1 = wtype == "q4_1"
    PF = max(1, round(prefetch_bytes / (NB * 16 * R)))

    def nib_sum(w0, w1, w2, w3, xe, t, b):
        lo = T.uint8x32(15)
        return (_maddubs(T.bitwise_and(w0, lo), xe.vload([t, b, 0, 0], "int8x32"))
                + _maddubs(T.shift_right(w0, T.uint8x32(4)), xe.vload([t, b, 4, 0], "int8x32"))
                + _maddubs(T.bitwise_and(w1, lo), xe.vload([t, b, 1, 0], "int8x32"))
                + _maddubs(T.shift_right(w1, T.uint8x32(4)), xe.vload([t, b, 5, 0], "int8x32"))
                + _maddubs(T.bitwise_and(w2, lo), xe.vload([t, b, 2, 0], "int8x32"))
                + _maddubs(T.shift_right(w2, T.uint8x32(4)), xe.vload([t, b, 6, 0], "int8x32"))
                + _maddubs(T.bitwise_and(w3, lo), xe.vload([t, b, 3, 0], "int8x32"))
                + _maddubs(T.shift_right(w3, T.uint8x32(4)), xe.vload([t, b, 7, 0], "int8x32")))

    def offset(d, mn, g, b):
        # the per-block term multiplying xs = d_x * sum(q_x): m (Q4_1) or -8 d (Q4_0)
        if is_q4_1:
            return T.Cast("float32x8", mn.vload([g, b, 0], "float16x8"))
        return T.Cast("float32x8", d.vload([g, b, 0], "float16x8")) * T.Broadcast(T.float32(-8), R)

    @T.macro
    def row_block(qs, d, mn, xe, xd, xs, y, g, b, m0, t0, cnt):
        T.evaluate(_prefetch(qs, [T.min(g + PF, G - 1), b, 0, 0]))
        T.evaluate(_prefetch(qs, [T.min(g + PF, G - 1), b, 8, 0]))
        if prefetch_scales:
            T.evaluate(_prefetch(d, [T.min(g + PF, G - 1), b, 0]))
            T.evaluate(_prefetch(mn, [T.min(g + PF, G - 1), b, 0]))
        w0: T.let = T.Shuffle([qs.vload([g, b, 0, 0], "uint8x32")], S)
        w1: T.let = T.Shuffle([qs.vload([g, b, 4, 0], "uint8x32")], S)
        w2: T.let = T.Shuffle([qs.vload([g, b, 8, 0], "uint8x32")], S)
        w3: T.let = T.Shuffle([qs.vload([g, b, 12, 0], "uint8x32")], S)
        dw: T.let = T.Cast("float32x8", d.vload([g, b, 0], "float16x8"))
        ow: T.let = offset(d, mn, g, b)
        for i in T.unroll(cnt):
            y[m0 + i, g, T.ramp(0, 1, R)] = (
                y[m0 + i, g, T.ramp(0, 1, R)]
                + T.Cast("float32x8", _widen_halves(nib_sum(w0, w1, w2, w3, xe, t0 + i, b)))
                * (dw * T.Broadcast(xd[t0 + i, b], R))
                + ow * T.Broadcast(xs[t0 + i, b], R))

    @T.macro
    def warm_block(qs, d, mn, g, b):
        T.evaluate(_prefetch(qs, [g, b, 0, 0]))
        T.evaluate(_prefetch(qs, [g, b, 8, 0]))
        if b % 4 == 0:
            T.evaluate(_prefetch(d, [g, b, 0]))
            if is_q4_1:
                T.evaluate(_prefetch(mn, [g, b, 0]))

    body = _avx2_driver(G, NB, threads, G * NB * (16 + 2 * 2) * R, row_block, main_share, warm_block,
                        PF if warm else 0)

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


def _q8_0_avx2(G: int, K: int, threads: int = 1):
    """Signed x signed: |w| (u8) times sign(x, w) with vpmaddubsw; 16-bit pairs of two chunks are
    interleaved so one vpmaddwd adds them per row without overflow."""
    NB = K // QUANT_BLOCK
    S = W_SHUFFLE
    LO, HI = _UNPACK_LO, _UNPACK_HI
    ones = T.int16x16(1)
    PF = max(1, round(PREFETCH_BYTES / (NB * 32 * R)))

    def prod(w, xe, t, b, c):
        return _maddubs(T.abs(w), _psign(xe.vload([t, b, c, 0], "int8x32"), w))

    def pair_lo(p0, p1):
        return _maddwd(T.Shuffle([p0, p1], LO), ones)

    def pair_hi(p0, p1):
        return _maddwd(T.Shuffle([p0, p1], HI), ones)

    def row_sums(w0, w1, w2, w3, w4, w5, w6, w7, xe, t, b):
        p0, p1, p2, p3 = prod(w0, xe, t, b, 0), prod(w1, xe, t, b, 1), prod(w2, xe, t, b, 2), prod(w3, xe, t, b, 3)
        p4, p5, p6, p7 = prod(w4, xe, t, b, 4), prod(w5, xe, t, b, 5), prod(w6, xe, t, b, 6), prod(w7, xe, t, b, 7)
        lo = (pair_lo(p0, p1) + pair_lo(p2, p3)) + (pair_lo(p4, p5) + pair_lo(p6, p7))
        hi = (pair_hi(p0, p1) + pair_hi(p2, p3)) + (pair_hi(p4, p5) + pair_hi(p6, p7))
        return T.Shuffle([lo, hi], [0, 1, 2, 3, 8, 9, 10, 11]) + T.Shuffle([lo, hi], [4, 5, 6, 7, 12, 13, 14, 15])

    @T.macro
    def row_block(qs, d, mn, xe, xd, xs, y, g, b, m0, t0, cnt):
        T.evaluate(_prefetch(qs, [T.min(g + PF, G - 1), b, 0, 0]))
        T.evaluate(_prefetch(qs, [T.min(g + PF, G - 1), b, 8, 0]))
        T.evaluate(_prefetch(qs, [T.min(g + PF, G - 1), b, 16, 0]))
        T.evaluate(_prefetch(qs, [T.min(g + PF, G - 1), b, 24, 0]))
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
        T.evaluate(_prefetch(qs, [g, b, 0, 0]))
        T.evaluate(_prefetch(qs, [g, b, 8, 0]))
        T.evaluate(_prefetch(qs, [g, b, 16, 0]))
        T.evaluate(_prefetch(qs, [g, b, 24, 0]))
        if b % 4 == 0:
            T.evaluate(_prefetch(d, [g, b, 0]))

    body = _avx2_driver(G, NB, threads, G * NB * (32 + 2) * R, row_block, None, warm_block, PF)

    @T.prim_func
    def f(x_h: T.handle, qs: T.Buffer((G, NB, 32, R), "int8"), d: T.Buffer((G, NB, R), "float16"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, NB, 32), "float32")
        y = T.match_buffer(y_h, (M, G, R), "float32")
        body(x, qs, d, d, y)

    return f
