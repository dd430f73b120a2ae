"""CUDA kernels of ragged variants (BlockKind.ragged): the rows of several sessions in one [1, rows] step,
session b's rows seq_starts[b] .. seq_starts[b + 1] - 1, each session with its own page table row and
history length (jitllm.ir.ops.RaggedPagedAttention; kernels/cpu/attention.py for the host's).

- Ragged attention: basic.attention_kernel's thread blocks (tile of BQ queries, head, online softmax over
  keys staged BKV at a time in shared memory) with the tiles taken per session: the grid holds every
  session's largest possible tile count (ceil(rows / BQ)) and the blocks past a session's rows end at
  once. A decode row is a tile of one query (f32 throughout, as the exact prefill kernel; no split over
  the history as the batch-1 decode attention has).
- Ragged KV append: one thread block per (row, KV head), one thread per head-dim value; each row finds
  its session by counting the sessions that end at or before it.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind
from jitllm.lowering.kernels.cuda.basic import BKV, BQ, NT
from jitllm.lowering.kernels.kv_store import Q8, buffer_amax, load, store_q8_element, stored


def ragged_attention_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc] | None:
    """RaggedPagedAttention: each session's rows as the causal queries of basic.attention_kernel over its
    own pages and its own new rows. None for head dims that do not divide NT."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    if D > NT or NT % D:
        return None
    GROUP = H // HKV
    scale = 1.0 / (D ** 0.5)
    QG = NT // D  # query groups: thread t owns column t % D of queries t // D, t // D + QG, ...
    QPT = BQ // QG  # queries per thread in the output
    KPT = BQ * BKV // NT  # keys per thread when scoring
    QPAD = D + 1  # padded rows: threads reading one column of different rows hit different banks
    symbol = f"jl_gpu_ragged_attention_h{H}_kv{HKV}_d{D}_p{P}"

    @T.prim_func
    def f(q_h: T.handle, k_h: T.handle, v_h: T.handle, pages_h: T.handle, pt_h: T.handle, past_h: T.handle,
          starts_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        NR = T.int64()
        B = T.int64()
        B1 = T.int64()
        NP = T.int64()
        MP = T.int64()
        q = T.match_buffer(q_h, (1, NR, H, D), "float32")
        k = T.match_buffer(k_h, (1, NR, HKV, D), "float32")
        v = T.match_buffer(v_h, (1, NR, HKV, D), "float32")
        pages = T.match_buffer(pages_h, (NP, 2, HKV, P, W), KV)
        pt = T.match_buffer(pt_h, (B, MP), "int32")
        past = T.match_buffer(past_h, (B,), "int32")
        starts = T.match_buffer(starts_h, (B1,), "int32")
        out = T.match_buffer(out_h, (1, NR, H, D), "float32")
        for blk in T.thread_binding(B * ((NR + BQ - 1) // BQ) * H, thread="blockIdx.x"):
            for tx in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                qs = T.alloc_buffer((BQ * QPAD,), "float32", scope="shared")
                ks = T.alloc_buffer((BKV * QPAD,), "float32", scope="shared")
                vs = T.alloc_buffer((BKV * D,), "float32", scope="shared")
                ps = T.alloc_buffer((BQ * BKV,), "float32", scope="shared")  # scores
                pp = T.alloc_buffer((BQ * BKV,), "float32", scope="shared")  # probabilities
                row_sum = T.alloc_buffer((BQ,), "float32", scope="shared")
                rescale = T.alloc_buffer((BQ,), "float32", scope="shared")
                st = T.alloc_buffer((2,), "float32", scope="local")
                sm = T.alloc_buffer((4,), "float32", scope="local")
                acc = T.alloc_buffer((QPT,), "float32", scope="local")
                score = T.alloc_buffer((KPT,), "float32", scope="local")
                vv = T.alloc_buffer((4,), "float32", scope="local")
                p4 = T.alloc_buffer((4,), "float32", scope="local")
                tiles: T.let = (NR + BQ - 1) // BQ
                b: T.let = blk // (tiles * H)
                s0: T.let = blk // H % tiles * BQ
                h: T.let = blk % H
                kv: T.let = h // GROUP
                first: T.let = T.Cast("int64", starts[b])
                S: T.let = T.Cast("int64", starts[b + 1]) - first  # this session's rows
                n: T.let = T.Cast("int64", past[b])
                keys: T.let = n + T.min(s0 + BQ, S)  # keys the tile's last query sees
                if s0 < S:  # (uniform over the block: its syncs stay matched)
                    for i in T.serial(BQ * D // NT):
                        e: T.let = i * NT + tx
                        qr: T.let = e // D
                        qs[qr * QPAD + e % D] = T.if_then_else(
                            s0 + qr < S, q[0, first + T.min(s0 + qr, S - 1), h, e % D] * T.float32(scale),
                            T.float32(0))
                    st[0] = T.float32(-3.0e38)
                    st[1] = T.float32(0)
                    for i in T.unroll(QPT):
                        acc[i] = T.float32(0)
                    for step in T.serial((keys + BKV - 1) // BKV):
                        k0: T.let = step * BKV
                        T.tvm_storage_sync("shared")
                        for i in T.serial(BKV * D // NT):
                            e: T.let = i * NT + tx
                            kr: T.let = e // D
                            pos: T.let = T.min(k0 + kr, keys - 1)
                            fresh: T.let = first + T.min(T.max(pos - n, T.int64(0)), S - 1)
                            page: T.let = T.Cast("int64", pt[b, T.min(pos, T.max(n - 1, T.int64(0))) // P])
                            ks[kr * QPAD + e % D] = T.Select(pos < n, load(pages, [page, 0, kv, pos % P, e % D]),
                                                             k[0, fresh, kv, e % D])
                            vs[kr * D + e % D] = T.Select(pos < n, load(pages, [page, 1, kv, pos % P, e % D]),
                                                          v[0, fresh, kv, e % D])
                        T.tvm_storage_sync("shared")
                        qr: T.let = tx // (BKV // KPT)
                        kc: T.let = tx % (BKV // KPT) * KPT
                        for j in T.unroll(KPT):
                            score[j] = T.float32(0)
                        for dd in T.serial(D):
                            for j in T.unroll(KPT):
                                score[j] = score[j] + qs[qr * QPAD + dd] * ks[(kc + j) * QPAD + dd]
                        for j in T.unroll(KPT):
                            ps[qr * BKV + kc + j] = T.Select(k0 + kc + j <= n + s0 + qr, score[j],
                                                             T.float32(-3.0e38))
                        T.tvm_storage_sync("shared")
                        if tx < BQ:  # thread tx keeps row tx's running max (st[0]) and sum (st[1])
                            sm[0] = st[0]
                            for j in T.serial(BKV):
                                sm[0] = T.max(sm[0], ps[tx * BKV + j])
                            sm[1] = T.exp(st[0] - sm[0])
                            rescale[tx] = sm[1]
                            sm[2] = T.float32(0)
                            for j in T.serial(BKV):
                                sm[3] = T.exp(ps[tx * BKV + j] - sm[0])
                                pp[tx * BKV + j] = sm[3]
                                sm[2] = sm[2] + sm[3]
                            st[0] = sm[0]
                            st[1] = st[1] * sm[1] + sm[2]
                        T.tvm_storage_sync("shared")
                        for i in T.unroll(QPT):
                            acc[i] = acc[i] * rescale[tx // D + i * QG]
                        for j4 in T.serial(BKV // 4):  # 4 keys: their V values in registers
                            for r in T.unroll(4):
                                vv[r] = vs[(j4 * 4 + r) * D + tx % D]
                            for i in T.unroll(QPT):
                                for r in T.vectorized(4):
                                    p4[r] = pp[(tx // D + i * QG) * BKV + j4 * 4 + r]
                                for r in T.unroll(4):
                                    acc[i] = acc[i] + p4[r] * vv[r]
                    if tx < BQ:
                        row_sum[tx] = st[1]
                    T.tvm_storage_sync("shared")
                    for i in T.unroll(QPT):
                        qo: T.let = tx // D + i * QG
                        if s0 + qo < S:
                            out[0, first + s0 + qo, h, tx % D] = acc[i] / row_sum[qo]

    return symbol, f.with_attr("global_symbol", symbol)


def ragged_append_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """Write each session's new K/V rows at its positions past[b] .. (in place)."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    HKV, D = c.kv_heads, c.head_dim
    symbol = f"jl_gpu_kv_append_ragged_kv{HKV}_d{D}_p{P}"

    @T.prim_func
    def f(pages_h: T.handle, k_h: T.handle, v_h: T.handle, pt_h: T.handle, past_h: T.handle, starts_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        NR = T.int64()
        B = T.int64()
        B1 = T.int64()
        NP = T.int64()
        MP = T.int64()
        pages = T.match_buffer(pages_h, (NP, 2, HKV, P, W), KV)
        k = T.match_buffer(k_h, (1, NR, HKV, D), "float32")
        v = T.match_buffer(v_h, (1, NR, HKV, D), "float32")
        pt = T.match_buffer(pt_h, (B, MP), "int32")
        past = T.match_buffer(past_h, (B,), "int32")
        starts = T.match_buffer(starts_h, (B1,), "int32")
        for th in T.thread_binding(NR * HKV, thread="blockIdx.x"):
            for dd in T.thread_binding(T.int64(D), thread="threadIdx.x"):
                seq = T.alloc_buffer((1,), "int64", scope="local")
                t: T.let = th // HKV
                h: T.let = th % HKV
                seq[0] = T.int64(0)
                for j in T.serial(B):
                    if T.Cast("int64", starts[j + 1]) <= t:
                        seq[0] = seq[0] + T.int64(1)
                b: T.let = seq[0]
                pos: T.let = T.Cast("int64", past[b]) + t - T.Cast("int64", starts[b])
                page: T.let = T.Cast("int64", pt[b, pos // P])
                if KV == Q8:  # (as basic.append_kernel)
                    store_q8_element(pages, page, 0, h, pos % P, dd, k[0, t, h, dd], buffer_amax(k, (0, t, h), dd), D)
                    store_q8_element(pages, page, 1, h, pos % P, dd, v[0, t, h, dd], buffer_amax(v, (0, t, h), dd), D)
                else:
                    pages[page, 0, h, pos % P, dd] = stored(k[0, t, h, dd], KV)
                    pages[page, 1, h, pos % P, dd] = stored(v[0, t, h, dd], KV)

    return symbol, f.with_attr("global_symbol", symbol)
