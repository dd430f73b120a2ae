"""TIR kernels for y = x @ W.T reading W in the row-interleaved layouts of ir/layouts.py.

One output row group (R rows) is the unit of work: R accumulators live in one vector register and the
weights stay quantized; a block's scales are applied per 32-element block (q4 nibbles: byte j holds
element j low and j+16 high). x is [M, K] with symbolic M, so one kernel serves prefill and decode.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import QUANT_BLOCK, ROW_GROUP

R = ROW_GROUP


def linear_kernel(wtype: str, n: int, k: int) -> tuple[str, tvm.tirx.PrimFunc]:
    """(global symbol, PrimFunc) computing y[M, N/R, R] from x[M, K] and the weight parts."""
    symbol = f"jl_linear_{wtype}_{n}x{k}"
    factory = {"f32": _float, "f16": _float, "q8_0": _q8_0, "q4_0": _q4, "q4_1": _q4}[wtype]
    func = factory(wtype, n // R, k)
    return symbol, func.with_attr("global_symbol", symbol)


def _float(wtype: str, G: int, K: int):
    wdtype = "float32" if wtype == "f32" else "float16"

    @T.prim_func
    def f(x_h: T.handle, w: T.Buffer((G, K, R), wdtype), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        x = T.match_buffer(x_h, (M, K), "float32")
        y = T.match_buffer(y_h, (M, G, R), "float32")
        for g in T.serial(G):
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
        for g in T.serial(G):
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
            for g in T.serial(G):
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
        for g in T.serial(G):
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
