"""Linears over the row-interleaved weight layouts (core/layouts.py) with the quant bytes read as 32-bit
words: for any number of rows an unscheduled compute definition (dequantize + matmul) that dlight's matmul
rule schedules; for one row (decode variants) a matvec written here (dlight's rules gave the compute
definition one output row per thread).

A row group's R = 8 bytes at one (block, position) are two words: row r's byte is byte r % 4 of word
r // 4, so each byte is a shift and a mask of a word (q8_0: a signed byte, shifted up to the word's top
and arithmetically back down). The decode matvecs read the same bytes as 16-byte vectors instead
(vector_parts). The buffers keep their byte layout; only the element type the kernel reads them as
differs from the graph's (the runtime binds buffers, not typed tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import te, tirx

from jitllm.core.layouts import QUANT_BLOCK, ROW_GROUP
from jitllm.ir.ops import LINEAR, LINEAR_ADD, NORM_LINEAR, SWIGLU_LINEAR_ADD
from jitllm.lowering.kernels.formats import without_params

R = ROW_GROUP
WORD_ROWS = 4
"""Rows of a row group per 32-bit word of quant bytes."""
TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
"""The weight types these kernels read (the other formats have no WGSL kernel yet)."""


def _i32(v: int) -> tirx.IntImm:
    return tirx.IntImm("int32", v)


def weight_parts(wtype: str, g: int, nb: int, k: int, make) -> list:
    """The kernel's weight parameters for `wtype` (w; or qs, d and, q4_1, mn), each made by
    `make(name, shape, dtype)` (TE placeholders or TIR buffers)."""
    if wtype in ("f32", "f16"):
        return [make("w", (g, k, R), "float32" if wtype == "f32" else "float16")]
    if wtype not in ("q8_0", "q4_0", "q4_1"):
        raise ValueError(f"no WGSL linear kernel for {wtype} weights (only {', '.join(TYPES)})")
    per_block = 32 if wtype == "q8_0" else 16
    parts = [make("qs", (g, nb, per_block, R // WORD_ROWS), "int32" if wtype == "q8_0" else "uint32"),
             make("d", (g, nb, R), "float16")]
    return parts + ([make("mn", (g, nb, R), "float16")] if wtype == "q4_1" else [])


def weight_value(wtype: str, parts: list, grp, lane, col):
    """W[grp * R + lane, col] as float32 from the parts (TE tensors or TIR buffers, any index expressions)."""
    if wtype in ("f32", "f16"):
        return parts[0][grp, col, lane].astype("float32")
    qs, d = parts[0], parts[1]
    blk, j = col // QUANT_BLOCK, col % QUANT_BLOCK
    scale = d[grp, blk, lane].astype("float32")
    byte = lane % WORD_ROWS * 8
    if wtype == "q8_0":
        word = qs[grp, blk, j, lane // WORD_ROWS]
        return scale * tirx.shift_right(tirx.shift_left(word, (24 - byte)), _i32(24)).astype("float32")
    shift = (byte + j // 16 * 4).astype("uint32")
    nibble = tirx.bitwise_and(tirx.shift_right(qs[grp, blk, j % 16, lane // WORD_ROWS], shift), tirx.const(15, "uint32"))
    if wtype == "q4_0":
        return scale * (nibble.astype("float32") - 8.0)
    return scale * nibble.astype("float32") + parts[2][grp, blk, lane].astype("float32")


def linear_kernel(wtype: str, n: int, k: int, rows: int | None = None) -> tuple[str, tvm.tirx.PrimFunc]:
    """y[m, n] = x[m, k] @ W.T for `wtype` (one of TYPES) over `rows` rows (None: any number), as a
    compute definition for dlight (one row: gemv_kernel, which dlight's rules scheduled one row per thread)."""
    if rows == 1:
        return gemv_kernel(wtype, n, k)
    symbol = f"jl_wgsl_linear_{wtype}_{n}x{k}" + (f"_m{rows}" if rows else "")
    g, nb = n // R, k // QUANT_BLOCK
    m = _i32(rows) if rows else tirx.Var("m", "int32")
    x = te.placeholder((m, _i32(k)), "float32", name="x")
    parts = weight_parts(wtype, g, nb, k, lambda name, shape, dtype: te.placeholder([_i32(v) for v in shape], dtype,
                                                                                     name=name))
    wmat = te.compute((_i32(n), _i32(k)), lambda row, col: weight_value(wtype, parts, row // R, row % R, col),
                      name="dequant")
    red = te.reduce_axis((_i32(0), _i32(k)), name="k")
    y = te.compute((m, _i32(n)), lambda i, j: te.sum(x[i, red] * wmat[j, red], axis=red), name="matmul")
    func = te.create_prim_func([x, *parts, y])
    return symbol, func.with_attr("global_symbol", symbol)


NT = 64
"""Threads per row group of a decode matvec: they stride over the group's work items (R partial sums
each), then add them up a tree in workgroup memory."""
LEVELS = 6
"""log2(NT): the tree's levels."""
UNROLL = 4
"""Work items each thread loads before it computes on them: four 16-byte loads in flight a thread (a
SmolLM2-sized K = 576 is one round trip: Q4's 144 items a row group; a 3B's 3072 f16 columns twelve)."""
WIDE_GROUPS = 256
"""Row groups from which a workgroup takes two (two trees, one set of barriers; still >= 128 workgroups)."""
ITEM_COLUMNS = {"f32": 1, "f16": 1, "q8_0": 2, "q4_0": 4, "q4_1": 4}
"""Columns of one work item: what one 16-byte load of quant bytes holds (two 16-byte loads for f32)."""


def groups_per_workgroup(g: int) -> int:
    """Row groups a decode matvec's workgroup takes: two where there are enough to keep many workgroups."""
    return 2 if g % 2 == 0 and g >= WIDE_GROUPS else 1


@dataclass(frozen=True)
class Fold:
    """What a decode matvec does besides y = W x (jitllm.ir.ops' folded families): the norm weight
    applied to x as it is read, its sum of squares summed beside the dot products and its 1/RMS scaling
    the finished sums (the matvec is linear); SwiGLU of x's two halves as it is read; the residual added
    as rows are stored."""

    norm: bool = False
    swiglu: bool = False
    residual: bool = False
    eps: float = 0.0

    @classmethod
    def of(cls, family: str, eps: float = 0.0) -> "Fold":
        return {LINEAR: cls(), NORM_LINEAR: cls(norm=True, eps=eps), LINEAR_ADD: cls(residual=True),
                SWIGLU_LINEAR_ADD: cls(swiglu=True, residual=True)}[family]

    def suffix(self, family: str) -> str:
        """The family in a kernel's symbol, with the norm's eps as float bits (symbols take no '.')."""
        if family == LINEAR:
            return ""
        return f"_{family.lower()}" + (f"_eps{np.float32(self.eps).view(np.uint32):08x}" if self.norm else "")


def vector_parts(wtype: str, g: int, nb: int, k: int) -> list[tuple[tuple, str]]:
    """(shape, dtype) of the weight parts as the decode matvec reads them: 16-byte vectors over the
    same bytes (weight_parts' layout). f16 weights: a column's 8 rows, as four words of two halves;
    f32: a column as two vec4<f32>; Q8_0: two positions of a 32-block (a word per 4 rows each); Q4: two
    byte columns (4 columns); the scales and minimums: a (row group, block)'s 8 halves."""
    if wtype == "f32":
        return [((g, k, 2), "float32x4")]
    if wtype == "f16":
        return [((g, k, 1), "uint32x4")]
    if wtype not in ("q8_0", "q4_0", "q4_1"):
        raise ValueError(f"no WGSL linear kernel for {wtype} weights (only {', '.join(TYPES)})")
    qs = ((g, nb, 16, 1), "int32x4") if wtype == "q8_0" else ((g, nb, 8, 1), "uint32x4")
    return [qs, ((g, nb, 1), "uint32x4")] + ([((g, nb, 1), "uint32x4")] if wtype == "q4_1" else [])


def gemv_kernel(wtype: str, n: int, k: int, family: str = LINEAR, eps: float = 0.0) -> tuple[str, tvm.tirx.PrimFunc]:
    """One activation row: y[0, n] = W x (with `family`'s fold). Each row group of R rows (the layout's
    interleaved rows share every 16-byte load) has NT threads striding over its work items, UNROLL
    16-byte loads at a time (vector_parts: a column for float weights, two for Q8_0, four for Q4), R
    partial sums each and a tree in workgroup memory; a workgroup takes groups_per_workgroup row
    groups. Parameters: x [1, K] ([1, 2K], gate then up, for SwiGLU), the norm weight [K] (norm only),
    the weight parts, the residual [1, N/R, R] (residual only), y [1, N/R, R]."""
    from tvm.script import tirx as T

    fold = Fold.of(family, eps)
    symbol = f"jl_wgsl_gemv_{wtype}_{n}x{k}" + fold.suffix(family)
    g, nb = n // R, k // QUANT_BLOCK
    cols = ITEM_COLUMNS[wtype]
    items = k // cols
    steps = (items + NT * UNROLL - 1) // (NT * UNROLL)
    rg = groups_per_workgroup(g)
    xk = 2 * k if fold.swiglu else k
    S = R + 1  # (each thread's R sums and its sum of squares go up the tree together)
    shapes = vector_parts(wtype, g, nb, k)
    (w_shape, w_dtype), (d_shape, d_dtype), (m_shape, m_dtype) = (shapes + [((1, 1, 1), "uint32x4")] * 2)[:3]
    lane_words = 8 if wtype == "f32" else 4  # (scalars a work item's loads hold)
    wl_dtype = "float32" if wtype == "f32" else ("int32" if wtype == "q8_0" else "uint32")

    @T.macro
    def read_input(xv, i, acc, x, nw, c):
        """xv[i] = the matvec's input at column c: x, or silu(gate) * up; times the norm weight, its
        square added to the sum of squares first."""
        if fold.swiglu:
            xv[i] = x[0, c] / (T.float32(1) + T.exp(T.float32(0) - x[0, c])) * x[0, k + c]
        else:
            xv[i] = x[0, c]
        if fold.norm:
            acc[R] = acc[R] + xv[i] * xv[i]
            xv[i] = xv[i] * nw[c]

    @T.macro
    def load(wl, dl, ml, u, grp, e, w, d, mn):
        """Work item e's 16-byte loads into slot u of the thread's registers."""
        if wtype == "f32":
            wl[T.ramp(u * 8, 1, 4)] = w[grp, e, 0]
            wl[T.ramp(u * 8 + 4, 1, 4)] = w[grp, e, 1]
        elif wtype == "f16":
            wl[T.ramp(u * 4, 1, 4)] = w[grp, e, 0]
        elif wtype == "q8_0":
            wl[T.ramp(u * 4, 1, 4)] = w[grp, e // 16, e % 16, 0]
            dl[T.ramp(u * 4, 1, 4)] = d[grp, e // 16, 0]
        else:
            wl[T.ramp(u * 4, 1, 4)] = w[grp, e // 8, e % 8, 0]
            dl[T.ramp(u * 4, 1, 4)] = d[grp, e // 8, 0]
            if wtype == "q4_1":
                ml[T.ramp(u * 4, 1, 4)] = mn[grp, e // 8, 0]

    def half(words, u, r):
        """Row r's half (f16 weight, scale or minimum) of slot u's four words, as float32 (WGSL's
        unpack2x16float: naga rejects bitcast<vec2<f16>>)."""
        return T.Shuffle([T.call_pure_extern("float32x2", "unpack2x16float", words[u * 4 + r // 2])], [r % 2])

    @T.macro
    def compute(acc, xv, wl, dl, ml, u, e, x, nw):
        """Slot u's R partial sums added into acc (work item e)."""
        if wtype == "f32" or wtype == "f16":
            read_input(xv, 0, acc, x, nw, e)
            for r in T.unroll(R):
                if wtype == "f32":
                    acc[r] = acc[r] + wl[u * 8 + r] * xv[0]
                else:
                    acc[r] = acc[r] + half(wl, u, r) * xv[0]
        elif wtype == "q8_0":
            read_input(xv, 0, acc, x, nw, e * 2)
            read_input(xv, 1, acc, x, nw, e * 2 + 1)
            for r in T.unroll(R):
                q0: T.let = T.shift_right(T.shift_left(wl[u * 4 + r // 4], 24 - r % 4 * 8), 24)
                q1: T.let = T.shift_right(T.shift_left(wl[u * 4 + 2 + r // 4], 24 - r % 4 * 8), 24)
                acc[r] = acc[r] + half(dl, u, r) * (T.Cast("float32", q0) * xv[0] + T.Cast("float32", q1) * xv[1])
        else:
            c: T.let = e // 8 * 32 + e % 8 * 2  # (the item's byte columns j, j + 1: columns c, c+1, c+16, c+17)
            read_input(xv, 0, acc, x, nw, c)
            read_input(xv, 1, acc, x, nw, c + 1)
            read_input(xv, 2, acc, x, nw, c + 16)
            read_input(xv, 3, acc, x, nw, c + 17)
            xs: T.let = xv[0] + xv[1] + xv[2] + xv[3]
            for r in T.unroll(R):
                b0: T.let = T.shift_right(wl[u * 4 + r // 4], T.Cast("uint32", r % 4 * 8))
                b1: T.let = T.shift_right(wl[u * 4 + 2 + r // 4], T.Cast("uint32", r % 4 * 8))
                dot: T.let = (T.Cast("float32", T.bitwise_and(b0, T.uint32(15))) * xv[0]
                              + T.Cast("float32", T.bitwise_and(b1, T.uint32(15))) * xv[1]
                              + T.Cast("float32", T.bitwise_and(T.shift_right(b0, T.uint32(4)), T.uint32(15))) * xv[2]
                              + T.Cast("float32", T.bitwise_and(T.shift_right(b1, T.uint32(4)), T.uint32(15))) * xv[3])
                if wtype == "q4_1":
                    acc[r] = acc[r] + half(dl, u, r) * dot + half(ml, u, r) * xs
                else:
                    acc[r] = acc[r] + half(dl, u, r) * (dot - T.float32(8) * xs)

    @T.prim_func
    def f(x: T.Buffer((1, xk), "float32"), nw: T.Buffer((k,), "float32"), w: T.Buffer(w_shape, w_dtype),
          d: T.Buffer(d_shape, d_dtype), mn: T.Buffer(m_shape, m_dtype), res: T.Buffer((1, g, R), "float32"),
          y: T.Buffer((1, g, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for wg in T.thread_binding(g // rg, thread="blockIdx.x"):
            for tid in T.thread_binding(NT * rg, thread="threadIdx.x"):
                acc = T.alloc_buffer((S,), "float32", scope="local")
                other = T.alloc_buffer((S,), "float32", scope="local")
                xv = T.alloc_buffer((4,), "float32", scope="local")
                wl = T.alloc_buffer((UNROLL * lane_words,), wl_dtype, scope="local")
                dl = T.alloc_buffer((UNROLL * 4,), "uint32", scope="local")
                ml = T.alloc_buffer((UNROLL * 4,), "uint32", scope="local")
                sums = T.alloc_buffer((rg * NT * S,), "float32", scope="shared")
                grp: T.let = wg * rg + tid // NT
                t: T.let = tid % NT
                for r in T.unroll(S):
                    acc[r] = T.float32(0)
                for i in T.serial(steps):
                    for u in T.unroll(UNROLL):
                        if (i * UNROLL + u) * NT + t < items:
                            load(wl, dl, ml, u, grp, (i * UNROLL + u) * NT + t, w, d, mn)
                    for u in T.unroll(UNROLL):
                        if (i * UNROLL + u) * NT + t < items:
                            compute(acc, xv, wl, dl, ml, u, (i * UNROLL + u) * NT + t, x, nw)
                for r in T.unroll(S):
                    sums[tid * S + r] = acc[r]
                T.tvm_storage_sync("shared")
                for level in T.unroll(LEVELS):  # read, wait, write (TVM cannot sync inside a condition)
                    h: T.let = NT >> (level + 1)
                    if t < h:
                        for r in T.unroll(S):
                            other[r] = sums[(tid + h) * S + r]
                    T.tvm_storage_sync("shared")
                    if t < h:
                        for r in T.unroll(S):
                            acc[r] = acc[r] + other[r]
                            sums[tid * S + r] = acc[r]
                    T.tvm_storage_sync("shared")
                if t < R:
                    other[0] = sums[(tid - t) * S + t]
                    if fold.norm:
                        other[0] = other[0] / T.sqrt(sums[(tid - t) * S + R] / T.float32(k) + T.float32(fold.eps))
                    if fold.residual:
                        other[0] = other[0] + res[0, grp, t]
                    y[0, grp, t] = other[0]

    absent = {1: {"d", "mn"}, 2: {"mn"}, 3: set()}[len(shapes)]  # (the parameters this format has not)
    absent |= {name for name, used in (("nw", fold.norm), ("res", fold.residual)) if not used}
    return symbol, without_params(f, absent).with_attr("global_symbol", symbol)


EMBED_THREADS = 64


def embedding_kernel(wtype: str, vocab: int, hidden: int) -> tuple[str, tvm.tirx.PrimFunc]:
    """ids [1, n] (int32) -> x [1, n, hidden] (f32): rows of the tied head's [vocab, hidden] weights (its
    parts as the linears read them, quant bytes as words), dequantized as the host's lookup does
    (core/quant.dequantize_rows). One thread per value; a pipelined decode step gathers its token's row
    here (the token the step before left on the device), and a prompt its rows."""
    symbol = f"jl_wgsl_embedding_{wtype}_{vocab}x{hidden}"
    g, nb = vocab // R, hidden // QUANT_BLOCK
    n = tirx.Var("n", "int32")
    ids = te.placeholder((_i32(1), n), "int32", name="ids")
    parts = weight_parts(wtype, g, nb, hidden, lambda name, shape, dtype: te.placeholder([_i32(v) for v in shape],
                                                                                         dtype, name=name))
    x = te.compute((_i32(1), n, _i32(hidden)),
                   lambda b, t, c: weight_value(wtype, parts, ids[b, t] // R, ids[b, t] % R, c), name="x")
    func = te.create_prim_func([ids, *parts, x])
    return symbol, _schedule_elementwise(func, "x").with_attr("global_symbol", symbol)


def _schedule_elementwise(func: tvm.tirx.PrimFunc, block: str) -> tvm.tirx.PrimFunc:
    """One thread per element of `block`'s output, EMBED_THREADS to a workgroup."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    b = sch.get_sblock(block)
    fused = sch.fuse(*sch.get_loops(b))
    outer, inner = sch.split(fused, [None, EMBED_THREADS])
    sch.bind(outer, "blockIdx.x")
    sch.bind(inner, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
