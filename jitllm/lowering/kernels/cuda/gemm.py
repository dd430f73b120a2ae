"""The fast family's prefill linears in two kernels: an operand pass that writes the activations once as
f16 (with the norm or SwiGLU the linear folds applied there), then a GEMM on tensor cores over f16
operands: `ldmatrix` fragments and `mma.sync` m16n8k16 with f32 accumulators, activations and weights
staged through a ring of shared-memory stages (the activations by `cp.async` or through registers,
the weights, dequantized where quantized, through registers, two steps ahead), the fragments of the
next k16 step loaded before this step's products, the residual added as the accumulators are stored.

Against the one-kernel WMMA linear (kernels_gpu_mma), which converts f32 activations (and applies the
norm) in every column tile and cannot fold SwiGLU (every column tile would recompute it): on the H200
at 512 rows the 3B shape's four projections take 460 us instead of 600 (f16) and 465 instead of 690
(Q4_0); the operand passes add 4-9 us each and replace SwiGLU's own elementwise pass.

Shared rows are padded by 8 halves (16 bytes), so the eight 16-byte rows an `ldmatrix` reads fall on
distinct banks. Rows past M read row M - 1 and are not stored. Error: f16 activations times f16 (or
dequantized, rounded to f16) weights with f32 sums, ~2e-4 of the largest output for quantized weights,
as the WMMA fast kernel and llama.cpp's f16 GEMMs have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import QUANT_BLOCK, ROW_GROUP, weight_parts
from jitllm.ir.ops import NORM_LINEAR, SWIGLU_LINEAR_ADD
from jitllm.lowering.kernels.cuda.basic import absent_weight_params, shfl_xor
from jitllm.lowering.kernels.cuda.mma import WMMA_FORMATS, load_w, store_w
from jitllm.lowering.kernels.formats import without_params

R = ROW_GROUP
BK = QUANT_BLOCK
PAD = 8
OPERAND_THREADS = 128
GEMM_FORMATS = WMMA_FORMATS


@dataclass(frozen=True)
class Tiling:
    """A thread block's BM x BN output tile, its warps' grid, the shared-memory stages, the K step, and
    whether the activations arrive by cp.async (else through registers, as the weights always do:
    f16 weights by cp.async measured 30-50% slower on the H200, their stores to shared memory being
    the same either way)."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int
    stages: int
    bk: int
    async_a: bool
    splits: int = 1  # K split over this many thread blocks per tile, their sums added by splitk_sum_kernel

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def name(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk}w{self.warps_m}x{self.warps_n}s{self.stages}" + ("c" if self.async_a else "")
                + (f"k{self.splits}" if self.splits > 1 else ""))


class PrefillGemm(NamedTuple):
    """A fast-family prefill linear's kernels, each (symbol, PrimFunc): the operand pass, the GEMM, and
    where the GEMM splits K into `splits` parts, the kernel adding their sums (else None)."""

    operand: tuple
    gemm: tuple
    split_sum: tuple | None
    splits: int


WIDE = Tiling(128, 128, 2, 4, 3, 64, True)
NARROW = Tiling(64, 64, 2, 2, 2, 64, False)


def tiling_for(n: int, k: int, wtype: str) -> Tiling:
    """Measured on the H200 (bench/gpu_kernels.py and stop 17's split-K comparison, 512 and 2048 rows of the
    3B shape): 128 x 128 tiles of 8 warps (each 64 x 32, activations by cp.async) for N >= 8192; for
    narrower outputs the same tiles with K split over 4 thread blocks where K >= 8192 (the down
    projection, 3072 x 8192 at 512 rows: 138 -> 102 us f16, 139 -> 108 us Q4_0) or over 2 for f16 weights
    (Q/K/V 92 -> 83 us, O 52.5 -> 53.8 us; at 2048 rows 326 -> 273 and 200 -> 169), the splits' sums
    added with the residual by splitk_sum_kernel; else 64 x 64 tiles of 4 warps (quantized Q/K/V and O:
    their split variants lost at 512 rows)."""
    if n % WIDE.bn:
        return NARROW
    if n >= 8192:
        return WIDE
    if k >= 8192 and k % (WIDE.bk * 4) == 0:
        return replace(WIDE, splits=4)
    if wtype == "f16" and k % (WIDE.bk * 2) == 0:
        return replace(WIDE, splits=2)
    return NARROW


