"""Prefill linears on tensor cores: y[M, N] = x[M, K] · Wᵀ with WMMA 16x16x16 tiles (f16 operands,
f32 accumulation), written as TIR with TVM's WMMA builtins (TVM 0.27's dlight tensorization segfaults).

Exactness: tensor cores take f16 operands, so each activation is split into two f16 halves,
x = hi + lo (hi = f16(x), lo = f16(x - hi)), and both are multiplied: ~22 bits of the activation's
24-bit mantissa survive, close to the f32 CUDA-core kernel (measured on the H200: relative error
8e-6 against 2.5e-6 for the f32 kernel, 2e-4 with f16 activations alone). f16 weights are exact in
f16; a dequantized weight (d · q) is not, so it is split the same way and the product hi·hi + lo·hi +
hi·lo taken (the lo·lo term is below f32 rounding). The fast kernel family (`split=False`) takes
f16(x) times f16(w) alone, one product instead of two or three: relative error ~2e-4, as
llama.cpp's f16 GEMMs have, far below the int8 activations of the fast decode matvecs. (On sm_80 on,
the fast family's folded prefill linears take kernels_gpu_gemm's operand pass + mma.sync GEMM instead.)

One thread block computes a BM x BN tile of y with 4 warps (2 x 2, each BM/2 x BN/2; BM 64 or 128,
the larger for wide projections, where the fewer loads per product measured 7-17% faster); per BK = 32 step (one quantization block) x's rows and the weights' columns sit in shared
memory as f16 while each warp runs its fragments, and the next step's values are already on their way
into registers. Rows past M read row M - 1 and are not stored.

Folded ops (kernels_gpu_gemv.Fold, as the decode matvecs fold them): an RMS norm before the product
(its weight scales x as x is staged, each row's sum of squares accumulates from the same loads, and
1/RMS scales the finished row, the product being linear) and a residual add as rows are stored.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import QUANT_BLOCK, ROW_GROUP, weight_parts
from jitllm.ir.ops import LINEAR, SWIGLU_LINEAR_ADD
from jitllm.lowering.kernels.cuda.basic import absent_weight_params, shfl_xor
from jitllm.lowering.kernels.cuda.gemv import Fold
from jitllm.lowering.kernels.formats import without_params

R = ROW_GROUP
BK = QUANT_BLOCK
NT = 128  # 4 warps, 2 x 2
PAD = 8  # halves of padding per shared-memory row (keeps WMMA loads off one bank)
WMMA_FORMATS = ("f16", "q8_0", "q4_0", "q4_1")


def mma_linear_kernel(wtype: str, n: int, k: int, split: bool = True, bm: int = 64, family: str = LINEAR,
                      eps: float = 0.0) -> tuple[str, tvm.tirx.PrimFunc] | None:
    """The tensor-core kernel for a prefill linear of this shape, or None where it does not apply
    (f32 weights, or N not a multiple of 64). `split`: f16 hi + lo halves (near-f32 results) or f16
    operands alone (the fast family). `bm`: rows per thread block, 64 or 128 (each warp's tile 32 or 64
    rows by BN / 2 columns).
    `family` (jitllm.ir.ops) folds a norm before or a residual add after the product, as the decode
    matvecs do (kernels_gpu_gemv.Fold); not SwiGLU, which every column tile would recompute (measured
    on the H200: the 3B shape's down projection 229 -> 448 us at 512 rows, against ~15 us for one
    elementwise pass): that family gets None."""
    if wtype not in WMMA_FORMATS or n % 64 or k % BK or family == SWIGLU_LINEAR_ADD:
        return None
    bn = 128 if n % 128 == 0 else 64
    fold = Fold.of(family, eps)
    symbol = f"jl_gpu_mma_linear_{wtype}_{n}x{k}" + ("" if split else "_f16") + ("" if bm == 64 else f"_m{bm}") \
        + fold.suffix(family)
    return symbol, _kernel(wtype, n, k, bn, split, bm, fold).with_attr("global_symbol", symbol)


def wmma_load(frag, index, buf, at, ld: int, layout: str = "row_major"):
    """Load fragment `index` of `frag` (16 x 16) from the f16 shared buffer `buf`, element `at` on, rows
    `ld` elements apart."""
    return T.tvm_load_matrix_sync(frag.data, 16, 16, 16, index,
                                  T.tvm_access_ptr(T.type_annotation("float16"), buf.data, at, 16 * ld, 1), ld, layout)


def wmma_store(frag, index, buf, at, ld: int):
    """Store accumulator fragment `index` of `frag` into the f32 shared buffer `buf`, element `at` on, rows
    `ld` elements apart."""
    return T.tvm_store_matrix_sync(frag.data, 16, 16, 16, index,
                                   T.tvm_access_ptr(T.type_annotation("float32"), buf.data, at, 16 * ld, 2), ld,
                                   "row_major")


@T.macro
def _load_x(x, xv, nw, gv, M, bm, kt, t, BM, fold):
    """x[bm*BM : +BM, kt*BK : +BK] into registers, four floats per thread per item (rows past M: M - 1),
    and with the norm folded its weights for those columns (gv)."""
    for s in T.unroll(BM * BK // 4 // NT):
        e: T.let = s * NT + t
        src: T.let = T.min(bm * BM + T.Cast("int64", e // (BK // 4)), M - 1)
        for v in T.vectorized(4):
            xv[s * 4 + v] = x[src, kt * BK + e % (BK // 4) * 4 + v]
        if fold.norm:
            for v in T.vectorized(4):
                gv[s * 4 + v] = nw[kt * BK + e % (BK // 4) * 4 + v]


@T.macro
def _store_x(xv, gv, xf, ss, a_hi, a_lo, t, LDA, split, BM, fold, count):
    """The registers of _load_x into shared memory as f16 halves hi and lo (hi alone without `split`).
    With the norm folded, its weight scales each column and, where `count` holds (each tile once), the
    squares add into the row's sum `ss`."""
    for s in T.unroll(BM * BK // 4 // NT):
        e: T.let = s * NT + t
        at: T.let = e // (BK // 4) * LDA + e % (BK // 4) * 4
        for v in T.serial(4):
            xf[v] = xv[s * 4 + v]
            if fold.norm:
                if count:
                    ss[s] = ss[s] + xf[v] * xf[v]
                xf[v] = xf[v] * gv[s * 4 + v]
            a_hi[at + v] = T.Cast("float16", xf[v])
            if split:
                a_lo[at + v] = T.Cast("float16", xf[v] - T.Cast("float32", T.Cast("float16", xf[v])))


@T.macro
def load_w(q, d, mn, qv, dv, mv, bn, kt, t, BN, nt, fmt, reg):
    """Columns bn*BN : +BN of W for k in kt*BK : +BK into registers, spread over `nt` threads: per item,
    one row group's 8 values (or quants) and, for quantized formats, their scales (and minimums), from
    register `reg` on."""
    if fmt == "f16" or fmt == "q8_0":
        for s in T.unroll(BN // R * BK // nt):  # items: (row group, column)
            e: T.let = s * nt + t
            g: T.let = bn * (BN // R) + e // BK
            if fmt == "f16":
                for r in T.vectorized(R):
                    qv[reg + s * R + r] = q[g, kt * BK + e % BK, r]
            else:
                for r in T.vectorized(R):
                    qv[reg + s * R + r] = q[g, kt, e % BK, r]
                for r in T.vectorized(R):
                    dv[reg + s * R + r] = d[g, kt, r]
    else:  # q4_0 / q4_1 items: (row group, byte column); byte j holds columns j and j + 16
        for s in T.unroll(BN // R * (BK // 2) // nt):
            e: T.let = s * nt + t
            g: T.let = bn * (BN // R) + e // (BK // 2)
            for r in T.vectorized(R):
                qv[reg + s * R + r] = q[g, kt, e % (BK // 2), r]
            for r in T.vectorized(R):
                dv[reg + s * R + r] = d[g, kt, r]
            if fmt == "q4_1":
                for r in T.vectorized(R):
                    mv[reg + s * R + r] = mn[g, kt, r]


@T.macro
def split_store(b_hi, b_lo, wv, hv, lv, at, split):
    """Eight dequantized weights (wv, f32) into b_hi / b_lo at `at` as f16 halves (hi alone without `split`)."""
    for r in T.serial(R):
        hv[r] = T.Cast("float16", wv[r])
        if split:
            lv[r] = T.Cast("float16", wv[r] - T.Cast("float32", hv[r]))
    for r in T.vectorized(R):
        b_hi[at + r] = hv[r]
    if split:
        for r in T.vectorized(R):
            b_lo[at + r] = lv[r]


@T.macro
def store_w(qv, dv, mv, b_hi, b_lo, wv, hv, lv, t, BN, nt, LDB, fmt, split, base, reg):
    """The registers of load_w into shared memory from element `base` on as b[k, n] (n contiguous);
    dequantized weights are split into f16 halves hi and lo (hi alone without `split`). `reg`: where the
    tile starts in the registers."""
    if fmt == "f16":
        for s in T.unroll(BN // R * BK // nt):
            e: T.let = s * nt + t
            for r in T.vectorized(R):
                b_hi[base + e % BK * LDB + e // BK * R + r] = qv[reg + s * R + r]
    elif fmt == "q8_0":
        for s in T.unroll(BN // R * BK // nt):
            e: T.let = s * nt + t
            for r in T.serial(R):
                wv[r] = T.Cast("float32", dv[reg + s * R + r]) * T.Cast("float32", qv[reg + s * R + r])
            split_store(b_hi, b_lo, wv, hv, lv, base + e % BK * LDB + e // BK * R, split)
    else:
        for s in T.unroll(BN // R * (BK // 2) // nt):
            e: T.let = s * nt + t
            for half in T.unroll(2):
                for r in T.serial(R):
                    nib: T.let = T.Cast("float32", T.bitwise_and(
                        T.shift_right(qv[reg + s * R + r], T.Cast("uint8", half * 4)), T.uint8(15)))
                    if fmt == "q4_1":
                        wv[r] = T.Cast("float32", dv[reg + s * R + r]) * nib + T.Cast("float32", mv[reg + s * R + r])
                    else:
                        wv[r] = T.Cast("float32", dv[reg + s * R + r]) * (nib - T.float32(8))
                split_store(b_hi, b_lo, wv, hv, lv, base + (e % (BK // 2) + half * 16) * LDB + e // (BK // 2) * R, split)


@T.macro
def _body(x, nw, q, d, mn, res, y, M, N, K, BM, BN, LDA, LDB, WM, WN, FM, FN, fmt, qdtype, split, fold):
    """LDA, LDB: shared row lengths of x's and W's tiles; WN: a warp's columns; FM x FN: its fragments."""
    for bn in T.thread_binding(N // BN, thread="blockIdx.x"):
        for bm in T.thread_binding((M + BM - 1) // BM, thread="blockIdx.y"):
            for t in T.thread_binding(NT, thread="threadIdx.x"):
                a_hi = T.alloc_buffer((BM * LDA,), "float16", scope="shared")
                a_lo = T.alloc_buffer((BM * LDA,), "float16", scope="shared")
                b_hi = T.alloc_buffer((BK * LDB,), "float16", scope="shared")
                b_lo = T.alloc_buffer((BK * LDB,), "float16", scope="shared")
                # per-warp staging of one finished 16x16 tile; shared.dyn keeps it out of the f16 buffers'
                # merged allocation (an f32 pointer into it fails TVM's access_ptr check)
                # (then the rows' 1/RMS where the norm is folded)
                c_s = T.alloc_buffer((NT // 32 * 256 + BM,), "float32", scope="shared.dyn")
                fa = T.alloc_buffer((FM * 16, 16), "float16", scope="wmma.matrix_a")
                fl = T.alloc_buffer((FM * 16, 16), "float16", scope="wmma.matrix_a")
                fb = T.alloc_buffer((16, FN * 16), "float16", scope="wmma.matrix_b")
                fbl = T.alloc_buffer((16, FN * 16), "float16", scope="wmma.matrix_b")
                acc = T.alloc_buffer((FM * 16, FN * 16), "float32", scope="wmma.accumulator")
                xv = T.alloc_buffer((BM * BK // NT,), "float32", scope="local")  # the next tile, in flight
                gv = T.alloc_buffer((BM * BK // NT,), "float32", scope="local")  # (its norm weights)
                xf = T.alloc_buffer((4,), "float32", scope="local")
                ss = T.alloc_buffer((BM * BK // 4 // NT,), "float32", scope="local")  # (sums of squares: norm)
                qv = T.alloc_buffer((BN * BK // NT,), qdtype, scope="local")
                dv = T.alloc_buffer((BN * BK // NT,), "float16", scope="local")
                mv = T.alloc_buffer((BN * BK // NT,), "float16", scope="local")
                wv = T.alloc_buffer((R,), "float32", scope="local")
                hv = T.alloc_buffer((R,), "float16", scope="local")
                lv = T.alloc_buffer((R,), "float16", scope="local")
                warp: T.let = t // 32
                wm: T.let = warp // 2
                wn: T.let = warp % 2
                for i in T.serial(FM):
                    for j in T.serial(FN):
                        T.evaluate(T.tvm_fill_fragment(acc.data, 16, 16, 16, i * FN + j, T.float32(0)))
                for s in T.serial(BM * BK // 4 // NT):
                    ss[s] = T.float32(0)
                _load_x(x, xv, nw, gv, M, bm, 0, t, BM, fold)
                load_w(q, d, mn, qv, dv, mv, bn, 0, t, BN, NT, fmt, 0)
                _store_x(xv, gv, xf, ss, a_hi, a_lo, t, LDA, split, BM, fold, True)
                store_w(qv, dv, mv, b_hi, b_lo, wv, hv, lv, t, BN, NT, LDB, fmt, split, 0, 0)
                for kt in T.serial(K // BK):
                    T.tvm_storage_sync("shared")
                    # the next tile's loads are issued before this tile's products (the last tile loads
                    # itself again), so their latency hides behind the tensor cores
                    _load_x(x, xv, nw, gv, M, bm, T.min(kt + 1, K // BK - 1), t, BM, fold)
                    load_w(q, d, mn, qv, dv, mv, bn, T.min(kt + 1, K // BK - 1), t, BN, NT, fmt, 0)
                    for ks in T.serial(BK // 16):
                        for i in T.serial(FM):
                            a_at: T.let = (wm * WM + i * 16) * LDA + ks * 16
                            T.evaluate(wmma_load(fa, i, a_hi, a_at, LDA))
                            if split:
                                T.evaluate(wmma_load(fl, i, a_lo, a_at, LDA))
                        for j in T.serial(FN):
                            b_at: T.let = ks * 16 * LDB + wn * WN + j * 16
                            T.evaluate(wmma_load(fb, j, b_hi, b_at, LDB))
                            if split and fmt != "f16":
                                T.evaluate(wmma_load(fbl, j, b_lo, b_at, LDB))
                        for i in T.serial(FM):
                            for j in T.serial(FN):
                                f: T.let = i * FN + j
                                T.evaluate(T.tvm_mma_sync(acc.data, f, fa.data, i, fb.data, j, acc.data, f))
                                if split:
                                    T.evaluate(T.tvm_mma_sync(acc.data, f, fl.data, i, fb.data, j, acc.data, f))
                                if split and fmt != "f16":
                                    T.evaluate(T.tvm_mma_sync(acc.data, f, fa.data, i, fbl.data, j, acc.data, f))
                    T.tvm_storage_sync("shared")
                    _store_x(xv, gv, xf, ss, a_hi, a_lo, t, LDA, split, BM, fold, kt + 1 < K // BK)
                    store_w(qv, dv, mv, b_hi, b_lo, wv, hv, lv, t, BN, NT, LDB, fmt, split, 0, 0)
                if fold.norm:  # each row's sum of squares is spread over 8 lanes: 1/RMS into c_s after the tiles
                    for s in T.serial(BM * BK // 4 // NT):
                        for lanes in T.unroll(3):
                            ss[s] = ss[s] + shfl_xor(ss[s], 1 << lanes)
                        if t % (BK // 4) == 0:
                            c_s[NT // 32 * 256 + (s * NT + t) // (BK // 4)] = T.rsqrt(ss[s] / T.float32(K) + T.float32(fold.eps))
                    T.tvm_storage_sync("shared")
                for i in T.serial(FM):
                    for j in T.serial(FN):
                        T.evaluate(wmma_store(acc, i * FN + j, c_s, warp * 256, 16))
                        for s in T.serial(8):
                            e: T.let = s * 32 + t % 32
                            local: T.let = wm * WM + i * 16 + e // 16
                            row: T.let = bm * BM + T.Cast("int64", local)
                            col: T.let = bn * BN + wn * WN + j * 16 + e % 16
                            if row < M:
                                if fold.norm and fold.residual:
                                    y[row, col] = c_s[warp * 256 + e] * c_s[NT // 32 * 256 + local] + res[row, col]
                                elif fold.norm:
                                    y[row, col] = c_s[warp * 256 + e] * c_s[NT // 32 * 256 + local]
                                elif fold.residual:
                                    y[row, col] = c_s[warp * 256 + e] + res[row, col]
                                else:
                                    y[row, col] = c_s[warp * 256 + e]


def _kernel(wtype: str, N: int, K: int, BN: int, split: bool, BM: int, fold: Fold) -> tvm.tirx.PrimFunc:
    """One signature for every format and fold: x, the norm weight nw, the quants (or f16 weights) q,
    scales d, minimums mn, the residual res, y; formats without scales (f16) or minimums (all but
    Q4_1) and folds without a norm or a residual drop those."""
    G, NB = N // R, K // QUANT_BLOCK
    _, qshape, qdtype = weight_parts(wtype, N, K)[0]
    tile = (BM, BN, BK + PAD, BN + PAD, BM // 2, BN // 2, BM // 32, BN // 32)  # (macro arguments: constants here)

    @T.prim_func
    def f(x_h: T.handle, nw: T.Buffer((K,), "float32"), q: T.Buffer(qshape, qdtype), d: T.Buffer((G, NB, R), "float16"),
          mn: T.Buffer((G, NB, R), "float16"), res_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, K), "float32")
        res = T.match_buffer(res_h, (M, N), "float32")
        y = T.match_buffer(y_h, (M, N), "float32")
        _body(x, nw, q, d, mn, res, y, M, N, K, *tile, wtype, qdtype, split, fold)

    unused = absent_weight_params(wtype)
    unused |= {name for name, used in (("nw", fold.norm), ("res", fold.residual)) if not used}
    return without_params(f, unused)
