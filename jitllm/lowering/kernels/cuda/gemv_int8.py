"""Decode matvecs over GGML-quantized weights with int8 activations (the CUDA "fast" kernel family).

llama.cpp's MMVQ trick on jitllm's row-interleaved layouts (core/layouts.py): the activation row is
quantized per 32-block to int8 (scale d_x = max|x|/127, round half to even, as the CPU fast kernels
do), and each block's dot product is an exact integer sum of `__dp4a` (four byte products per
instruction) straight on the stored bytes, scaled once by d_w * d_x. The exact kernels
(kernels/cuda/gemv.py) convert every weight to float and spend ~7 float operations on it; these spend
~1.5 integer operations per weight, which lets a Q4 matvec stream its bytes near the copy bandwidth.

Each thread block first quantizes the whole input row into shared memory: 8 lanes per 32-block, 4
columns each, the block's max|x| and Q4's item sums by `__shfl_xor_sync` (SwiGLU and the norm weight
folded in as the exact kernels fold them, the sum of squares reduced by shuffles too, the norm's 1/RMS
factor applied to the finished sums). Then it computes 1, 2 or 4 row groups of 8 rows (as many as keep
at least 256 thread blocks), so the quantization is shared; every item of every row group is
independent, so all their loads are in flight at once, and the partial sums of all the block's rows
meet in shared memory once. (Quantizing serially, one thread per 32-block, and summing each row group
before loading the next measured ~30% slower on the H200.) A work item is 4 byte columns of one 32-block of the 8
rows: 32 contiguous bytes, j-major ([column][row]); eight `__byte_perm`s turn each half (4 rows) into
one 4-byte word per row, the dp4a operand. Q4 items cover columns j..j+3 (low nibbles) and
j+16..j+19 (high nibbles); Q4_0's offset of 8 is subtracted as 8 * (sum of those 8 int8 activations),
precomputed per item, and Q4_1's minimum multiplies the same sum times d_x.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import QUANT_BLOCK, ROW_GROUP
from jitllm.ir.ops import LINEAR
from jitllm.lowering.kernels.cuda.basic import (
    absent_weight_params,
    await_previous_kernel,
    dependent_launch,
    shfl_xor,
)
from jitllm.lowering.kernels.cuda.gemv import Fold, threads_for
from jitllm.lowering.kernels.formats import without_params

R = ROW_GROUP
FORMATS = ("q8_0", "q4_0", "q4_1")
NIBBLES = 0x0F0F0F0F


def int8_gemv_kernel(wtype: str, n: int, k: int, family: str = LINEAR, eps: float = 0.0,
                     groups: int | None = None, dependent: bool = False) -> tuple[str, tvm.tirx.PrimFunc]:
    """Same parameters as kernels_gpu_gemv.gemv_kernel (x [1, K] or [1, 2K], the norm weight, the
    weight parts, the residual, y [1, N/R, R]); `groups`: row groups per thread block (default:
    as many as keep at least 256 thread blocks); `dependent`: launched dependent
    (kernels_gpu.await_previous_kernel)."""
    if wtype not in FORMATS:
        raise ValueError(f"int8-activation matvec takes {', '.join(FORMATS)}, not {wtype}")
    fold = Fold.of(family, eps)
    G = n // R
    rg = groups or groups_per_block(G)
    symbol = f"jl_gpu_gemv8_{wtype}_{n}x{k}_g{rg}" + fold.suffix(family)
    func = _kernel(wtype, G, k, rg, fold, dependent)
    func = without_params(func, {name for name, used in (("nw", fold.norm), ("res", fold.residual)) if not used})
    return symbol, dependent_launch(func, dependent).with_attr("global_symbol", symbol)


def groups_per_block(G: int) -> int:
    """Row groups per thread block: as many (up to 4) as keep at least 256 thread blocks (~2 per SM of
    an H200), so the input's quantization is shared without starving the GPU of blocks."""
    return next(c for c in (4, 2, 1) if G % c == 0 and G // c >= 256 or c == 1)


def _perm(a, b, selector: int):
    return T.call_pure_extern("uint32", "__byte_perm", a, b, T.uint32(selector))


def _dp4a(a, b, c):
    return T.call_pure_extern("int32", "__dp4a", a, b, c)


@T.macro
def _quantize_chunk(v, u, nl, qi, x, nw, xq, xd, xs, ss, ch, valid, K, fold, q4):
    """Columns 4ch..4ch+3 of the input (one lane of the 8 that share their 32-block ch // 8) -> their
    int8 word xq[ch]; lane 0 of the 8 stores the block's scale xd, and (Q4) lanes 0..3 the item sums
    xs[4b + c] = sum of the int8 values of columns 4c..4c+3 and 16+4c..16+4c+3 of block b. Every lane
    of the warp runs the shuffles (`valid` only guards the loads' effect and the stores)."""
    for c in T.vectorized(4):
        v[c] = x[0, ch * 4 + c]
    if fold.swiglu:
        for c in T.vectorized(4):
            u[c] = x[0, K + ch * 4 + c]
        for c in T.unroll(4):
            v[c] = v[c] / (T.float32(1) + T.exp(T.float32(0) - v[c])) * u[c]
    if fold.norm:
        for c in T.vectorized(4):
            nl[c] = nw[ch * 4 + c]
        for c in T.unroll(4):
            ss[0] = ss[0] + T.if_then_else(valid, v[c] * v[c], T.float32(0))
            v[c] = v[c] * nl[c]
    m0: T.let = T.max(T.max(T.abs(v[0]), T.abs(v[1])), T.max(T.abs(v[2]), T.abs(v[3])))
    m1: T.let = T.max(m0, shfl_xor(m0, 1))
    m2: T.let = T.max(m1, shfl_xor(m1, 2))
    amax: T.let = T.max(m2, shfl_xor(m2, 4))
    inv: T.let = T.if_then_else(amax > T.float32(0), T.float32(127) / amax, T.float32(0))
    for c in T.unroll(4):
        qi[c] = T.Cast("int32", T.nearbyint(v[c] * inv))
    if q4:
        part: T.let = qi[0] + qi[1] + qi[2] + qi[3]
        pair: T.let = part + shfl_xor(part, 4, "int32")
        if valid and ch % 8 < 4:
            xs[ch // 8 * 4 + ch % 8] = pair
    if valid:
        xq[ch] = T.reinterpret("int32", T.bitwise_or(
            T.bitwise_or(T.bitwise_and(T.Cast("uint32", qi[0]), T.uint32(255)),
                         T.shift_left(T.bitwise_and(T.Cast("uint32", qi[1]), T.uint32(255)), T.uint32(8))),
            T.bitwise_or(T.shift_left(T.bitwise_and(T.Cast("uint32", qi[2]), T.uint32(255)), T.uint32(16)),
                         T.shift_left(T.Cast("uint32", qi[3]), T.uint32(24)))))
        if ch % 8 == 0:
            xd[ch // 8] = amax / T.float32(127)


@T.macro
def _load_item(wl, qw, base):
    """32 bytes (two 16-byte loads): wl[2j + h] = byte column j of the item, rows 4h..4h+3."""
    for c in T.vectorized(4):
        wl[c] = qw[base + c]
    for c in T.vectorized(4):
        wl[4 + c] = qw[base + 4 + c]


@T.macro
def _rows_of_half(rw, wl, h):
    """rw[i] = row 4h+i's four bytes of the item (columns in order): a 4x4 byte transpose."""
    ab_lo: T.let = _perm(wl[h], wl[2 + h], 0x5140)  # [A0 B0 A1 B1]
    ab_hi: T.let = _perm(wl[h], wl[2 + h], 0x7362)  # [A2 B2 A3 B3]
    cd_lo: T.let = _perm(wl[4 + h], wl[6 + h], 0x5140)
    cd_hi: T.let = _perm(wl[4 + h], wl[6 + h], 0x7362)
    rw[0] = _perm(ab_lo, cd_lo, 0x5410)
    rw[1] = _perm(ab_lo, cd_lo, 0x7632)
    rw[2] = _perm(ab_hi, cd_hi, 0x5410)
    rw[3] = _perm(ab_hi, cd_hi, 0x7632)


@T.macro
def _q4_item(acc, o, wl, rw, dl, ml, qw, d, mn, xq, xd, xs, g, e, NB, q4_1):
    """Item e (32-block e // 4, byte columns 4(e % 4)..+3) of row group g into the R partial sums acc[o:o+R]."""
    b: T.let = e // 4
    c: T.let = e % 4
    _load_item(wl, qw, ((g * NB + b) * 16 + c * 4) * 2)
    for r in T.vectorized(R):
        dl[r] = d[g, b, r]
    if q4_1:
        for r in T.vectorized(R):
            ml[r] = mn[g, b, r]
    xlo: T.let = xq[b * 8 + c]
    xhi: T.let = xq[b * 8 + 4 + c]
    dx: T.let = xd[b]
    s: T.let = xs[b * 4 + c]
    for h in T.unroll(2):
        _rows_of_half(rw, wl, h)
        for i in T.unroll(4):
            lo: T.let = T.reinterpret("int32", T.bitwise_and(rw[i], T.uint32(NIBBLES)))
            hi: T.let = T.reinterpret("int32", T.bitwise_and(T.shift_right(rw[i], T.uint32(4)), T.uint32(NIBBLES)))
            si: T.let = _dp4a(hi, xhi, _dp4a(lo, xlo, 0))
            if q4_1:
                acc[o + 4 * h + i] = acc[o + 4 * h + i] + dx * (T.Cast("float32", dl[4 * h + i]) * T.Cast("float32", si)
                                                        + T.Cast("float32", ml[4 * h + i]) * T.Cast("float32", s))
            else:
                acc[o + 4 * h + i] = acc[o + 4 * h + i] + dx * T.Cast("float32", dl[4 * h + i]) * T.Cast("float32", si - 8 * s)


@T.macro
def _q8_0_item(acc, o, wl, rw, dl, qw, d, xq, xd, g, e, NB):
    """Item e (32-block e // 8, columns 4(e % 8)..+3) of row group g into the R partial sums acc[o:o+R]."""
    b: T.let = e // 8
    c: T.let = e % 8
    _load_item(wl, qw, ((g * NB + b) * 32 + c * 4) * 2)
    for r in T.vectorized(R):
        dl[r] = d[g, b, r]
    xw: T.let = xq[b * 8 + c]
    dx: T.let = xd[b]
    for h in T.unroll(2):
        _rows_of_half(rw, wl, h)
        for i in T.unroll(4):
            acc[o + 4 * h + i] = acc[o + 4 * h + i] + dx * T.Cast("float32", dl[4 * h + i]) * T.Cast(
                "float32", _dp4a(T.reinterpret("int32", rw[i]), xw, 0))


def _kernel(wtype: str, G: int, K: int, RG: int, fold: Fold, dependent: bool):
    NB = K // QUANT_BLOCK
    q4, q4_1 = wtype.startswith("q4"), wtype == "q4_1"
    ITEMS = NB * (4 if q4 else 8)  # per row group
    NT = threads_for(ITEMS, each=2)  # 32-byte items
    O = RG * R  # outputs per thread block
    CHUNKS = K // 4  # input columns in 4s, one lane each when quantizing
    WORDS = G * NB * (16 if q4 else 32) * R // 4
    XK = 2 * K if fold.swiglu else K
    QSHAPE, QTYPE = ((G, NB, 16, R), "uint8") if q4 else ((G, NB, 32, R), "int8")

    @T.prim_func
    def f(x: T.Buffer((1, XK), "float32"), nw: T.Buffer((K,), "float32"), qs: T.Buffer(QSHAPE, QTYPE),
          d: T.Buffer((G, NB, R), "float16"), mn: T.Buffer((G, NB, R), "float16"),
          res: T.Buffer((1, G, R), "float32"), y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for blk in T.thread_binding(G // RG, thread="blockIdx.x"):
            for t in T.thread_binding(NT, thread="threadIdx.x"):
                qw = T.decl_buffer((WORDS,), "uint32", data=qs.data)
                xq = T.alloc_buffer((CHUNKS,), "int32", scope="shared")
                xd = T.alloc_buffer((NB,), "float32", scope="shared")
                xs = T.alloc_buffer((NB * 4,), "int32", scope="shared")
                sq = T.alloc_buffer((NT // 32,), "float32", scope="shared")
                part = T.alloc_buffer((NT * (O + 1),), "float32", scope="shared")  # padded rows: no bank conflicts
                part2 = T.alloc_buffer((NT,), "float32", scope="shared")
                acc = T.alloc_buffer((O,), "float32", scope="local")
                ss = T.alloc_buffer((1,), "float32", scope="local")
                v = T.alloc_buffer((4,), "float32", scope="local")
                u = T.alloc_buffer((4,), "float32", scope="local")
                nl = T.alloc_buffer((4,), "float32", scope="local")
                qi = T.alloc_buffer((4,), "int32", scope="local")
                wl = T.alloc_buffer((8,), "uint32", scope="local")
                rw = T.alloc_buffer((4,), "uint32", scope="local")
                dl = T.alloc_buffer((R,), "float16", scope="local")
                ml = T.alloc_buffer((R,), "float16", scope="local")
                await_previous_kernel(dependent)
                ss[0] = T.float32(0)
                for it in T.unroll((CHUNKS + NT - 1) // NT):
                    _quantize_chunk(v, u, nl, qi, x, nw, xq, xd, xs, ss, T.min(it * NT + t, CHUNKS - 1),
                                    it * NT + t < CHUNKS, K, fold, q4)
                if fold.norm:  # the sum of squares: over the warp by shuffles, then over the warps
                    for m in T.unroll(5):
                        ss[0] = ss[0] + shfl_xor(ss[0], 16 >> m)
                    if t % 32 == 0:
                        sq[t // 32] = ss[0]
                T.tvm_storage_sync("shared")
                if fold.norm:
                    ss[0] = T.float32(0)
                    for i in T.unroll(NT // 32):
                        ss[0] = ss[0] + sq[i]
                    ss[0] = T.float32(1) / T.sqrt(ss[0] / T.float32(K) + T.float32(fold.eps))
                for j in T.unroll(O):
                    acc[j] = T.float32(0)
                for gi in T.unroll(RG):  # every item of every row group independent: loads all in flight
                    for step in T.unroll((ITEMS + NT - 1) // NT):
                        if step * NT + t < ITEMS:
                            if q4:
                                _q4_item(acc, gi * R, wl, rw, dl, ml, qw, d, mn, xq, xd, xs, blk * RG + gi,
                                         step * NT + t, NB, q4_1)
                            else:
                                _q8_0_item(acc, gi * R, wl, rw, dl, qw, d, xq, xd, blk * RG + gi, step * NT + t, NB)
                _sum_and_store(part, part2, acc, ss, t, blk, y, res, NT, O, RG, fold)

    return without_params(f, absent_weight_params(wtype))


@T.macro
def _sum_and_store(part, part2, acc, ss, t, blk, y, res, NT, O, RG, fold):
    """The threads' O partial sums -> shared memory -> thread (slice, o) sums O threads' values of output
    o -> threads 0..O-1 sum the NT / O slices and store (the norm's factor applied first, the residual
    added last)."""
    for j in T.unroll(O):
        part[t * (O + 1) + j] = acc[j] * ss[0] if fold.norm else acc[j]
    T.tvm_storage_sync("shared")
    acc[0] = T.float32(0)
    for i in T.unroll(O):
        acc[0] = acc[0] + part[(t // O * O + i) * (O + 1) + t % O]
    part2[t] = acc[0]
    T.tvm_storage_sync("shared")
    if t < O:
        acc[1] = T.float32(0)
        for sl in T.unroll(NT // O):
            acc[1] = acc[1] + part2[sl * O + t]
        if fold.residual:
            acc[1] = acc[1] + res[0, blk * RG + t // R, t % R]
        y[0, blk * RG + t // R, t % R] = acc[1]
