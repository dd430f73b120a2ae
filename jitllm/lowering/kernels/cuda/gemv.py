"""Hand-scheduled GPU matrix-vector kernels for decode steps (one activation row).

One thread block per group of R=8 interleaved output rows; its threads stride through the group's
items (a column of 8 weights for float types, a (32-block, byte column) pair for quantized ones), so a
warp reads one contiguous stretch of the group's bytes per step and every row group keeps a whole
block of loads in flight. Each thread keeps R partial sums in registers; they meet by warp shuffles,
then in shared memory, and threads 0..R-1 write the R outputs. The row-interleaved
layouts keep a group's bytes contiguous, so the whole matrix streams once.

Folded variants (jitllm.ir.ops: RmsNormLinear, LinearAdd, SwiGLULinearAdd) do the small ops around the
matvec in the same kernel: every input element is read once per thread block, so SwiGLU and the norm
weight apply as it is read; the norm's sum of squares accumulates beside the dot products and its
1/RMS factor scales the finished sums (the matvec is linear); the residual is added as rows are stored.

Launched dependent (`dependent`, kernels_gpu.await_previous_kernel), a float-weight kernel loads its
first PREFETCH columns of weights before it waits for the kernel before it: the weights are no kernel's
output, so their first DRAM round trip overlaps the end of the previous kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import QUANT_BLOCK, ROW_GROUP, WIDE_TYPES
from jitllm.ir.ops import LINEAR, LINEAR_ADD, NORM_LINEAR, SWIGLU_LINEAR_ADD
from jitllm.lowering.kernels.cuda.basic import await_previous_kernel, dependent_launch, shfl_xor
from jitllm.lowering.kernels.formats import FLOAT_STORAGE, float_weight, without_params

R = ROW_GROUP
PREFETCH = 4  # weight columns each thread of a dependent float kernel loads before it waits


@dataclass(frozen=True)
class Fold:
    """What a matvec kernel does besides y = W x (see the module docstring)."""

    norm: bool = False
    swiglu: bool = False
    residual: bool = False
    eps: float = 0.0

    @classmethod
    def of(cls, family: str, eps: float = 0.0) -> "Fold":
        return {LINEAR: cls(), NORM_LINEAR: cls(norm=True, eps=eps), LINEAR_ADD: cls(residual=True),
                SWIGLU_LINEAR_ADD: cls(swiglu=True, residual=True)}[family]

    def suffix(self, family: str) -> str:
        """What a kernel's symbol adds for the fold: the family, and the norm's eps as float bits
        (symbols take no '.' or '-')."""
        if family == LINEAR:
            return ""
        return f"_{family.lower()}" + (f"_eps{np.float32(self.eps).view(np.uint32):08x}" if self.norm else "")


def gemv_kernel(wtype: str, n: int, k: int, family: str = LINEAR, eps: float = 0.0,
                dependent: bool = False) -> tuple[str, tvm.tirx.PrimFunc]:
    """The kernel's parameters: x [1, K] ([1, 2K] gate then up for SwiGLU), the norm weight [K] (norm
    only), the weight parts, the residual [1, N/R, R] (residual only), y [1, N/R, R]. `dependent`:
    launched dependent (see the module docstring)."""
    fold = Fold.of(family, eps)
    symbol = f"jl_gpu_gemv_{wtype}_{n}x{k}" + fold.suffix(family)
    if wtype in WIDE_TYPES:
        from jitllm.lowering.kernels.cuda.wide import wide_gemv

        func = wide_gemv(wtype, n // R, k, fold, dependent)
    else:
        factory = {"f32": _float, "f16": _float, "bf16": _float, "q8_0": _q8_0, "q4_0": _q4, "q4_1": _q4}[wtype]
        func = factory(wtype, n // R, k, fold, dependent)
    func = without_params(func, {name for name, used in (("nw", fold.norm), ("res", fold.residual)) if not used})
    return symbol, dependent_launch(func, dependent).with_attr("global_symbol", symbol)


def threads_for(items: int, each: int = 4) -> int:
    """Threads per block for `items` work items per row group: at least `each` items each, where the
    items allow (32 threads at least)."""
    for nt in (256, 128, 64):
        if items >= each * nt:
            return nt
    return 32


@T.macro
def zero_sums(acc):
    for r in T.serial(R):
        acc[r] = T.float32(0)


@T.macro
def read_input(xv, i, ss, x, nw, kk, K, norm, swiglu):
    """xv[i] = the matvec's input at column kk: x, or silu(gate) * up; times the norm weight, with its
    square added to the sum of squares first."""
    if swiglu:
        xv[i] = x[0, kk] / (T.float32(1) + T.exp(T.float32(0) - x[0, kk])) * x[0, K + kk]
    else:
        xv[i] = x[0, kk]
    if norm:
        ss[0] = ss[0] + xv[i] * xv[i]
        xv[i] = xv[i] * nw[kk]


@T.macro
def block_sum_and_store(part, pss, acc, ss, t, g, y, res, NT, K, fold):
    """Each thread's R partial sums -> per warp by shuffles (three halving exchanges leave each lane one
    row, lane l row (l >> 2) % 8, then two more add the four lanes of a row) -> shared memory -> threads
    0..R-1 add the warps' sums and store rows (the sum of squares: five shuffles, then the warps).
    A two-stage sum through shared memory measured 1-12% slower per matvec on the H200."""
    lane: T.let = t % 32
    for i in T.unroll(4):  # lanes 0-15 keep rows 0-3, lanes 16-31 rows 4-7, each adding its partner's
        keep: T.let = T.Select(lane < 16, acc[i], acc[i + 4])
        give: T.let = T.Select(lane < 16, acc[i + 4], acc[i])
        acc[i] = keep + shfl_xor(give, 16)
    for i in T.unroll(2):
        keep2: T.let = T.Select(lane % 16 < 8, acc[i], acc[i + 2])
        give2: T.let = T.Select(lane % 16 < 8, acc[i + 2], acc[i])
        acc[i] = keep2 + shfl_xor(give2, 8)
    keep3: T.let = T.Select(lane % 8 < 4, acc[0], acc[1])
    give3: T.let = T.Select(lane % 8 < 4, acc[1], acc[0])
    acc[0] = keep3 + shfl_xor(give3, 4)
    acc[0] = acc[0] + shfl_xor(acc[0], 2)
    acc[0] = acc[0] + shfl_xor(acc[0], 1)
    if lane % 4 == 0:
        part[t // 32, lane // 4] = acc[0]
    if fold.norm:
        for m in T.unroll(5):
            ss[0] = ss[0] + shfl_xor(ss[0], 16 >> m)
        if lane == 0:
            pss[t // 32] = ss[0]
    T.tvm_storage_sync("shared")
    if t < R:
        acc[1] = T.float32(0)
        for w in T.unroll(NT // 32):
            acc[1] = acc[1] + part[w, t]
        if fold.norm:
            acc[2] = T.float32(0)
            for w in T.unroll(NT // 32):
                acc[2] = acc[2] + pss[w]
            acc[1] = acc[1] / T.sqrt(acc[2] / T.float32(K) + T.float32(fold.eps))
        if fold.residual:
            acc[1] = acc[1] + res[0, g, t]
        y[0, g, t] = acc[1]


@T.macro
def _float_item(acc, xv, ss, wl, wpre, w, x, nw, g, e, step, K, fold, PRE, bf16):
    """Add column e (its 8 rows: one 16-byte load for f16 and bf16) of row group g to the R partial sums;
    the thread's first PRE columns were loaded into `wpre` before the wait. `bf16`: the weights are bf16
    bits."""
    if step < PRE:  # (step is unrolled: the branch resolves at compile time)
        for r in T.vectorized(R):
            wl[r] = wpre[step, r]
    else:
        for r in T.vectorized(R):
            wl[r] = w[g, e, r]
    read_input(xv, 0, ss, x, nw, e, K, fold.norm, fold.swiglu)
    for r in T.serial(R):
        acc[r] = acc[r] + float_weight("bf16" if bf16 else "f32", wl[r]) * xv[0]


@T.macro
def _q8_0_item(acc, xv, ss, ql, dl, qs, d, x, nw, g, e, K, fold):
    """Add item e (32-block e // 32, column e % 32) of row group g to the R partial sums."""
    for r in T.vectorized(R):
        ql[r] = qs[g, e // 32, e % 32, r]
    for r in T.vectorized(R):
        dl[r] = d[g, e // 32, r]
    read_input(xv, 0, ss, x, nw, e, K, fold.norm, fold.swiglu)
    for r in T.serial(R):
        acc[r] = acc[r] + T.Cast("float32", dl[r]) * T.Cast("float32", ql[r]) * xv[0]


@T.macro
def _q4_item(acc, xv, ss, ql, dl, ml, qs, d, mn, x, nw, g, e, K, q4_1, fold):
    """Add item e (32-block e // 16, byte column e % 16) of row group g to the R partial sums; the
    item's 8 bytes and its block's 8 scales (and minimums) arrive as one vector load each."""
    b: T.let = e // 16
    j: T.let = e % 16
    bias: T.let = T.float32(8388608 if q4_1 else 8388616)
    read_input(xv, 0, ss, x, nw, b * 32 + j, K, fold.norm, fold.swiglu)
    read_input(xv, 1, ss, x, nw, b * 32 + j + 16, K, fold.norm, fold.swiglu)
    for r in T.vectorized(R):
        ql[r] = qs[g, b, j, r]
    for r in T.vectorized(R):
        dl[r] = d[g, b, r]
    if q4_1:
        for r in T.vectorized(R):
            ml[r] = mn[g, b, r]
    for r in T.serial(R):
        # nibble -> float without an int-to-float conversion (a quarter-rate instruction): the nibble as
        # the low mantissa bits of 2^23, minus 2^23 (minus 2^23 + 8 for Q4_0's offset nibbles, in the
        # same exact subtraction)
        byte: T.let = T.Cast("uint32", ql[r])
        lo: T.let = T.reinterpret("float32", T.bitwise_or(T.bitwise_and(byte, T.uint32(15)), T.uint32(0x4B000000))) - bias
        hi: T.let = T.reinterpret("float32", T.bitwise_or(T.shift_right(byte, T.uint32(4)), T.uint32(0x4B000000))) - bias
        if q4_1:
            acc[r] = acc[r] + T.Cast("float32", dl[r]) * (lo * xv[0] + hi * xv[1]) + T.Cast("float32", ml[r]) * (xv[0] + xv[1])
        else:
            acc[r] = acc[r] + T.Cast("float32", dl[r]) * (lo * xv[0] + hi * xv[1])


@T.macro
def _body(x, nw, q, d, mn, res, y, G, K, NT, ITEMS, fmt, qdtype, fold, dependent, PRE):
    """Every format's kernel: one thread block per row group, NT threads striding over its ITEMS work
    items, then the two-stage sum and store. `q` holds the weights (float) or their quants; PRE: the
    float weight columns each thread loads before `await_previous_kernel`."""
    for g in T.thread_binding(G, thread="blockIdx.x"):
        for t in T.thread_binding(NT, thread="threadIdx.x"):
            part = T.alloc_buffer((NT // 32, R), "float32", scope="shared")  # each warp's row sums
            pss = T.alloc_buffer((NT // 32,), "float32", scope="shared")  # each warp's sum of squares
            acc = T.alloc_buffer((R,), "float32", scope="local")
            ss = T.alloc_buffer((1,), "float32", scope="local")
            xv = T.alloc_buffer((2,), "float32", scope="local")
            ql = T.alloc_buffer((R,), qdtype, scope="local")
            dl = T.alloc_buffer((R,), "float16", scope="local")
            ml = T.alloc_buffer((R,), "float16", scope="local")
            wpre = T.alloc_buffer((max(PRE, 1), R), qdtype, scope="local")
            if PRE > 0:
                for step in T.unroll(PRE):
                    for r in T.vectorized(R):
                        wpre[step, r] = q[g, step * NT + t, r]
            await_previous_kernel(dependent)
            zero_sums(acc)
            ss[0] = T.float32(0)
            for step in T.unroll((ITEMS + NT - 1) // NT):
                if step * NT + t < ITEMS:
                    if fmt == "float" or fmt == "bf16":
                        _float_item(acc, xv, ss, ql, wpre, q, x, nw, g, step * NT + t, step, K, fold, PRE,
                                    fmt == "bf16")
                    elif fmt == "q8_0":
                        _q8_0_item(acc, xv, ss, ql, dl, q, d, x, nw, g, step * NT + t, K, fold)
                    else:
                        _q4_item(acc, xv, ss, ql, dl, ml, q, d, mn, x, nw, g, step * NT + t, K, fmt == "q4_1", fold)
            block_sum_and_store(part, pss, acc, ss, t, g, y, res, NT, K, fold)


def _float(wtype: str, G: int, K: int, fold: Fold, dependent: bool):
    wdtype = FLOAT_STORAGE[wtype]
    NT = threads_for(K)  # items: a column of the group's 8 rows
    XK = 2 * K if fold.swiglu else K
    PRE = min(PREFETCH, K // NT) if dependent else 0  # whole steps only: every thread has those columns

    @T.prim_func
    def f(x: T.Buffer((1, XK), "float32"), nw: T.Buffer((K,), "float32"), w: T.Buffer((G, K, R), wdtype),
          res: T.Buffer((1, G, R), "float32"), y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        _body(x, nw, w, None, None, res, y, G, K, NT, K, "bf16" if wtype == "bf16" else "float", wdtype, fold,
              dependent, PRE)

    return f


def _q8_0(wtype: str, G: int, K: int, fold: Fold, dependent: bool):
    NB = K // QUANT_BLOCK
    NT = threads_for(K)  # items: (32-block, column) pairs
    XK = 2 * K if fold.swiglu else K

    @T.prim_func
    def f(x: T.Buffer((1, XK), "float32"), nw: T.Buffer((K,), "float32"), qs: T.Buffer((G, NB, 32, R), "int8"),
          d: T.Buffer((G, NB, R), "float16"), res: T.Buffer((1, G, R), "float32"),
          y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        _body(x, nw, qs, d, None, res, y, G, K, NT, K, "q8_0", "int8", fold, dependent, 0)

    return f


def _q4(wtype: str, G: int, K: int, fold: Fold, dependent: bool):
    """Q4_0 (value = d * (nibble - 8)) and Q4_1 (value = d * nibble + m); byte j of a 32-block holds
    columns j (low nibble) and j + 16 (high nibble)."""
    NB = K // QUANT_BLOCK
    NT = threads_for(K // 2)  # items: (32-block, byte column) pairs, two columns each
    XK = 2 * K if fold.swiglu else K

    @T.prim_func
    def q4_1(x: T.Buffer((1, XK), "float32"), nw: T.Buffer((K,), "float32"), qs: T.Buffer((G, NB, 16, R), "uint8"),
             d: T.Buffer((G, NB, R), "float16"), mn: T.Buffer((G, NB, R), "float16"),
             res: T.Buffer((1, G, R), "float32"), y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        _body(x, nw, qs, d, mn, res, y, G, K, NT, K // 2, "q4_1", "uint8", fold, dependent, 0)

    @T.prim_func
    def q4_0(x: T.Buffer((1, XK), "float32"), nw: T.Buffer((K,), "float32"), qs: T.Buffer((G, NB, 16, R), "uint8"),
             d: T.Buffer((G, NB, R), "float16"), res: T.Buffer((1, G, R), "float32"),
             y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        _body(x, nw, qs, d, None, res, y, G, K, NT, K // 2, "q4_0", "uint8", fold, dependent, 0)

    return q4_1 if wtype == "q4_1" else q4_0
