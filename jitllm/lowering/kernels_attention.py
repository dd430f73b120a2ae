"""TIR kernels for paged attention and for appending new K/V into a page pool.

The pool is [num_pages, 2, Hkv, P, D] (K at index 0, V at 1); a sequence's page table row lists its page
ids in position order, so position t lives at (page_table[b, t // P], t % P).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind


def attention_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """Causal attention of S new queries over `past` paged positions plus the S new keys (two passes)."""
    c, P = kind.config, kind.page_size
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    GROUP = H // HKV
    scale = 1.0 / (D ** 0.5)
    symbol = f"jl_paged_attention_h{H}_kv{HKV}_d{D}_p{P}"

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
        acc = T.alloc_buffer((D,), "float32")
        st = T.alloc_buffer((3,), "float32")  # running max, denominator, current score
        for b in T.serial(B):
            for s in T.serial(S):
                for h in T.serial(H):
                    n: T.let = T.Cast("int64", past[b])
                    kv: T.let = h // GROUP
                    st[0] = T.float32(-3.0e38)
                    for t in T.serial(n + s + 1):
                        st[2] = T.float32(0)
                        for dd in T.serial(D):
                            st[2] = st[2] + q[b, s, h, dd] * T.if_then_else(
                                t < n, pages[T.Cast("int64", pt[b, t // P]), 0, kv, t % P, dd],
                                k[b, T.max(t - n, T.int64(0)), kv, dd])
                        st[0] = T.max(st[0], st[2] * T.float32(scale))
                    st[1] = T.float32(0)
                    for dd in T.serial(D):
                        acc[dd] = T.float32(0)
                    for t in T.serial(n + s + 1):
                        st[2] = T.float32(0)
                        for dd in T.serial(D):
                            st[2] = st[2] + q[b, s, h, dd] * T.if_then_else(
                                t < n, pages[T.Cast("int64", pt[b, t // P]), 0, kv, t % P, dd],
                                k[b, T.max(t - n, T.int64(0)), kv, dd])
                        st[2] = T.exp(st[2] * T.float32(scale) - st[0])
                        st[1] = st[1] + st[2]
                        for dd in T.serial(D):
                            acc[dd] = acc[dd] + st[2] * T.if_then_else(
                                t < n, pages[T.Cast("int64", pt[b, t // P]), 1, kv, t % P, dd],
                                v[b, T.max(t - n, T.int64(0)), kv, dd])
                    for dd in T.serial(D):
                        out[b, s, h, dd] = acc[dd] / st[1]

    return symbol, f.with_attr("global_symbol", symbol)


def append_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """Write the S new K/V rows of each sequence at positions past[b] .. past[b]+S-1 (in place)."""
    c, P = kind.config, kind.page_size
    HKV, D = c.kv_heads, c.head_dim
    symbol = f"jl_kv_append_kv{HKV}_d{D}_p{P}"

    @T.prim_func
    def f(pages_h: T.handle, k_h: T.handle, v_h: T.handle, pt_h: T.handle, past_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B = T.int64()
        S = T.int64()
        NP = T.int64()
        MP = T.int64()
        pages = T.match_buffer(pages_h, (NP, 2, HKV, P, D), "float32")
        k = T.match_buffer(k_h, (B, S, HKV, D), "float32")
        v = T.match_buffer(v_h, (B, S, HKV, D), "float32")
        pt = T.match_buffer(pt_h, (B, MP), "int32")
        past = T.match_buffer(past_h, (B,), "int32")
        for b, s, h in T.grid(B, S, HKV):
            pos: T.let = T.Cast("int64", past[b]) + s
            page: T.let = T.Cast("int64", pt[b, pos // P])
            for dd in T.vectorized(D):
                pages[page, 0, h, pos % P, dd] = k[b, s, h, dd]
                pages[page, 1, h, pos % P, dd] = v[b, s, h, dd]

    return symbol, f.with_attr("global_symbol", symbol)
