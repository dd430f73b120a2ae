"""Hand-scheduled GPU matrix-vector kernels for decode steps (one activation row).

One warp per group of R=8 interleaved output rows: lane l walks the group's K range (32-element quant
blocks or single columns for float weights) in steps of 32, keeping R partial sums in registers; the
warp's partial sums meet in shared memory and lanes 0..R-1 write the R outputs. The group's bytes are
contiguous in the row-interleaved layouts, so a warp streams one contiguous region.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import QUANT_BLOCK, ROW_GROUP

R = ROW_GROUP
WARPS = 4  # row groups per thread block


def gemv_kernel(wtype: str, n: int, k: int) -> tuple[str, tvm.tirx.PrimFunc]:
    symbol = f"jl_gpu_gemv_{wtype}_{n}x{k}"
    factory = {"f32": _float, "f16": _float, "q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1}[wtype]
    return symbol, factory(wtype, n // R, k).with_attr("global_symbol", symbol)


@T.macro
def _zero(acc):
    for r in T.serial(R):
        acc[r] = T.float32(0)


@T.macro
def _warp_sum_and_store(part, acc, warp, lane, g, y, G):
    """Lane partial sums -> shared memory -> lanes 0..R-1 add their row's 32 partials and store it."""
    for r in T.serial(R):
        part[warp, lane, r] = acc[r]
    T.tvm_storage_sync("shared")
    if lane < R and g < G:
        acc[0] = T.float32(0)
        for i in T.serial(32):
            acc[0] = acc[0] + part[warp, i, lane]
        y[0, g, lane] = acc[0]


@T.macro
def _q4_block(qs, x, g, b, blockacc, xsum):
    """blockacc[r] = sum_j nibble(r, j) * x[j] over one 32-block, and xsum = sum_j x[j]."""
    xsum[0] = T.float32(0)
    for j in T.serial(32):
        xsum[0] = xsum[0] + x[0, b, j]
    _zero(blockacc)
    for j in T.serial(16):
        for r in T.serial(R):
            blockacc[r] = blockacc[r] + T.Cast("float32", T.bitwise_and(qs[g, b, j, r], T.uint8(15))) * x[0, b, j] \
                + T.Cast("float32", T.shift_right(qs[g, b, j, r], T.uint8(4))) * x[0, b, j + 16]


