"""Linears over the row-interleaved weight layouts (core/layouts.py) with the quant bytes read as 32-bit
words: an unscheduled compute definition (dequantize + matmul) that dlight schedules for WebGPU, GEMV
rules for one row and matmul rules for more.

A row group's R = 8 bytes at one (block, position) are two words: row r's byte is byte r % 4 of word
r // 4, so each byte is a shift and a mask of a word (q8_0: a signed byte, shifted up to the word's top
and arithmetically back down). The buffers keep their byte layout; only the element type the kernel
reads them as differs from the graph's (the runtime binds buffers, not typed tensors).
"""

from __future__ import annotations

import tvm
from tvm import te, tirx

from jitllm.core.layouts import QUANT_BLOCK, ROW_GROUP

R = ROW_GROUP
WORD_ROWS = 4
"""Rows of a row group per 32-bit word of quant bytes."""
TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
"""The weight types these kernels read (the other formats have no WGSL kernel yet)."""


def _i32(v: int) -> tirx.IntImm:
    return tirx.IntImm("int32", v)


def linear_kernel(wtype: str, n: int, k: int, rows: int | None = None) -> tuple[str, tvm.tirx.PrimFunc]:
    """y[m, n] = x[m, k] @ W.T for `wtype` (one of TYPES) over `rows` rows (None: any number)."""
    symbol = f"jl_wgsl_linear_{wtype}_{n}x{k}" + (f"_m{rows}" if rows else "")
    g, nb = n // R, k // QUANT_BLOCK
    m = _i32(rows) if rows else tirx.Var("m", "int32")
    x = te.placeholder((m, _i32(k)), "float32", name="x")
    if wtype in ("f32", "f16"):
        w = te.placeholder((_i32(g), _i32(k), _i32(R)), "float32" if wtype == "f32" else "float16", name="w")
        parts = [w]

        def weight(row, col):
            return w[row // R, col, row % R].astype("float32")
    elif wtype in ("q8_0", "q4_0", "q4_1"):
        per_block = 32 if wtype == "q8_0" else 16
        qs = te.placeholder((_i32(g), _i32(nb), _i32(per_block), _i32(R // WORD_ROWS)),
                            "int32" if wtype == "q8_0" else "uint32", name="qs")
        d = te.placeholder((_i32(g), _i32(nb), _i32(R)), "float16", name="d")
        parts = [qs, d]
        if wtype == "q4_1":
            mn = te.placeholder((_i32(g), _i32(nb), _i32(R)), "float16", name="mn")
            parts.append(mn)

        def weight(row, col):
            grp, lane, blk, j = row // R, row % R, col // QUANT_BLOCK, col % QUANT_BLOCK
            scale = d[grp, blk, lane].astype("float32")
            byte = lane % WORD_ROWS * 8
            if wtype == "q8_0":
                word = qs[grp, blk, j, lane // WORD_ROWS]
                value = tirx.shift_right(tirx.shift_left(word, (24 - byte)), _i32(24))
                return scale * value.astype("float32")
            word = qs[grp, blk, j % 16, lane // WORD_ROWS]
            shift = (byte + j // 16 * 4).astype("uint32")
            nibble = tirx.bitwise_and(tirx.shift_right(word, shift), tirx.const(15, "uint32"))
            if wtype == "q4_0":
                return scale * (nibble.astype("float32") - 8.0)
            return scale * nibble.astype("float32") + mn[grp, blk, lane].astype("float32")
    else:
        raise ValueError(f"no WGSL linear kernel for {wtype} weights (only {', '.join(TYPES)})")

    wmat = te.compute((_i32(n), _i32(k)), weight, name="dequant")
    red = te.reduce_axis((_i32(0), _i32(k)), name="k")
    y = te.compute((m, _i32(n)), lambda i, j: te.sum(x[i, red] * wmat[j, red], axis=red), name="matmul")
    func = te.create_prim_func([x, *parts, y])
    return symbol, func.with_attr("global_symbol", symbol)
