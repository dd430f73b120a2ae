"""Prefill attention on tensor cores (the fast family): flash attention with `mma.sync` m16n8k16 (f16
operands, f32 accumulators) and an online softmax kept in registers.

One thread block per (sequence, tile of BQ = 64 queries, head), 4 warps of 16 query rows each. Q·Kᵀ for
BKV = 32 keys at a time lands in accumulators whose layout mma.sync fixes (each lane holds rows lane/4
and lane/4 + 8, columns 2·(lane%4) and +1 of every 8-key tile), so each row's running maximum and
sum are kept by the four lanes that share it (two shuffles per reduction), the output accumulators are
rescaled row by row, and the probabilities, rounded to f16, are already the A fragments of P·V: no
trip through shared memory. K and V are staged in shared memory as f16 ([key, d]: K read by `ldmatrix`,
V by `ldmatrix.trans`), the next step's values loaded into registers while this step's products run.

Precision: q/√d, K, V and the probabilities are rounded to f16 (measured on the H200: 3e-4 to 7e-4 of
the largest output, as f16 flash attention has); the exact family keeps kernels_gpu.attention_kernel
(f32 CUDA cores). Speed (H200, 512 new tokens): 29.6 us for the 3B shape and 16.8 us for SmolLM2's,
against 73.1 and 50.1 us for the WMMA kernel it replaced (two passes over the keys, because a WMMA
accumulator's layout is opaque and cannot be rescaled row by row). Rows past S read query S - 1 and are not
stored; keys past a query's position are masked.
"""

from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind
from jitllm.lowering.kernels.cuda.basic import shfl_xor
from jitllm.lowering.kernels.cuda.gemm import ldmatrix, mma
from jitllm.lowering.kernels.kv_store import load

NT = 128  # 4 warps
BQ, BKV = 64, 32  # queries per thread block, keys per step
LOG2E = 1.4426950408889634


def applies(kind: BlockKind) -> bool:
    """Head dims the fragments tile (multiples of 16, at most 128 to bound the accumulators)."""
    return kind.config.head_dim % 16 == 0 and kind.config.head_dim <= 128