def operand_prep(family: str) -> str:
    """What the operand pass does before rounding to f16, for a linear family."""
    return {NORM_LINEAR: "norm", SWIGLU_LINEAR_ADD: "swiglu"}.get(family, "convert")


def operand_kernel(family: str, k: int, eps: float = 0.0) -> tuple[str, tvm.tirx.PrimFunc]:
    """x [M, K] f32 ([M, 2K], gate then up, for SwiGLU) -> a [M, K] f16: x itself, x / RMS(x) · g
    (parameters x, nw, a), or silu(gate) · up; one thread block per row."""
    prep = operand_prep(family)
    symbol = f"jl_gpu_operand_f16_{prep}_{k}" + (f"_eps{np.float32(eps).view(np.uint32):08x}" if prep == "norm" else "")
    func = _operand(prep, k, eps)
    if prep != "norm":
        func = without_params(func, {"nw"})
    return symbol, func.with_attr("global_symbol", symbol)


def _operand(prep: str, K: int, eps: float) -> tvm.tirx.PrimFunc:
    NT = OPERAND_THREADS
    KI = 2 * K if prep == "swiglu" else K
    CH = (K // 4 + NT - 1) // NT  # four columns per item, items per thread
    norm, swiglu = prep == "norm", prep == "swiglu"

    # a root block (s_tir): Relax's RewriteDataflowReshape requires one of a one-input, one-output kernel
    @T.prim_func(s_tir=True)
    def f(x_h: T.handle, nw: T.Buffer((K,), "float32"), a_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, KI), "float32")
        a = T.match_buffer(a_h, (M, K), "float16")
        with T.sblock("root"):
            for row in T.thread_binding(M, thread="blockIdx.x"):
                for t in T.thread_binding(NT, thread="threadIdx.x"):
                    red = T.alloc_buffer((NT // 32,), "float32", scope="shared")
                    ss = T.alloc_buffer((1,), "float32", scope="local")
                    v = T.alloc_buffer((4,), "float32", scope="local")
                    u = T.alloc_buffer((4,), "float32", scope="local")
                    h = T.alloc_buffer((4,), "float16", scope="local")
                    if norm:
                        ss[0] = T.float32(0)
                        for i in T.serial(CH):
                            if i * NT + t < K // 4:
                                for e in T.vectorized(4):
                                    v[e] = x[row, (i * NT + t) * 4 + e]
                                for e in T.serial(4):
                                    ss[0] = ss[0] + v[e] * v[e]
                        for lanes in T.unroll(5):
                            ss[0] = ss[0] + shfl_xor(ss[0], 1 << lanes)
                        if t % 32 == 0:
                            red[t // 32] = ss[0]
                        T.tvm_storage_sync("shared")
                        ss[0] = T.float32(0)
                        for w in T.serial(NT // 32):
                            ss[0] = ss[0] + red[w]
                        ss[0] = T.rsqrt(ss[0] / T.float32(K) + T.float32(eps))
                    for i in T.serial(CH):
                        c: T.let = i * NT + t
                        if c < K // 4:
                            for e in T.vectorized(4):
                                v[e] = x[row, c * 4 + e]
                            if swiglu:
                                for e in T.vectorized(4):
                                    u[e] = x[row, K + c * 4 + e]
                                for e in T.serial(4):
                                    h[e] = T.Cast("float16", v[e] / (T.float32(1) + T.exp(T.float32(0) - v[e])) * u[e])
                            elif norm:
                                for e in T.serial(4):
                                    h[e] = T.Cast("float16", v[e] * ss[0] * nw[c * 4 + e])
                            else:
                                for e in T.serial(4):
                                    h[e] = T.Cast("float16", v[e])
                            for e in T.vectorized(4):
                                a[row, c * 4 + e] = h[e]

    return f


def gemm_kernel(wtype: str, n: int, k: int, residual: bool = False,
                tiling: Tiling | None = None) -> tuple[str, tvm.tirx.PrimFunc] | None:
    """y [M, N] = a [M, K] (f16) · Wᵀ (+ res [M, N] where `residual`), or None where the shape does not
    tile (N not a multiple of 64, f32 weights). `tiling`: tiling_for(n, k, wtype) unless given (K steps
    of 32 where K is no multiple of 64). With K split (tiling.splits > 1) the kernel stores each split's
    sums, y [splits, M, N], and takes no residual: splitk_sum_kernel adds them."""
    tiling = tiling or tiling_for(n, k, wtype)
    if k % tiling.bk:
        tiling = replace(tiling, bk=BK)
    if wtype not in GEMM_FORMATS or k % tiling.bk or not _fits(wtype, n, k, tiling):
        return None
    symbol = f"jl_gpu_gemm_{wtype}_{n}x{k}_{tiling.name}" + ("_add" if residual and tiling.splits == 1 else "")
    return symbol, _gemm(wtype, n, k, tiling, residual).with_attr("global_symbol", symbol)


def splitk_sum_kernel(n: int, splits: int, residual: bool) -> tuple[str, tvm.tirx.PrimFunc]:
    """y [M, N] = the K splits' sums ws [splits, M, N] added (+ res [M, N]); one thread block per row,
    four columns per item."""
    symbol = f"jl_gpu_splitk_sum_{n}_s{splits}" + ("_add" if residual else "")
    NT = 128
    CH = (n // 4 + NT - 1) // NT

    # a root block (s_tir): Relax's RewriteDataflowReshape requires one of a one-input, one-output kernel
    @T.prim_func(s_tir=True)
    def f(ws_h: T.handle, res_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        ws = T.match_buffer(ws_h, (splits, M, n), "float32")
        res = T.match_buffer(res_h, (M, n), "float32")
        y = T.match_buffer(y_h, (M, n), "float32")
        with T.sblock("root"):
            for row in T.thread_binding(M, thread="blockIdx.x"):
                for t in T.thread_binding(NT, thread="threadIdx.x"):
                    v = T.alloc_buffer((4,), "float32", scope="local")
                    u = T.alloc_buffer((4,), "float32", scope="local")
                    for i in T.unroll(CH):
                        c: T.let = i * NT + t
                        if c < n // 4:
                            if residual:
                                for e in T.vectorized(4):
                                    v[e] = res[row, c * 4 + e]
                            else:
                                for e in T.vectorized(4):
                                    v[e] = T.float32(0)
                            for sp in T.unroll(splits):
                                for e in T.vectorized(4):
                                    u[e] = ws[sp, row, c * 4 + e]
                                for e in T.serial(4):
                                    v[e] = v[e] + u[e]
                            for e in T.vectorized(4):
                                y[row, c * 4 + e] = v[e]

    func = f if residual else without_params(f, {"res"})
    return symbol, func.with_attr("global_symbol", symbol)


def _fits(wtype: str, n: int, k: int, tl: Tiling) -> bool:
    """Whether every thread gets whole items of the tile's loads, and every split whole K steps."""
    weight_items = tl.bn // R * BK // (1 if wtype in ("f16", "q8_0") else 2)
    return (n % tl.bn == 0 and weight_items % tl.threads == 0 and tl.bm * tl.bk // 8 % tl.threads == 0
            and k % (tl.bk * tl.splits) == 0)


def ldmatrix(frag, at: int, buf, offset, trans: bool):
    """Four 8 x 8 f16 matrices from shared `buf` (this lane's row at `offset`) into `frag` from `at`."""
    return T.ptx_legacy.ldmatrix(trans, 4, ".b16", frag.data, at,
                                 T.tvm_access_ptr(T.type_annotation("float16"), buf.data, 0, 1, 1), offset,
                                 dtype="float16")


def mma(fa, a_at, fb, b_at, acc, c_at):
    """acc[c_at:+4] += A (m16 x k16, fa from a_at) · B (k16 x n8, fb from b_at): f16 in, f32 sums."""
    return T.ptx_legacy.mma("m16n8k16", "row", "col", "fp16", "fp16", "fp32", fa.data, a_at, fb.data, b_at,
                            acc.data, c_at, False, dtype="float32")


@T.macro
def _copy_a(a, a_s, M, bm, kt, stage, t, BM, TK, NT, LDA):
    """a[bm*BM : +BM, kt*TK : +TK] into stage `stage` of a_s, 16 bytes per cp.async."""
    for s in T.unroll(BM * TK // 8 // NT):
        c: T.let = s * NT + t
        src: T.let = T.min(bm * BM + T.Cast("int64", c // (TK // 8)), M - 1)
        T.evaluate(T.ptx["cp.async.cg.shared.global"](
            T.address_of(a_s[stage * BM * LDA + c // (TK // 8) * LDA + c % (TK // 8) * 8]),
            T.address_of(a[src, kt * TK + c % (TK // 8) * 8]), 16))


@T.macro
def _load_a(a, av, M, bm, kt, t, BM, TK, NT):
    """a[bm*BM : +BM, kt*TK : +TK] into registers, 8 halves per item."""
    for s in T.unroll(BM * TK // 8 // NT):
        c: T.let = s * NT + t
        src: T.let = T.min(bm * BM + T.Cast("int64", c // (TK // 8)), M - 1)
        for v in T.vectorized(8):
            av[s * 8 + v] = a[src, kt * TK + c % (TK // 8) * 8 + v]


@T.macro
def _store_a(av, a_s, stage, t, BM, TK, NT, LDA):
    """The registers of _load_a into stage `stage` of a_s."""
    for s in T.unroll(BM * TK // 8 // NT):
        c: T.let = s * NT + t
        for v in T.vectorized(8):
            a_s[stage * BM * LDA + c // (TK // 8) * LDA + c % (TK // 8) * 8 + v] = av[s * 8 + v]


@T.macro
def _fragments(fa, fb, a_s, b_s, stage, ks, half, lane, wm, wn, BM, TK, LDA, LDB, WM, WN, FM, FN):
    """The warp's A (m16 x k16) and B (k16 x n8) fragments for step `ks` of the tile in `stage` into
    fragment set `half` (two sets: the next step's loads are issued before this step's products)."""
    for i in T.unroll(FM):
        T.evaluate(ldmatrix(fa, (half * FM + i) * 8, a_s, stage * BM * LDA
                            + (wm * WM + i * 16 + lane % 16) * LDA + ks * 16 + lane // 16 * 8, False))
    for j in T.unroll(FN // 2):
        T.evaluate(ldmatrix(fb, (half * FN + j * 2) * 4, b_s, stage * TK * LDB
                            + (ks * 16 + lane % 16) * LDB + wn * WN + j * 16 + lane // 16 * 8, True))


@T.macro
def _load_weights(q, d, mn, qv, dv, mv, bn, kt, t, BN, NT, fmt, TK):
    """The weights of step kt (TK / 32 quantization blocks) into registers."""
    for h in T.unroll(TK // QUANT_BLOCK):
        load_w(q, d, mn, qv, dv, mv, bn, kt * (TK // QUANT_BLOCK) + h, t, BN, NT, fmt, h * (BN * QUANT_BLOCK // NT))


@T.macro
def _store_weights(qv, dv, mv, b_s, wv, hv, t, BN, NT, LDB, fmt, stage, TK):
    """The weights in registers (a step's TK / 32 blocks), dequantized to f16, into shared stage `stage`."""
    for h in T.unroll(TK // QUANT_BLOCK):
        store_w(qv, dv, mv, b_s, b_s, wv, hv, hv, t, BN, NT, LDB, fmt, False, (stage * TK + h * QUANT_BLOCK) * LDB,
                h * (BN * QUANT_BLOCK // NT))


@T.macro
def _body(a, q, d, mn, res, y, M, N, KT, BM, BN, TK, WARPS_N, STAGES, NT, LDA, LDB, WM, WN, FM, FN, fmt, qdtype,
          residual, async_a, S):
    """KT: steps of TK over K (S > 1: each of the S thread blocks of a tile takes KT / S of them and stores
    its sums as y[split]); WM x WN: a warp's tile, FM x FN: its m16 x n8 fragments. Tiles in
    registers are stored to shared memory one step ahead of the products and loaded two steps ahead.
    Row tiles are the fast grid index: the thread blocks that share a column tile of W run together, so
    W streams from memory once while the activations (a few MB) stay in L2."""
    for bm in T.thread_binding((M + BM - 1) // BM, thread="blockIdx.x"):
        for bn in T.thread_binding(N // BN, thread="blockIdx.y"):
            for sp in T.thread_binding(S, thread="blockIdx.z"):
                for t in T.thread_binding(NT, thread="threadIdx.x"):
                    a_s = T.alloc_buffer((STAGES * BM * LDA,), "float16", scope="shared.dyn")
                    b_s = T.alloc_buffer((STAGES * TK * LDB,), "float16", scope="shared.dyn")
                    fa = T.alloc_buffer((2 * FM * 8,), "float16", scope="local")
                    fb = T.alloc_buffer((2 * FN * 4,), "float16", scope="local")
                    acc = T.alloc_buffer((FM * FN * 4,), "float32", scope="local")
                    av = T.alloc_buffer((BM * TK // NT,), "float16", scope="local")
                    qv = T.alloc_buffer((BN * TK // NT,), qdtype, scope="local")
                    dv = T.alloc_buffer((BN * TK // NT,), "float16", scope="local")
                    mv = T.alloc_buffer((BN * TK // NT,), "float16", scope="local")
                    wv = T.alloc_buffer((R,), "float32", scope="local")
                    hv = T.alloc_buffer((R,), "float16", scope="local")
                    lane: T.let = t % 32
                    wm: T.let = t // 32 // WARPS_N
                    wn: T.let = t // 32 % WARPS_N
                    KS: T.let = KT // S  # this split's steps, from step k0
                    k0: T.let = sp * (KT // S)
                    for i in T.serial(FM * FN * 4):
                        acc[i] = T.float32(0)
                    if async_a:
                        for s in T.unroll(STAGES - 1):
                            if s < KS:
                                _copy_a(a, a_s, M, bm, k0 + s, s, t, BM, TK, NT, LDA)
                            T.evaluate(T.ptx["cp.async.commit_group"]())
                    else:  # tile 0 into stage 0 now, tile 1 into registers
                        _load_a(a, av, M, bm, k0, t, BM, TK, NT)
                        _store_a(av, a_s, 0, t, BM, TK, NT, LDA)
                        _load_a(a, av, M, bm, k0 + T.min(1, KS - 1), t, BM, TK, NT)
                    _load_weights(q, d, mn, qv, dv, mv, bn, k0, t, BN, NT, fmt, TK)
                    _store_weights(qv, dv, mv, b_s, wv, hv, t, BN, NT, LDB, fmt, 0, TK)
                    _load_weights(q, d, mn, qv, dv, mv, bn, k0 + T.min(1, KS - 1), t, BN, NT, fmt, TK)
                    for kt in T.serial(KS):
                        if async_a:
                            T.evaluate(T.ptx["cp.async.wait_group"](STAGES - 2))
                        T.tvm_storage_sync("shared")
                        if async_a:
                            if kt + STAGES - 1 < KS:
                                _copy_a(a, a_s, M, bm, k0 + kt + STAGES - 1, (kt + STAGES - 1) % STAGES, t, BM, TK, NT, LDA)
                            T.evaluate(T.ptx["cp.async.commit_group"]())
                        elif kt + 1 < KS:
                            _store_a(av, a_s, (kt + 1) % STAGES, t, BM, TK, NT, LDA)
                            _load_a(a, av, M, bm, k0 + T.min(kt + 2, KS - 1), t, BM, TK, NT)
                        if kt + 1 < KS:
                            _store_weights(qv, dv, mv, b_s, wv, hv, t, BN, NT, LDB, fmt, (kt + 1) % STAGES, TK)
                            _load_weights(q, d, mn, qv, dv, mv, bn, k0 + T.min(kt + 2, KS - 1), t, BN, NT, fmt, TK)
                        _fragments(fa, fb, a_s, b_s, kt % STAGES, 0, 0, lane, wm, wn, BM, TK, LDA, LDB, WM, WN, FM, FN)
                        for ks in T.unroll(TK // 16):
                            if ks + 1 < TK // 16:
                                _fragments(fa, fb, a_s, b_s, kt % STAGES, ks + 1, (ks + 1) % 2, lane, wm, wn, BM, TK,
                                           LDA, LDB, WM, WN, FM, FN)
                            for i in T.unroll(FM):
                                for j in T.unroll(FN):
                                    T.evaluate(mma(fa, (ks % 2 * FM + i) * 8, fb, (ks % 2 * FN + j) * 4, acc,
                                                   (i * FN + j) * 4))
                    for i in T.unroll(FM):
                        for j in T.unroll(FN):
                            for half in T.unroll(2):
                                row: T.let = bm * BM + T.Cast("int64", wm * WM + i * 16 + half * 8 + lane // 4)
                                col: T.let = bn * BN + wn * WN + j * 8 + lane % 4 * 2
                                if row < M:
                                    for e in T.vectorized(2):
                                        if S > 1:
                                            y[sp, row, col + e] = acc[(i * FN + j) * 4 + half * 2 + e]
                                        elif residual:
                                            y[row, col + e] = acc[(i * FN + j) * 4 + half * 2 + e] + res[row, col + e]
                                        else:
                                            y[row, col + e] = acc[(i * FN + j) * 4 + half * 2 + e]


def _gemm(wtype: str, N: int, K: int, tl: Tiling, residual: bool) -> tvm.tirx.PrimFunc:
    """Parameters a, the weight parts (f16: q; Q8_0 and Q4_0: q, d; Q4_1: q, d, mn), res (residual, K not
    split only), y ([splits, M, N] where K is split)."""
    G, NB, S = N // R, K // QUANT_BLOCK, tl.splits
    _, qshape, qdtype = weight_parts(wtype, N, K)[0]
    WM, WN = tl.bm // tl.warps_m, tl.bn // tl.warps_n
    shape = (K // tl.bk, tl.bm, tl.bn, tl.bk, tl.warps_n, tl.stages, tl.threads, tl.bk + PAD, tl.bn + PAD, WM, WN,
             WM // 16, WN // 8)
    adds = residual and S == 1  # (split K: the sum kernel adds the residual)

    @T.prim_func
    def f(a_h: T.handle, q: T.Buffer(qshape, qdtype), d: T.Buffer((G, NB, R), "float16"),
          mn: T.Buffer((G, NB, R), "float16"), res_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        a = T.match_buffer(a_h, (M, K), "float16")
        res = T.match_buffer(res_h, (M, N), "float32")
        y = T.match_buffer(y_h, (S, M, N) if S > 1 else (M, N), "float32")
        _body(a, q, d, mn, res, y, M, N, *shape, wtype, qdtype, adds, tl.async_a, S)

    return without_params(f, absent_weight_params(wtype) | (set() if adds else {"res"}))
