"""Linears over the row-interleaved weight layouts (core/layouts.py) with the quant bytes read as 32-bit
words: for any number of rows an unscheduled compute definition (dequantize + matmul) that dlight's matmul
rule schedules; for one row (decode variants) a matvec written here (dlight's rules gave the compute
definition one output row per thread).

A row group's R = 8 bytes at one (block, position) are two words: row r's byte is byte r % 4 of word
r // 4, so each byte is a shift and a mask of a word (q8_0: a signed byte, shifted up to the word's top
and arithmetically back down). The buffers keep their byte layout; only the element type the kernel
reads them as differs from the graph's (the runtime binds buffers, not typed tensors).
"""

from __future__ import annotations

import tvm
from tvm import te, tirx

from jitllm.core.layouts import QUANT_BLOCK, ROW_GROUP
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
"""Threads of a decode matvec's workgroup: one workgroup per row group of R rows, its threads striding
over the inputs (R partial sums each), then a tree in workgroup memory."""


def gemv_kernel(wtype: str, n: int, k: int) -> tuple[str, tvm.tirx.PrimFunc]:
    """One activation row: y[0, n] = W x, one workgroup per row group (R rows at once: the layout's
    interleaved rows share each quant word), threads over the inputs."""
    from tvm.script import tirx as T

    symbol = f"jl_wgsl_gemv_{wtype}_{n}x{k}"
    g, nb = n // R, k // QUANT_BLOCK
    steps = (k + NT - 1) // NT
    shapes = weight_parts(wtype, g, nb, k, lambda name, shape, dtype: (shape, dtype))
    (w_shape, w_dtype), (d_shape, d_dtype), (m_shape, _) = (shapes + [((1,), "float16")] * 2)[:3]

    @T.prim_func
    def f(x: T.Buffer((1, k), "float32"), w: T.Buffer(w_shape, w_dtype), d: T.Buffer(d_shape, d_dtype),
          mn: T.Buffer(m_shape, "float16"), y: T.Buffer((1, n), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for grp in T.thread_binding(g, thread="blockIdx.x"):
            for t in T.thread_binding(NT, thread="threadIdx.x"):
                acc = T.alloc_buffer((R,), "float32", scope="local")
                other = T.alloc_buffer((R,), "float32", scope="local")
                sums = T.alloc_buffer((NT * R,), "float32", scope="shared")
                for r in T.unroll(R):
                    acc[r] = T.float32(0)
                for i in T.serial(steps):
                    c: T.let = i * NT + t
                    if c < k:
                        xv: T.let = x[0, c]
                        for r in T.unroll(R):
                            acc[r] = acc[r] + weight_value(wtype, [w, d, mn], grp, r, c) * xv
                for r in T.unroll(R):
                    sums[t * R + r] = acc[r]
                T.tvm_storage_sync("shared")
                for level in T.unroll(6):  # NT = 2**6; read, wait, write (TVM cannot sync inside a condition)
                    half: T.let = NT >> (level + 1)
                    if t < half:
                        for r in T.unroll(R):
                            other[r] = sums[(t + half) * R + r]
                    T.tvm_storage_sync("shared")
                    if t < half:
                        for r in T.unroll(R):
                            acc[r] = acc[r] + other[r]
                            sums[t * R + r] = acc[r]
                    T.tvm_storage_sync("shared")
                if t < R:
                    y[0, grp * R + t] = sums[t]

    absent = {1: {"d", "mn"}, 2: {"mn"}, 3: set()}[len(shapes)]  # (the parameters this format has not)
    return symbol, without_params(f, absent).with_attr("global_symbol", symbol)
