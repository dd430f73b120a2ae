"""Hand-scheduled GPU matrix-vector kernels for decode steps (one activation row).

One thread block per group of R=8 interleaved output rows; its threads stride through the group's
items (a column of 8 weights for float types, a (32-block, byte column) pair for quantized ones), so a
warp reads one contiguous stretch of the group's bytes per step and every row group keeps a whole
block of loads in flight. Each thread keeps R partial sums in registers; they meet in shared memory
in two stages (8 threads, then the rest) and threads 0..R-1 write the R outputs. The row-interleaved
layouts keep a group's bytes contiguous, so the whole matrix streams once.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import QUANT_BLOCK, ROW_GROUP

R = ROW_GROUP


def gemv_kernel(wtype: str, n: int, k: int) -> tuple[str, tvm.tirx.PrimFunc]:
    symbol = f"jl_gpu_gemv_{wtype}_{n}x{k}"
    factory = {"f32": _float, "f16": _float, "q8_0": _q8_0, "q4_0": _q4, "q4_1": _q4}[wtype]
    return symbol, factory(wtype, n // R, k).with_attr("global_symbol", symbol)


def _threads(items: int) -> int:
    """Threads per block for `items` work items per row group: enough for a few items each."""
    for nt in (256, 128, 64):
        if items >= 4 * nt:
            return nt
    return 32


@T.macro
def _zero(acc):
    for r in T.serial(R):
        acc[r] = T.float32(0)


@T.macro
def _block_sum_and_store(part, part2, acc, t, g, y, NT):
    """Each thread's R partial sums -> shared memory -> sums of 8 threads -> threads 0..R-1 store rows."""
    for r in T.serial(R):
        part[t, r] = acc[r]
    T.tvm_storage_sync("shared")
    acc[0] = T.float32(0)
    for i in T.serial(R):
        acc[0] = acc[0] + part[t // R * R + i, t % R]
    part2[t // R, t % R] = acc[0]
    T.tvm_storage_sync("shared")
    if t < R:
        acc[1] = T.float32(0)
        for c in T.serial(NT // R):
            acc[1] = acc[1] + part2[c, t]
        y[0, g, t] = acc[1]


def _float(wtype: str, G: int, K: int):
    wdtype = "float32" if wtype == "f32" else "float16"
    NT = _threads(K)
    STEPS = (K + NT - 1) // NT

    @T.prim_func
    def f(x: T.Buffer((1, K), "float32"), w: T.Buffer((G, K, R), wdtype), y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for g in T.thread_binding(G, thread="blockIdx.x"):
            for t in T.thread_binding(NT, thread="threadIdx.x"):
                part = T.alloc_buffer((NT, R), "float32", scope="shared")
                part2 = T.alloc_buffer((NT // R, R), "float32", scope="shared")
                acc = T.alloc_buffer((R,), "float32", scope="local")
                wl = T.alloc_buffer((R,), wdtype, scope="local")
                _zero(acc)
                for step in T.unroll(STEPS):
                    kk: T.let = step * NT + t
                    if kk < K:
                        for r in T.vectorized(R):  # one 16-byte load (f16) of the column's 8 rows
                            wl[r] = w[g, kk, r]
                        for r in T.serial(R):
                            acc[r] = acc[r] + T.Cast("float32", wl[r]) * x[0, kk]
                _block_sum_and_store(part, part2, acc, t, g, y, NT)

    return f


def _q8_0(wtype: str, G: int, K: int):
    NB = K // QUANT_BLOCK
    NT = _threads(NB * 32)
    STEPS = (NB * 32 + NT - 1) // NT

    @T.prim_func
    def f(x: T.Buffer((1, NB, 32), "float32"), qs: T.Buffer((G, NB, 32, R), "int8"),
          d: T.Buffer((G, NB, R), "float16"), y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for g in T.thread_binding(G, thread="blockIdx.x"):
            for t in T.thread_binding(NT, thread="threadIdx.x"):
                part = T.alloc_buffer((NT, R), "float32", scope="shared")
                part2 = T.alloc_buffer((NT // R, R), "float32", scope="shared")
                acc = T.alloc_buffer((R,), "float32", scope="local")
                ql = T.alloc_buffer((R,), "int8", scope="local")
                dl = T.alloc_buffer((R,), "float16", scope="local")
                _zero(acc)
                for step in T.unroll(STEPS):
                    e: T.let = step * NT + t
                    if e < NB * 32:
                        for r in T.vectorized(R):
                            ql[r] = qs[g, e // 32, e % 32, r]
                        for r in T.vectorized(R):
                            dl[r] = d[g, e // 32, r]
                        for r in T.serial(R):
                            acc[r] = acc[r] + T.Cast("float32", dl[r]) * T.Cast("float32", ql[r]) * x[0, e // 32, e % 32]
                _block_sum_and_store(part, part2, acc, t, g, y, NT)

    return f


@T.macro
def _q4_item(acc, ql, dl, ml, qs, d, mn, x, g, e, q4_1):
    """Add item e (32-block e // 16, byte column e % 16) of row group g to the R partial sums; the
    item's 8 bytes and its block's 8 scales (and minimums) arrive as one vector load each."""
    b: T.let = e // 16
    j: T.let = e % 16
    x0: T.let = x[0, b, j]
    x1: T.let = x[0, b, j + 16]
    for r in T.vectorized(R):
        ql[r] = qs[g, b, j, r]
    for r in T.vectorized(R):
        dl[r] = d[g, b, r]
    if q4_1:
        for r in T.vectorized(R):
            ml[r] = mn[g, b, r]
    for r in T.serial(R):
        lo: T.let = T.Cast("float32", T.bitwise_and(ql[r], T.uint8(15)))
        hi: T.let = T.Cast("float32", T.shift_right(ql[r], T.uint8(4)))
        if q4_1:
            acc[r] = acc[r] + T.Cast("float32", dl[r]) * (lo * x0 + hi * x1) + T.Cast("float32", ml[r]) * (x0 + x1)
        else:
            acc[r] = acc[r] + T.Cast("float32", dl[r]) * ((lo - T.float32(8)) * x0 + (hi - T.float32(8)) * x1)


@T.macro
def _q4_body(x, qs, d, mn, y, G, NT, STEPS, NB, q4_1):
    for g in T.thread_binding(G, thread="blockIdx.x"):
        for t in T.thread_binding(NT, thread="threadIdx.x"):
            part = T.alloc_buffer((NT, R), "float32", scope="shared")
            part2 = T.alloc_buffer((NT // R, R), "float32", scope="shared")
            acc = T.alloc_buffer((R,), "float32", scope="local")
            ql = T.alloc_buffer((R,), "uint8", scope="local")
            dl = T.alloc_buffer((R,), "float16", scope="local")
            ml = T.alloc_buffer((R,), "float16", scope="local")
            _zero(acc)
            for step in T.unroll(STEPS):
                if step * NT + t < NB * 16:
                    _q4_item(acc, ql, dl, ml, qs, d, mn, x, g, step * NT + t, q4_1)
            _block_sum_and_store(part, part2, acc, t, g, y, NT)


def _q4(wtype: str, G: int, K: int):
    """Q4_0 (value = d * (nibble - 8)) and Q4_1 (value = d * nibble + m); byte j of a 32-block holds
    columns j (low nibble) and j + 16 (high nibble)."""
    NB = K // QUANT_BLOCK
    NT = _threads(NB * 16)
    STEPS = (NB * 16 + NT - 1) // NT

    @T.prim_func
    def q4_1(x: T.Buffer((1, NB, 32), "float32"), qs: T.Buffer((G, NB, 16, R), "uint8"),
             d: T.Buffer((G, NB, R), "float16"), mn: T.Buffer((G, NB, R), "float16"),
             y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        _q4_body(x, qs, d, mn, y, G, NT, STEPS, NB, True)

    @T.prim_func
    def q4_0(x: T.Buffer((1, NB, 32), "float32"), qs: T.Buffer((G, NB, 16, R), "uint8"),
             d: T.Buffer((G, NB, R), "float16"), y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        _q4_body(x, qs, d, None, y, G, NT, STEPS, NB, False)

    return q4_1 if wtype == "q4_1" else q4_0