@T.macro
def _load_kv(pages, k, v, pt, kv_r, b, kv, n, keys, k0, t, P, D, KI):
    """Keys k0 : k0 + BKV, K then V, into registers, four floats per item: from the pages below the
    history's length n, from the new keys above it (positions past `keys`: the last)."""
    for i in T.unroll(KI * 2):
        e: T.let = i % KI * NT + t
        pos: T.let = T.min(k0 + e // (D // 4), keys - 1)
        col: T.let = e % (D // 4) * 4
        if pos < n:
            for x in T.vectorized(4):
                kv_r[i * 4 + x] = load(pages, [T.Cast("int64", pt[b, pos // P]), i // KI, kv, pos % P, col + x])
        elif i < KI:
            for x in T.vectorized(4):
                kv_r[i * 4 + x] = k[b, pos - n, kv, col + x]
        else:
            for x in T.vectorized(4):
                kv_r[i * 4 + x] = v[b, pos - n, kv, col + x]


def mma_attention_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """The same signature and semantics as kernels_gpu.attention_kernel (q, k, v, pages, page table,
    past lengths, out)."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    if not applies(kind):
        raise ValueError(f"head_dim {D} is not a multiple of 16 up to 128")
    GROUP = H // HKV
    qscale = LOG2E / math.sqrt(D)  # scores in base 2: exp2 on the SFU
    LD = D + 8  # halves per row of Q / K / V in shared memory (ldmatrix rows on distinct banks)
    FD = D // 16  # k16 steps across the head dim (Q·Kᵀ)
    ND = D // 8  # n8 tiles across the head dim (P·V)
    NK = BKV // 8  # n8 tiles across a step's keys
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
        pages = T.match_buffer(pages_h, (NP, 2, HKV, P, W), KV)
        pt = T.match_buffer(pt_h, (B, MP), "int32")
        past = T.match_buffer(past_h, (B,), "int32")
        out = T.match_buffer(out_h, (B, S, H, D), "float32")
        for blk in T.thread_binding(B * ((S + BQ - 1) // BQ) * H, thread="blockIdx.x"):
            for t in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                # rows [0, BKV): K, [BKV, 2 BKV): V; before the steps, the Q tile (BQ = 2 BKV rows)
                kv_s = T.alloc_buffer((2 * BKV * LD,), "float16", scope="shared")
                fq = T.alloc_buffer((FD * 8,), "float16", scope="local")
                fk = T.alloc_buffer((8,), "float16", scope="local")
                fp = T.alloc_buffer((BKV // 16 * 8,), "float16", scope="local")
                fv = T.alloc_buffer((8,), "float16", scope="local")
                sacc = T.alloc_buffer((NK * 4,), "float32", scope="local")
                oacc = T.alloc_buffer((ND * 4,), "float32", scope="local")
                mx = T.alloc_buffer((4,), "float32", scope="local")  # rows lane/4, +8: max; then new max
                sm = T.alloc_buffer((2,), "float32", scope="local")  # this lane's part of each row's sum
                cr = T.alloc_buffer((2,), "float32", scope="local")  # each row's rescale factor
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
                for i in T.unroll(QI):
                    e: T.let = i * NT + t
                    qr: T.let = e // (D // 4)
                    for x in T.vectorized(4):
                        kv_s[qr * LD + e % (D // 4) * 4 + x] = T.Cast(
                            "float16", q[b, T.min(s0 + qr, S - 1), h, e % (D // 4) * 4 + x] * T.float32(qscale))
                T.tvm_storage_sync("shared")
                for dd in T.unroll(FD):
                    T.evaluate(ldmatrix(fq, dd * 8, kv_s, (warp * 16 + lane % 16) * LD + dd * 16 + lane // 16 * 8,
                                        False))
                for i in T.serial(ND * 4):
                    oacc[i] = T.float32(0)
                for r in T.serial(2):
                    mx[r] = T.float32(-3.0e38)
                    sm[r] = T.float32(0)
                steps: T.let = (keys + BKV - 1) // BKV
                _load_kv(pages, k, v, pt, kv_r, b, kv, n, keys, T.int64(0), t, P, D, KI)
                for step in T.serial(steps):
                    k0: T.let = step * BKV
                    T.tvm_storage_sync("shared")
                    for i in T.unroll(KI * 2):
                        e: T.let = i % KI * NT + t
                        for x in T.vectorized(4):
                            kv_s[(i // KI * BKV + e // (D // 4)) * LD + e % (D // 4) * 4 + x] = T.Cast(
                                "float16", kv_r[i * 4 + x])
                    T.tvm_storage_sync("shared")
                    # the next step's keys are on their way while this one's products run (the last step
                    # loads itself again)
                    _load_kv(pages, k, v, pt, kv_r, b, kv, n, keys, T.min(k0 + BKV, (steps - 1) * BKV), t, P, D, KI)
                    for i in T.serial(NK * 4):
                        sacc[i] = T.float32(0)
                    for jj in T.unroll(NK // 2):  # two 8-key tiles per ldmatrix.x4 of K
                        for dd in T.unroll(FD):
                            T.evaluate(ldmatrix(fk, 0, kv_s, (jj * 16 + lane % 8 + lane // 16 * 8) * LD + dd * 16
                                                + lane // 8 % 2 * 8, False))
                            T.evaluate(mma(fq, dd * 8, fk, 0, sacc, jj * 8))
                            T.evaluate(mma(fq, dd * 8, fk, 4, sacc, jj * 8 + 4))
                    # masks, then each row's new maximum over its four lanes
                    for r in T.unroll(2):
                        mx[2 + r] = mx[r]
                        for j in T.unroll(NK):
                            for e in T.unroll(2):
                                if k0 + j * 8 + lane % 4 * 2 + e > n + s0 + warp * 16 + r * 8 + lane // 4:
                                    sacc[j * 4 + r * 2 + e] = T.float32(-3.0e38)
                                mx[2 + r] = T.max(mx[2 + r], sacc[j * 4 + r * 2 + e])
                        mx[2 + r] = T.max(mx[2 + r], shfl_xor(mx[2 + r], 1))
                        mx[2 + r] = T.max(mx[2 + r], shfl_xor(mx[2 + r], 2))
                        cr[r] = T.exp2(mx[r] - mx[2 + r])
                        mx[r] = mx[2 + r]
                        sm[r] = sm[r] * cr[r]
                    for j in T.unroll(NK):
                        for r in T.unroll(2):
                            for e in T.unroll(2):
                                sacc[j * 4 + r * 2 + e] = T.exp2(sacc[j * 4 + r * 2 + e] - mx[r])
                                sm[r] = sm[r] + sacc[j * 4 + r * 2 + e]
                                # A fragment of P·V: the 16 keys kk = j // 2 hold registers a0..a3 =
                                # (row r, keys 0-7 | 8-15) in the order (r0, lo), (r1, lo), (r0, hi), (r1, hi)
                                fp[j // 2 * 8 + j % 2 * 4 + r * 2 + e] = T.Cast("float16", sacc[j * 4 + r * 2 + e])
                    for i in T.unroll(ND):
                        for r in T.unroll(2):
                            for e in T.unroll(2):
                                oacc[i * 4 + r * 2 + e] = oacc[i * 4 + r * 2 + e] * cr[r]
                    for kk in T.unroll(BKV // 16):
                        for dd in T.unroll(ND // 2):  # two 8-wide d tiles per ldmatrix.x4.trans of V
                            T.evaluate(ldmatrix(fv, 0, kv_s, (BKV + kk * 16 + lane % 16) * LD + dd * 16 + lane // 16 * 8,
                                                True))
                            T.evaluate(mma(fp, kk * 8, fv, 0, oacc, dd * 8))
                            T.evaluate(mma(fp, kk * 8, fv, 4, oacc, dd * 8 + 4))
                for r in T.unroll(2):  # the row's sum over its four lanes
                    sm[r] = sm[r] + shfl_xor(sm[r], 1)
                    sm[r] = sm[r] + shfl_xor(sm[r], 2)
                    sm[r] = T.float32(1) / sm[r]
                for i in T.unroll(ND):
                    for r in T.unroll(2):
                        if s0 + warp * 16 + r * 8 + lane // 4 < S:
                            for e in T.vectorized(2):
                                out[b, s0 + warp * 16 + r * 8 + lane // 4, h, i * 8 + lane % 4 * 2 + e] = \
                                    oacc[i * 4 + r * 2 + e] * sm[r]

    return symbol, f.with_attr("global_symbol", symbol)
