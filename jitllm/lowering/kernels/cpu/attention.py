"""TIR kernels for paged attention and for appending new K/V into a page pool.

The pool is [num_pages, 2, Hkv, P, row] (K at index 0, V at 1) of the kind's KV type (f32 or f16 rows of D
values, or q8_0 rows of D quants and their scales: kind.kv_row; read and written through kernels/kv_store.py,
the arithmetic is f32); a sequence's page table row lists its page ids in position order, so position t
lives at (page_table[b, t // P], t % P).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind
from jitllm.lowering.kernels.kv_store import Q8, load, q8_row_store, stored, vload


def _tile_macro(P: int, D: int, scale: float):
    """One tile of up to P keys of an online softmax (see attention_kernel), for one work item's query
    at q[b, s, h] (its output row and scratch at the same index)."""
    VD = f"float32x{D}"

    def dot(qv, kb, kidx):
        prod = qv * vload(kb, kidx, D)
        return _hsum(prod, D)

    @T.macro
    def tile(q, kb, vb, out, st, sc, b, s, h, kidx, vidx, a0, a1, i, cnt):
        # key/value j of this tile: kb[kidx(a0, a1, i, j)], vb[vidx(...)]; st[.., 0] running max,
        # st[.., 1] running denominator, st[.., 2] the tile's max; sc the tile's scores, then weights
        qv: T.let = q.vload([b, s, h, 0], VD)
        st[b, s, h, 2] = st[b, s, h, 0]
        for j in T.serial(cnt):
            sc[b, s, h, j] = dot(qv, kb, kidx(a0, a1, i, j)) * T.float32(scale)
            st[b, s, h, 2] = T.max(st[b, s, h, 2], sc[b, s, h, j])
        mx: T.let = st[b, s, h, 2]
        alpha: T.let = vexp(st[b, s, h, 0] - mx)
        sc[b, s, h, T.ramp(0, 1, P)] = vexp(sc[b, s, h, T.ramp(0, 1, P)] - T.Broadcast(mx, P))
        st[b, s, h, 0] = mx
        st[b, s, h, 1] = st[b, s, h, 1] * alpha
        out[b, s, h, T.ramp(0, 1, D)] = out[b, s, h, T.ramp(0, 1, D)] * T.Broadcast(alpha, D)
        for j in T.serial(cnt):
            st[b, s, h, 1] = st[b, s, h, 1] + sc[b, s, h, j]
            out[b, s, h, T.ramp(0, 1, D)] = (out[b, s, h, T.ramp(0, 1, D)]
                                             + T.Broadcast(sc[b, s, h, j], D) * vload(vb, vidx(a0, a1, i, j), D))

    return tile


def attention_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """Causal attention of S new queries over `past` paged positions plus the S new keys.

    Parallel over (sequence, query, head); per work item an online softmax over tiles of P keys (one page
    of history, or P of the new keys): P scores (vectorised over the head dimension), one rescale of the
    running output per tile, then the weighted values. The running output lives in `out` itself and the
    running max / denominator in a scratch indexed by the work item, so nothing is allocated per item.
    f32 arithmetic throughout (both kernel families use it), whatever the pool stores."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    if D % 8:
        return _attention_serial(kind)
    GROUP = H // HKV
    scale = 1.0 / (D ** 0.5)
    symbol = f"jl_paged_attention_h{H}_kv{HKV}_d{D}_p{P}_par"

    tile = _tile_macro(P, D, scale)

    @T.macro
    def item_attention(q, k, v, pages, pt, past, out, st, sc, item):
        # one (sequence, query, head): an online softmax over its history pages, then its new keys
        b: T.let = item // (q.shape[1] * H)
        s: T.let = item // H % q.shape[1]
        h: T.let = item % H
        kv: T.let = h // GROUP
        n: T.let = T.Cast("int64", past[b])
        st[b, s, h, 0] = T.float32(-3.0e38)
        st[b, s, h, 1] = T.float32(0)
        out[b, s, h, T.ramp(0, 1, D)] = T.Broadcast(T.float32(0), D)
        for i in T.serial((n + P - 1) // P):
            page: T.let = T.Cast("int64", pt[b, i])
            tile(q, pages, pages, out, st, sc, b, s, h, _page_k, _page_v, page, kv, i,
                 T.min(n - i * P, T.int64(P)))
        for i in T.serial((s + P) // P):
            tile(q, k, v, out, st, sc, b, s, h, _new_kv, _new_kv, b, kv, i * P,
                 T.min(s + 1 - i * P, T.int64(P)))
        inv: T.let = T.float32(1) / st[b, s, h, 1]
        out[b, s, h, T.ramp(0, 1, D)] = out[b, s, h, T.ramp(0, 1, D)] * T.Broadcast(inv, D)

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
        st = T.alloc_buffer((B, S, H, 3), "float32")
        sc = T.alloc_buffer((B, S, H, P), "float32")
        if B * S * H * (T.Cast("int64", past[0]) + S) < SERIAL_WORK:
            for item in T.serial(B * S * H):
                item_attention(q, k, v, pages, pt, past, out, st, sc, item)
        else:
            for item in T.parallel(B * S * H):
                item_attention(q, k, v, pages, pt, past, out, st, sc, item)

    return symbol, f.with_attr("global_symbol", symbol)


def ragged_attention_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc] | None:
    """RaggedPagedAttention (jitllm.ir.ops): the rows of several sequences, each row a work item of
    attention_kernel's online softmax over its own sequence's pages and earlier new rows, so a row's
    output is computed exactly as it is when its sequence runs alone. Rows are mapped to their sequence
    once per call (a serial pass over seq_starts). None for head dims the vector kernel does not take."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    if D % 8:
        return None
    GROUP = H // HKV
    scale = 1.0 / (D ** 0.5)
    symbol = f"jl_ragged_attention_h{H}_kv{HKV}_d{D}_p{P}"
    tile = _tile_macro(P, D, scale)

    @T.macro
    def row_attention(q, k, v, pages, pt, past, starts, seq_of, out, st, sc, item):
        t: T.let = item // H
        h: T.let = item % H
        kv: T.let = h // GROUP
        b: T.let = T.Cast("int64", seq_of[t])
        first: T.let = T.Cast("int64", starts[b])
        s: T.let = t - first
        n: T.let = T.Cast("int64", past[b])
        st[0, t, h, 0] = T.float32(-3.0e38)
        st[0, t, h, 1] = T.float32(0)
        out[0, t, h, T.ramp(0, 1, D)] = T.Broadcast(T.float32(0), D)
        for i in T.serial((n + P - 1) // P):
            page: T.let = T.Cast("int64", pt[b, i])
            tile(q, pages, pages, out, st, sc, 0, t, h, _page_k, _page_v, page, kv, i,
                 T.min(n - i * P, T.int64(P)))
        for i in T.serial((s + P) // P):
            tile(q, k, v, out, st, sc, 0, t, h, _new_kv, _new_kv, 0, kv, first + i * P,
                 T.min(s + 1 - i * P, T.int64(P)))
        inv: T.let = T.float32(1) / st[0, t, h, 1]
        out[0, t, h, T.ramp(0, 1, D)] = out[0, t, h, T.ramp(0, 1, D)] * T.Broadcast(inv, D)

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
        st = T.alloc_buffer((1, NR, H, 3), "float32")
        sc = T.alloc_buffer((1, NR, H, P), "float32")
        seq_of = T.alloc_buffer((NR,), "int32")
        for b in T.serial(B):
            for t in T.serial(T.Cast("int64", starts[b]), T.Cast("int64", starts[b + 1])):
                seq_of[t] = T.Cast("int32", b)
        if NR * H * (T.Cast("int64", past[0]) + NR) < SERIAL_WORK:
            for item in T.serial(NR * H):
                row_attention(q, k, v, pages, pt, past, starts, seq_of, out, st, sc, item)
        else:
            for item in T.parallel(NR * H):
                row_attention(q, k, v, pages, pt, past, starts, seq_of, out, st, sc, item)

    return symbol, f.with_attr("global_symbol", symbol)


SERIAL_WORK = 9 * 12
"""(query, head) x key pairs below which the attention runs on the calling thread. Measured on the
2-vCPU VM (9 heads, one query): 2 threads 3.2 / 7.7 / 10.2 / 18.1 / 36.0 us against 1 thread
4.2 / 7.7 / 14.1 / 29.1 / 60.1 us at 16 / 64 / 128 / 256 / 512 positions."""


def _hsum(v, lanes: int):
    """Sum of a float vector expression: halving adds down to 8 lanes, then shuffles."""
    while lanes > 1:
        half = lanes // 2
        v = T.Shuffle([v], list(range(half))) + T.Shuffle([v], list(range(half, lanes)))
        lanes = half
    return v


def vexp(x):
    """exp of a float32 scalar or vector expression without libm calls (LLVM would scalarise a vector
    exp into expf calls): Cephes' expf, range-reduced by powers of two, within ~2 ulp for x >= -87
    (smaller x give exp(-87.3) ~ 1e-38 instead of a smaller denormal or zero)."""
    if not hasattr(x, "ty"):  # a te.Tensor element
        x = x.asobject()
    lanes = x.ty.dtype.lanes

    def c(v, dtype="float32"):
        v = tvm.tirx.const(v, dtype)
        return T.Broadcast(v, lanes) if lanes > 1 else v

    xc = T.max(T.min(x, c(88.3762626647949)), c(-87.3365447505531))
    n = T.floor(xc * c(1.44269504088896341) + c(0.5))
    r = xc - n * c(0.693359375) + n * c(2.12194440e-4)
    p = c(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + c(coef)
    y = p * r * r + r + c(1.0)
    itype = "int32" if lanes == 1 else f"int32x{lanes}"
    two_n = T.shift_left(T.Cast(itype, n) + c(127, "int32"), c(23, "int32"))
    return y * T.reinterpret("float32" if lanes == 1 else f"float32x{lanes}", two_n)


def _page_k(page, kv, i, j):
    return [page, 0, kv, j, 0]


def _page_v(page, kv, i, j):
    return [page, 1, kv, j, 0]


def _new_kv(b, kv, t0, j):
    return [b, t0 + j, kv, 0]


def _attention_serial(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """The scalar two-pass kernel (any head dim): serial over sequences, queries and heads."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
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
        pages = T.match_buffer(pages_h, (NP, 2, HKV, P, W), KV)
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
                                t < n, load(pages, [T.Cast("int64", pt[b, t // P]), 0, kv, t % P, dd]),
                                k[b, T.max(t - n, T.int64(0)), kv, dd])
                        st[0] = T.max(st[0], st[2] * T.float32(scale))
                    st[1] = T.float32(0)
                    for dd in T.serial(D):
                        acc[dd] = T.float32(0)
                    for t in T.serial(n + s + 1):
                        st[2] = T.float32(0)
                        for dd in T.serial(D):
                            st[2] = st[2] + q[b, s, h, dd] * T.if_then_else(
                                t < n, load(pages, [T.Cast("int64", pt[b, t // P]), 0, kv, t % P, dd]),
                                k[b, T.max(t - n, T.int64(0)), kv, dd])
                        st[2] = T.exp(st[2] * T.float32(scale) - st[0])
                        st[1] = st[1] + st[2]
                        for dd in T.serial(D):
                            acc[dd] = acc[dd] + st[2] * T.if_then_else(
                                t < n, load(pages, [T.Cast("int64", pt[b, t // P]), 1, kv, t % P, dd]),
                                v[b, T.max(t - n, T.int64(0)), kv, dd])
                    for dd in T.serial(D):
                        out[b, s, h, dd] = acc[dd] / st[1]

    return symbol, f.with_attr("global_symbol", symbol)


def append_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """Write the S new K/V rows of each sequence at positions past[b] .. past[b]+S-1 (in place; a q8_0
    pool's rows quantized block by block)."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    HKV, D = c.kv_heads, c.head_dim
    symbol = f"jl_kv_append_kv{HKV}_d{D}_p{P}"
    store_row = q8_row_store(D)

    @T.prim_func
    def f(pages_h: T.handle, k_h: T.handle, v_h: T.handle, pt_h: T.handle, past_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B = T.int64()
        S = T.int64()
        NP = T.int64()
        MP = T.int64()
        pages = T.match_buffer(pages_h, (NP, 2, HKV, P, W), KV)
        k = T.match_buffer(k_h, (B, S, HKV, D), "float32")
        v = T.match_buffer(v_h, (B, S, HKV, D), "float32")
        pt = T.match_buffer(pt_h, (B, MP), "int32")
        past = T.match_buffer(past_h, (B,), "int32")
        for b, s, h in T.grid(B, S, HKV):
            pos: T.let = T.Cast("int64", past[b]) + s
            page: T.let = T.Cast("int64", pt[b, pos // P])
            if KV == Q8:
                store_row(pages, page, 0, h, pos % P, k, b, s, h)
                store_row(pages, page, 1, h, pos % P, v, b, s, h)
            else:
                for dd in T.vectorized(D):
                    pages[page, 0, h, pos % P, dd] = stored(k[b, s, h, dd], KV)
                    pages[page, 1, h, pos % P, dd] = stored(v[b, s, h, dd], KV)

    return symbol, f.with_attr("global_symbol", symbol)


def ragged_append_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """Write each sequence's new K/V rows (rows seq_starts[b] .. seq_starts[b+1]-1 of a ragged step) at its
    positions past[b] .. (in place)."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    HKV, D = c.kv_heads, c.head_dim
    symbol = f"jl_kv_append_ragged_kv{HKV}_d{D}_p{P}"
    store_row = q8_row_store(D)

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
        for b in T.serial(B):
            for t in T.serial(T.Cast("int64", starts[b]), T.Cast("int64", starts[b + 1])):
                for h in T.serial(HKV):
                    pos: T.let = T.Cast("int64", past[b]) + t - T.Cast("int64", starts[b])
                    page: T.let = T.Cast("int64", pt[b, pos // P])
                    if KV == Q8:
                        store_row(pages, page, 0, h, pos % P, k, 0, t, h)
                        store_row(pages, page, 1, h, pos % P, v, 0, t, h)
                    else:
                        for dd in T.vectorized(D):
                            pages[page, 0, h, pos % P, dd] = stored(k[0, t, h, dd], KV)
                            pages[page, 1, h, pos % P, dd] = stored(v[0, t, h, dd], KV)

    return symbol, f.with_attr("global_symbol", symbol)