def _float(wtype: str, G: int, K: int):
    wdtype = "float32" if wtype == "f32" else "float16"
    STEPS = (K + 31) // 32

    @T.prim_func
    def f(x: T.Buffer((1, K), "float32"), w: T.Buffer((G, K, R), wdtype), y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for blk in T.thread_binding((G + WARPS - 1) // WARPS, thread="blockIdx.x"):
            for warp in T.thread_binding(WARPS, thread="threadIdx.y"):
                for lane in T.thread_binding(32, thread="threadIdx.x"):
                    part = T.alloc_buffer((WARPS, 32, R), "float32", scope="shared")
                    acc = T.alloc_buffer((R,), "float32", scope="local")
                    g: T.let = blk * WARPS + warp
                    _zero(acc)
                    if g < G:
                        for step in T.serial(STEPS):
                            kk: T.let = step * 32 + lane
                            if kk < K:
                                for r in T.serial(R):
                                    acc[r] = acc[r] + T.Cast("float32", w[g, kk, r]) * x[0, kk]
                    _warp_sum_and_store(part, acc, warp, lane, g, y, G)

    return f


def _q8_0(wtype: str, G: int, K: int):
    NB = K // QUANT_BLOCK
    STEPS = (NB + 31) // 32

    @T.prim_func
    def f(x: T.Buffer((1, NB, 32), "float32"), qs: T.Buffer((G, NB, 32, R), "int8"),
          d: T.Buffer((G, NB, R), "float16"), y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for blk in T.thread_binding((G + WARPS - 1) // WARPS, thread="blockIdx.x"):
            for warp in T.thread_binding(WARPS, thread="threadIdx.y"):
                for lane in T.thread_binding(32, thread="threadIdx.x"):
                    part = T.alloc_buffer((WARPS, 32, R), "float32", scope="shared")
                    acc = T.alloc_buffer((R,), "float32", scope="local")
                    blockacc = T.alloc_buffer((R,), "float32", scope="local")
                    g: T.let = blk * WARPS + warp
                    _zero(acc)
                    if g < G:
                        for step in T.serial(STEPS):
                            b: T.let = step * 32 + lane
                            if b < NB:
                                _zero(blockacc)
                                for j in T.serial(32):
                                    for r in T.serial(R):
                                        blockacc[r] = blockacc[r] + T.Cast("float32", qs[g, b, j, r]) * x[0, b, j]
                                for r in T.serial(R):
                                    acc[r] = acc[r] + T.Cast("float32", d[g, b, r]) * blockacc[r]
                    _warp_sum_and_store(part, acc, warp, lane, g, y, G)

    return f


def _q4_1(wtype: str, G: int, K: int):
    NB = K // QUANT_BLOCK
    STEPS = (NB + 31) // 32

    @T.prim_func
    def f(x: T.Buffer((1, NB, 32), "float32"), qs: T.Buffer((G, NB, 16, R), "uint8"),
          d: T.Buffer((G, NB, R), "float16"), mn: T.Buffer((G, NB, R), "float16"),
          y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for blk in T.thread_binding((G + WARPS - 1) // WARPS, thread="blockIdx.x"):
            for warp in T.thread_binding(WARPS, thread="threadIdx.y"):
                for lane in T.thread_binding(32, thread="threadIdx.x"):
                    part = T.alloc_buffer((WARPS, 32, R), "float32", scope="shared")
                    acc = T.alloc_buffer((R,), "float32", scope="local")
                    blockacc = T.alloc_buffer((R,), "float32", scope="local")
                    xsum = T.alloc_buffer((1,), "float32", scope="local")
                    g: T.let = blk * WARPS + warp
                    _zero(acc)
                    if g < G:
                        for step in T.serial(STEPS):
                            b: T.let = step * 32 + lane
                            if b < NB:
                                _q4_block(qs, x, g, b, blockacc, xsum)
                                for r in T.serial(R):
                                    acc[r] = acc[r] + T.Cast("float32", d[g, b, r]) * blockacc[r] + T.Cast(
                                        "float32", mn[g, b, r]) * xsum[0]
                    _warp_sum_and_store(part, acc, warp, lane, g, y, G)

    return f


def _q4_0(wtype: str, G: int, K: int):
    NB = K // QUANT_BLOCK
    STEPS = (NB + 31) // 32

    @T.prim_func
    def f(x: T.Buffer((1, NB, 32), "float32"), qs: T.Buffer((G, NB, 16, R), "uint8"),
          d: T.Buffer((G, NB, R), "float16"), y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for blk in T.thread_binding((G + WARPS - 1) // WARPS, thread="blockIdx.x"):
            for warp in T.thread_binding(WARPS, thread="threadIdx.y"):
                for lane in T.thread_binding(32, thread="threadIdx.x"):
                    part = T.alloc_buffer((WARPS, 32, R), "float32", scope="shared")
                    acc = T.alloc_buffer((R,), "float32", scope="local")
                    blockacc = T.alloc_buffer((R,), "float32", scope="local")
                    xsum = T.alloc_buffer((1,), "float32", scope="local")
                    g: T.let = blk * WARPS + warp
                    _zero(acc)
                    if g < G:
                        for step in T.serial(STEPS):
                            b: T.let = step * 32 + lane
                            if b < NB:
                                _q4_block(qs, x, g, b, blockacc, xsum)
                                for r in T.serial(R):
                                    acc[r] = acc[r] + T.Cast("float32", d[g, b, r]) * (blockacc[r] - T.float32(8) * xsum[0])
                    _warp_sum_and_store(part, acc, warp, lane, g, y, G)

    return f
