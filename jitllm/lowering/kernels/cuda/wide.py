"""CUDA decode matvecs and embedding gathers for the 5-bit, 6-bit and K-quant formats (q5_0, q5_1, q4_k,
q5_k, q6_k), with f32 activations; their arithmetic is kernels/formats.py's.

The matvec is kernels/cuda/gemv.py's for Q4 with another work item: one thread block per row group, NT
threads striding over (32-block, byte column j) items, each the two elements j and j + 16 of the group's
8 rows: one 8-byte vector load of their qs bytes, one of the qh bytes holding both elements' high bits,
and the block's scales and offsets for the 8 rows as vector loads (the 16 items of a block share them
through L1). The sums meet as gemv.py's do (block_sum_and_store), folds (norm, SwiGLU, residual) and the
dependent launch included. Prefill linears of these formats are basic.linear_kernel's TE definition,
scheduled by dlight.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import HIGH_BITS, K_QUANTS, ROW_GROUP
from jitllm.lowering.kernels.cuda.basic import await_previous_kernel
from jitllm.lowering.kernels.cuda.gemv import Fold, block_sum_and_store, read_input, threads_for, zero_sums
from jitllm.lowering.kernels.formats import (
    PER_SUPER,
    assemble_q,
    block_offset,
    block_scale,
    high_bit_slot,
    to_f32,
    union_buffers,
    weight_value,
    without_params,
)

R = ROW_GROUP


@T.macro
def _item(acc, xv, ss, ql, hl, sw, sl, ol, ws, x, nw, g, e, K, wtype, bits, halves, per, has_mn, has_d2, fold):
    """Add item e (block e // 16, byte column e % 16: elements j and j + 16) of row group g to the R sums.

    The block's scale parts are copied by vector loads into `sw`, locals shaped as one block of them
    ([1, 1, ...]: formats.block_scale reads them at block 0), then its scales and offsets computed per row
    (an 8-wide float vector has no CUDA type). `halves`: 2 where the halves have their own scales (q6_k);
    `per`: blocks per d (8 for the K-quants); has_mn / has_d2: the format has those parts."""
    qs, qh, sc, mn, d, d2 = ws
    scl, mnl, dl, d2l = sw
    b: T.let = e // 16
    j: T.let = e % 16
    read_input(xv, 0, ss, x, nw, b * 32 + j, K, fold.norm, fold.swiglu)
    read_input(xv, 1, ss, x, nw, b * 32 + j + 16, K, fold.norm, fold.swiglu)
    for r in T.vectorized(R):
        ql[r] = qs[g, b, j, r]
    if bits > 0:
        for r in T.vectorized(R):
            hl[r] = qh[g, b, high_bit_slot(j, 0, bits)[0], r]
    for r in T.vectorized(R):
        dl[0, 0, r] = d[g, b // per, r]
    if halves == 2:
        for h in T.unroll(2):
            for r in T.vectorized(R):
                scl[0, 0, h, r] = sc[g, b, h, r]
    if has_mn:
        for r in T.vectorized(R):
            scl[0, 0, r] = sc[g, b, r]
        for r in T.vectorized(R):
            mnl[0, 0, r] = mn[g, b, r]
    if has_d2:
        for r in T.vectorized(R):
            d2l[0, 0, r] = d2[g, b // per, r]
    for h in T.unroll(halves):
        for r in T.serial(R):
            sl[h, r] = block_scale(wtype, scl, dl, 0, 0, r, h)
            ol[h, r] = block_offset(wtype, scl, mnl, dl, d2l, 0, 0, r, h)
    for r in T.serial(R):
        lo: T.let = to_f32(assemble_q(ql[r], hl[r], 0, high_bit_slot(j, 0, bits)[1], bits))
        hi: T.let = to_f32(assemble_q(ql[r], hl[r], 1, high_bit_slot(j, 1, bits)[1], bits))
        acc[r] = (acc[r] + (sl[0, r] * lo + ol[0, r]) * xv[0]
                  + (sl[halves - 1, r] * hi + ol[halves - 1, r]) * xv[1])


def wide_gemv(wtype: str, G: int, K: int, fold: Fold, dependent: bool) -> tvm.tirx.PrimFunc:
    """x [1, K] ([1, 2K] for SwiGLU), the norm weight nw [K], the parts, the residual res, y [1, G, R]
    (gemv.gemv_kernel drops nw and res where the fold takes none)."""
    bits = HIGH_BITS.get(wtype, 0)
    halves = 2 if wtype == "q6_k" else 1
    per = PER_SUPER if wtype in K_QUANTS else 1
    has_mn, has_d2 = wtype in ("q4_k", "q5_k"), wtype in ("q5_1", "q4_k", "q5_k")
    ITEMS = K // 2
    NT = threads_for(ITEMS)
    XK = 2 * K if fold.swiglu else K
    (qs_shape, qs_dtype), (qh_shape, qh_dtype), (sc_shape, sc_dtype), (mn_shape, mn_dtype), (d_shape, d_dtype), \
        (d2_shape, d2_dtype), unused = union_buffers(wtype, G, K)  # (TVMScript signatures take names)
    sc_local, mn_local, d_local, d2_local = [(1, 1, *shape[2:]) if len(shape) > 2 else (1, 1, R)
                                             for shape in (sc_shape, mn_shape, d_shape, d2_shape)]

    @T.prim_func
    def f(x: T.Buffer((1, XK), "float32"), nw: T.Buffer((K,), "float32"), qs: T.Buffer(qs_shape, qs_dtype),
          qh: T.Buffer(qh_shape, qh_dtype), sc: T.Buffer(sc_shape, sc_dtype), mn: T.Buffer(mn_shape, mn_dtype),
          d: T.Buffer(d_shape, d_dtype), d2: T.Buffer(d2_shape, d2_dtype), res: T.Buffer((1, G, R), "float32"),
          y: T.Buffer((1, G, R), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for g in T.thread_binding(G, thread="blockIdx.x"):
            for t in T.thread_binding(NT, thread="threadIdx.x"):
                part = T.alloc_buffer((NT // 32, R), "float32", scope="shared")  # each warp's row sums
                pss = T.alloc_buffer((NT // 32,), "float32", scope="shared")  # each warp's sum of squares
                acc = T.alloc_buffer((R,), "float32", scope="local")
                ss = T.alloc_buffer((1,), "float32", scope="local")
                xv = T.alloc_buffer((2,), "float32", scope="local")
                ql = T.alloc_buffer((R,), "uint8", scope="local")
                hl = T.alloc_buffer((R,), "uint8", scope="local")
                scl = T.alloc_buffer(sc_local, sc_dtype, scope="local")
                mnl = T.alloc_buffer(mn_local, mn_dtype, scope="local")
                dl = T.alloc_buffer(d_local, d_dtype, scope="local")
                d2l = T.alloc_buffer(d2_local, d2_dtype, scope="local")
                sl = T.alloc_buffer((2, R), "float32", scope="local")
                ol = T.alloc_buffer((2, R), "float32", scope="local")
                await_previous_kernel(dependent)
                zero_sums(acc)
                ss[0] = T.float32(0)
                for step in T.unroll((ITEMS + NT - 1) // NT):
                    if step * NT + t < ITEMS:
                        _item(acc, xv, ss, ql, hl, (scl, mnl, dl, d2l), sl, ol, (qs, qh, sc, mn, d, d2), x, nw, g,
                              step * NT + t, K, wtype, bits, halves, per, has_mn, has_d2, fold)
                block_sum_and_store(part, pss, acc, ss, t, g, y, res, NT, K, fold)

    return without_params(f, unused)


def wide_embedding_kernel(wtype: str, vocab: int, hidden: int) -> tvm.tirx.PrimFunc:
    """ids [1, n] (int32), the parts, x [1, n, hidden] (f32): the rows of a [vocab, hidden] table, one thread
    per value (as basic.embedding_kernel for the other formats)."""
    G, K, NT_E = vocab // R, hidden, 128
    CB = (hidden + NT_E - 1) // NT_E  # thread blocks per row
    (qs_shape, qs_dtype), (qh_shape, qh_dtype), (sc_shape, sc_dtype), (mn_shape, mn_dtype), (d_shape, d_dtype), \
        (d2_shape, d2_dtype), unused = union_buffers(wtype, G, K)

    @T.prim_func
    def f(ids_h: T.handle, qs: T.Buffer(qs_shape, qs_dtype), qh: T.Buffer(qh_shape, qh_dtype),
          sc: T.Buffer(sc_shape, sc_dtype), mn: T.Buffer(mn_shape, mn_dtype), d: T.Buffer(d_shape, d_dtype),
          d2: T.Buffer(d2_shape, d2_dtype), x_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        ids = T.match_buffer(ids_h, (1, n), "int32")
        x = T.match_buffer(x_h, (1, n, K), "float32")
        for bx in T.thread_binding(n * CB, thread="blockIdx.x"):
            for t in T.thread_binding(T.int64(NT_E), thread="threadIdx.x"):
                tok: T.let = bx // CB
                c: T.let = bx % CB * NT_E + t
                if c < K:
                    x[0, tok, c] = weight_value(wtype, (qs, qh, sc, mn, d, d2), ids[0, tok] // R, ids[0, tok] % R, c)

    return without_params(f, unused)
