"""Prefill attention on tensor cores (the fast family): WMMA 16x16x16 tiles with f16 operands and f32
accumulation, written as TIR with TVM's WMMA builtins like kernels_gpu_mma.py.

One thread block per (sequence, tile of BQ = 64 queries, head), 4 warps of 16 query rows each; the
history and the new keys are read BKV = 32 keys at a time into shared memory as f16. Two passes over
the keys instead of an online softmax, because a WMMA accumulator cannot be rescaled row by row (its
element layout is opaque): the first pass computes Q·Kᵀ and each row's maximum and sum of
exponentials, the second computes Q·Kᵀ again, the normalised probabilities (f16) and P·V into
accumulators that are stored once. The extra Q·Kᵀ costs tensor-core time, which is not what bounds
this kernel.

Precision: q/√d, K, V and the probabilities are rounded to f16 (measured on the H200: 4e-4 to 6e-4 of
the largest output, as f16 flash attention has); the exact family keeps kernels_gpu.attention_kernel (f32 CUDA cores).
Rows past S read query S - 1 and are not stored; keys past a query's position are masked.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind
from jitllm.lowering.kernels_gpu_gemv_int8 import shfl_xor
from jitllm.lowering.kernels_gpu_mma import wmma_load, wmma_store

NT = 128  # 4 warps
BQ, BKV = 64, 32  # queries per thread block, keys per step
LS = BKV + 4  # floats per row of the scores' staging
LP = BKV + 8  # halves per row of the probabilities


def applies(kind: BlockKind) -> bool:
    """Head dims the fragments tile (multiples of 16, at most 128 to bound the accumulators)."""
    return kind.config.head_dim % 16 == 0 and kind.config.head_dim <= 128


@T.macro
def _load_kv(pages, k, v, pt, kv_r, b, kv, n, keys, k0, t, phase, P, D, KI):
    """Keys k0 : k0 + BKV (K, and in the second phase V) into registers, four floats per item: from the
    pages below the history's length n, from the new keys above it (positions past `keys`: the last)."""
    for i in T.unroll(KI * 2):
        e: T.let = i % KI * NT + t
        pos: T.let = T.min(k0 + e // (D // 4), keys - 1)
        col: T.let = e % (D // 4) * 4
        if i < KI or phase == 1:
            if pos < n:
                for x in T.vectorized(4):
                    kv_r[i * 4 + x] = pages[T.Cast("int64", pt[b, pos // P]), i // KI, kv, pos % P, col + x]
            elif i < KI:
                for x in T.vectorized(4):
                    kv_r[i * 4 + x] = k[b, pos - n, kv, col + x]
            else:
                for x in T.vectorized(4):
                    kv_r[i * 4 + x] = v[b, pos - n, kv, col + x]


def mma_attention_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """The same signature and semantics as kernels_gpu.attention_kernel (q, k, v, pages, page table,
    past lengths, out)."""
    c, P = kind.config, kind.page_size
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    if not applies(kind):
        raise ValueError(f"head_dim {D} is not a multiple of 16 up to 128")
    GROUP = H // HKV
    scale = 1.0 / (D ** 0.5)
    LD = D + 8  # halves per row of Q / K / V in shared memory (keeps WMMA loads off one bank)
    FD = D // 16  # fragments across the head dim
    FK = BKV // 16  # fragments across a step's keys
    QI = BQ * D // 4 // NT  # float4 items per thread: the Q tile
    KI = BKV * D // 4 // NT  # and one step's K (or V)
    symbol = f"jl_gpu_mma_attention_h{H}_kv{HKV}_d{D}_p{P}"

    @T.prim_func
    def f(q_h: T.handle, k_h: T.handle, v_h: T.handle, pages_h: T.handle, pt_h: T.handle, past_h: T.handle,
          out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B = T.int64()
        S = T.int64()
        NP = T.int64()
        MP = T.int64()
        q = T.match_buffer(q_h, (B, S, H, D), "float32")
        k = T.match_buffer(k_h, (B, S, HKV, D), "float32")
        v = T.match_buffer(v_h, (B, S, HKV, D), "float32")
        pages = T.match_buffer(pages_h, (NP, 2, HKV, P, D), "float32")
        pt = T.match_buffer(pt_h, (B, MP), "int32")
        past = T.match_buffer(past_h, (B,), "int32")
        out = T.match_buffer(out_h, (B, S, H, D), "float32")
        for blk in T.thread_binding(B * ((S + BQ - 1) // BQ) * H, thread="blockIdx.x"):
            for t in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                # rows [0, BKV): K, [BKV, 2 BKV): V; before the passes, the Q tile (BQ = 2 BKV rows)
                kv_s = T.alloc_buffer((2 * BKV * LD,), "float16", scope="shared")
                p_s = T.alloc_buffer((BQ * LP,), "float16", scope="shared")
                # f32 staging of the scores (and at the end of the output); shared.dyn keeps it out of
                # the f16 buffers' merged allocation (an f32 pointer into it fails the access_ptr check)
                s_s = T.alloc_buffer((BQ * LS,), "float32", scope="shared.dyn")
                fq = T.alloc_buffer((FD * 16, 16), "float16", scope="wmma.matrix_a")
                fk = T.alloc_buffer((16, 16), "float16", scope="wmma.matrix_b")
                fp = T.alloc_buffer((FK * 16, 16), "float16", scope="wmma.matrix_a")
                fv = T.alloc_buffer((16, 16), "float16", scope="wmma.matrix_b")
                fs = T.alloc_buffer((16, FK * 16), "float32", scope="wmma.accumulator")
                fo = T.alloc_buffer((16, FD * 16), "float32", scope="wmma.accumulator")
                st = T.alloc_buffer((4,), "float32", scope="local")  # row max, row sum, then 1/sum
                kv_r = T.alloc_buffer((KI * 2 * 4,), "float32", scope="local")  # the next step's K and V
                tiles: T.let = (S + BQ - 1) // BQ
                b: T.let = blk // (tiles * H)
                s0: T.let = (tiles - 1 - blk // H % tiles) * BQ  # the longest tiles first
                h: T.let = blk % H
                kv: T.let = h // GROUP
                n: T.let = T.Cast("int64", past[b])
                keys: T.let = n + T.min(s0 + BQ, S)  # keys the tile's last query sees
                warp: T.let = t // 32
                lane: T.let = t % 32
                row: T.let = warp * 16 + lane % 16  # this lane's query row in the softmax steps
                side: T.let = lane // 16  # and which half of a step's keys it takes
                last: T.let = n + s0 + row  # the last key position the row sees
                for i in T.unroll(QI):
                    e: T.let = i * NT + t
                    qr: T.let = e // (D // 4)
                    for x in T.vectorized(4):
                        kv_s[qr * LD + e % (D // 4) * 4 + x] = T.Cast(
                            "float16", q[b, T.min(s0 + qr, S - 1), h, e % (D // 4) * 4 + x] * T.float32(scale))
                T.tvm_storage_sync("shared")
                for dd in T.unroll(FD):
                    T.evaluate(wmma_load(fq, dd, kv_s, warp * 16 * LD + dd * 16, LD))
                    T.evaluate(T.tvm_fill_fragment(fo.data, 16, 16, 16, dd, T.float32(0)))
                st[0] = T.float32(-3.0e38)
                st[1] = T.float32(0)
                for phase in T.serial(2):  # 0: row maxima and sums; 1: probabilities and P·V
                    steps: T.let = (keys + BKV - 1) // BKV
                    _load_kv(pages, k, v, pt, kv_r, b, kv, n, keys, T.int64(0), t, phase, P, D, KI)
                    for step in T.serial(steps):
                        k0: T.let = step * BKV
                        T.tvm_storage_sync("shared")
                        for i in T.unroll(KI * 2):  # K, and in the second phase V
                            e: T.let = i % KI * NT + t
                            if i < KI or phase == 1:
                                for x in T.vectorized(4):
                                    kv_s[(i // KI * BKV + e // (D // 4)) * LD + e % (D // 4) * 4 + x] = T.Cast(
                                        "float16", kv_r[i * 4 + x])
                        T.tvm_storage_sync("shared")
                        # the next step's keys are on their way while this one's products run (the last
                        # step loads itself again)
                        _load_kv(pages, k, v, pt, kv_r, b, kv, n, keys, T.min(k0 + BKV, (steps - 1) * BKV), t, phase,
                                 P, D, KI)
                        for j in T.unroll(FK):
                            T.evaluate(T.tvm_fill_fragment(fs.data, 16, 16, 16, j, T.float32(0)))
                            for dd in T.unroll(FD):
                                T.evaluate(wmma_load(fk, 0, kv_s, j * 16 * LD + dd * 16, LD, "col_major"))
                                T.evaluate(T.tvm_mma_sync(fs.data, j, fq.data, dd, fk.data, 0, fs.data, j))
                            T.evaluate(wmma_store(fs, j, s_s, warp * 16 * LS + j * 16, LS))
                        T.tvm_storage_sync("shared")
                        if phase == 0:  # this lane's half of the row: running max st[0] and sum st[1]
                            st[2] = st[0]
                            for cc in T.serial(BKV // 2):
                                kc: T.let = side * (BKV // 2) + cc
                                if k0 + kc <= last:
                                    st[2] = T.max(st[2], s_s[row * LS + kc])
                            st[1] = st[1] * T.exp(st[0] - st[2])
                            for cc in T.serial(BKV // 2):
                                kc: T.let = side * (BKV // 2) + cc
                                if k0 + kc <= last:
                                    st[1] = st[1] + T.exp(s_s[row * LS + kc] - st[2])
                            st[0] = st[2]
                        else:
                            for cc in T.serial(BKV // 2):
                                kc: T.let = side * (BKV // 2) + cc
                                p_s[row * LP + kc] = T.Cast("float16", T.Select(
                                    k0 + kc <= last, T.exp(s_s[row * LS + kc] - st[0]) * st[3], T.float32(0)))
                            T.tvm_storage_sync("shared")
                            for j in T.unroll(FK):
                                T.evaluate(wmma_load(fp, j, p_s, warp * 16 * LP + j * 16, LP))
                            for dd in T.unroll(FD):
                                for j in T.unroll(FK):
                                    T.evaluate(wmma_load(fv, 0, kv_s, (BKV + j * 16) * LD + dd * 16, LD))
                                    T.evaluate(T.tvm_mma_sync(fo.data, dd, fp.data, j, fv.data, 0, fo.data, dd))
                    if phase == 0:  # the two halves of each row merged: both lanes hold the row's max and 1/sum
                        st[2] = T.max(st[0], shfl_xor(st[0], 16))
                        st[1] = st[1] * T.exp(st[0] - st[2])
                        st[3] = T.float32(1) / (st[1] + shfl_xor(st[1], 16))
                        st[0] = st[2]
                T.tvm_storage_sync("shared")
                for dd in T.serial(FD):
                    T.evaluate(wmma_store(fo, dd, s_s, warp * 16 * LS, LS))
                    T.tvm_storage_sync("shared")
                    for i in T.unroll(8):
                        e: T.let = i * 32 + lane
                        if s0 + warp * 16 + e // 16 < S:
                            out[b, s0 + warp * 16 + e // 16, h, dd * 16 + e % 16] = s_s[(warp * 16 + e // 16) * LS + e % 16]
                    T.tvm_storage_sync("shared")

    return symbol, f.with_attr("global_symbol", symbol)
