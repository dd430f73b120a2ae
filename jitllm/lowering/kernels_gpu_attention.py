"""Split-history paged decode attention for GPUs (batch 1, one new token).

One query token has too little work for one thread block per head (DESIGN.md §3: 8 blocks at batch 1,
77 of 164 µs per block). Here the history is cut into `CHUNKS` equal chunks per KV head; one thread
block per (KV head, chunk) runs an online softmax over its chunk for all the query heads of its group,
tile by tile through shared memory, and writes its partial state (accumulator, max, denominator) to a
workspace; a second kernel merges the chunks of each head. Chunks start at 32 positions each, so at
short histories most chunks are past the history: their blocks stop after the append, and the merge
reads only the chunks that hold positions (weighting the rest 0). The grid never depends on the history
length (it is read from `past` on the device), so the launch can live in a CUDA graph.

The partial kernel also appends the step's K and V to the pages (the chunk-0 block of each KV head
writes position `past`, which no block reads from the pages: the scores take the new token's K and V
from the inputs), so a decode step needs no separate append launch (`APPENDS_KV`). In fused decode
variants (RotaryPagedAttention) it reads q, k and v from the Q/K/V projection itself and applies the
rotary embedding as it reads them, so the step has no rotary launch either. Both kernels can be launched
dependent (kernels_gpu.await_previous_kernel).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind
from jitllm.lowering.kernels_gpu import await_previous_kernel, dependent_launch

CHUNKS = 64  # chunks per KV head
TILE = 32  # positions per shared-memory tile
NT = 128  # threads per block
SPLIT = 4  # threads per score (each sums D / SPLIT products: short dependency chains)
NEG = -3.0e38
APPENDS_KV = True
"""The partial kernel writes the step's K and V into the pages (the runtime skips the append kernel)."""


def workspace_shape(kind: BlockKind) -> tuple[int, int, int, int]:
    """[kv head, chunk, query head of the group, head_dim + 2 (max, denominator)]."""
    c = kind.config
    return (c.kv_heads, CHUNKS, c.heads // c.kv_heads, c.head_dim + 2)


def split_attention_kernels(kind: BlockKind, rotary: bool = False,
                            dependent: bool = False) -> list[tuple[str, tvm.tirx.PrimFunc]]:
    """(partial kernel, merge kernel), each as (symbol, PrimFunc). With `rotary` the partial kernel takes
    the fused projection and the rotary tables instead of q, k and v (jitllm.ir.ops' RotaryPagedAttention),
    rotates q and the new k as it reads them, and also returns the rotated k and v (the block's outputs).
    `dependent`: both launched dependent."""
    return [_partial(kind, rotary, dependent), _merge(kind, dependent)]


def _rotated(qkv, cos, sin, base, d):
    """Element d of the head whose first column in `qkv` is `base`, after the interleaved-pair rotary
    embedding (pairs (2i, 2i + 1) turn by the angle of row i of the tables; ir.llama._rope)."""
    pair = d // 2
    partner = qkv[0, 0, base + d + 1 - 2 * (d % 2)]
    sign = T.Select(d % 2 == 0, T.float32(-1), T.float32(1))
    return qkv[0, 0, base + d] * cos[0, 0, pair] + sign * partner * sin[0, 0, pair]


def _partial(kind: BlockKind, rotary: bool, dependent: bool) -> tuple[str, tvm.tirx.PrimFunc]:
    c, P = kind.config, kind.page_size
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    G = H // HKV
    QD, KVD = H * D, HKV * D
    SCALE = 1.0 / (D ** 0.5)
    QLOAD = (G * D + NT - 1) // NT
    KLOAD = (TILE * D + NT - 1) // NT
    DS = D // SPLIT
    PAIRS = G * TILE  # (query head, position) scores per tile
    SCORES = (PAIRS * SPLIT + NT - 1) // NT
    SUMS = (PAIRS + NT - 1) // NT
    ACC = (G * D + NT - 1) // NT
    APPEND = (D + NT - 1) // NT
    symbol = f"jl_gpu_split_attention_partial_append{'_rotary' if rotary else ''}_h{H}_kv{HKV}_d{D}_p{P}_c{CHUNKS}"

    # Where the step's q, k, v come from: their own inputs, or (rotary: qkv is given) the projection,
    # rotated as read (Python helpers: they build each load's expression while the kernel is parsed).
    def query(qkv, cos, sin, q, h, d):
        return q[0, 0, h, d] if qkv is None else _rotated(qkv, cos, sin, h * D, d)

    def new_k(qkv, cos, sin, k, kv, d):
        return k[0, 0, kv, d] if qkv is None else _rotated(qkv, cos, sin, QD + kv * D, d)

    def new_v(qkv, v, kv, d):
        return v[0, 0, kv, d] if qkv is None else qkv[0, 0, QD + KVD + kv * D + d]

    @T.macro
    def body(qkv, q, k, v, cos, sin, k_out, v_out, pages_h, pt_h, past, ws):
        NP = T.int64()
        MP = T.int64()
        pages = T.match_buffer(pages_h, (NP, 2, HKV, P, D), "float32")
        pt = T.match_buffer(pt_h, (1, MP), "int32")
        for blk in T.thread_binding(HKV * CHUNKS, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                q_sh = T.alloc_buffer((G, D), "float32", scope="shared")
                # K rows padded to D + 1 floats, flat so buffer compaction keeps the padding: the score
                # loop's lanes read one row each, and the padding puts those rows in different banks.
                k_sh = T.alloc_buffer((TILE * (D + 1),), "float32", scope="shared")
                v_sh = T.alloc_buffer((TILE, D), "float32", scope="shared")
                sc4 = T.alloc_buffer((SPLIT * PAIRS,), "float32", scope="shared")  # partial dot products
                sc = T.alloc_buffer((G, TILE), "float32", scope="shared")  # scores
                pr = T.alloc_buffer((G, TILE), "float32", scope="shared")  # their exponentials
                resc = T.alloc_buffer((G,), "float32", scope="shared")  # each head's accumulator rescale
                acc = T.alloc_buffer((ACC,), "float32", scope="local")
                tmp = T.alloc_buffer((2,), "float32", scope="local")
                run = T.alloc_buffer((2,), "float32", scope="local")  # thread g < G: head g's max, denominator
                await_previous_kernel(dependent)
                kv: T.let = blk // CHUNKS
                chunk: T.let = blk % CHUNKS
                n: T.let = past[0]
                total: T.let = n + 1
                per: T.let = ((total + CHUNKS - 1) // CHUNKS + TILE - 1) // TILE * TILE
                start: T.let = chunk * per
                end: T.let = T.min(start + per, total)
                if chunk == 0:  # the KV append: position n, which no block of this launch reads from the pages
                    for i in T.unroll(APPEND):
                        e: T.let = i * NT + tx
                        if e < D:
                            slot: T.let = pt[0, n // P]
                            if rotary:  # the rotated k and v are the block's outputs too
                                kr: T.let = new_k(qkv, cos, sin, k, kv, e)
                                vr: T.let = new_v(qkv, v, kv, e)
                                pages[slot, 0, kv, n % P, e] = kr
                                pages[slot, 1, kv, n % P, e] = vr
                                k_out[0, 0, kv, e] = kr
                                v_out[0, 0, kv, e] = vr
                            else:
                                pages[slot, 0, kv, n % P, e] = new_k(qkv, cos, sin, k, kv, e)
                                pages[slot, 1, kv, n % P, e] = new_v(qkv, v, kv, e)
                # chunks past the history (most of them at short histories: 64 per KV head, 32 positions
                # at least each) do nothing more; the merge reads only the chunks below `used`
                if chunk < (total + per - 1) // per:
                    for i in T.unroll(QLOAD):
                        e: T.let = i * NT + tx
                        if e < G * D:
                            q_sh[e // D, e % D] = query(qkv, cos, sin, q, kv * G + e // D, e % D) * T.float32(SCALE)
                    run[0] = T.float32(NEG)
                    run[1] = T.float32(0)
                    for i in T.unroll(ACC):
                        acc[i] = T.float32(0)
                    T.tvm_storage_sync("shared")
                    for tile in T.serial(T.max(end - start + TILE - 1, 0) // TILE):
                        base: T.let = start + tile * TILE
                        for i in T.unroll(KLOAD):
                            # Loads from always-valid addresses (position clamped into the history), selected
                            # afterwards: no branch between them, so a thread's loads are all in flight at once.
                            e: T.let = i * NT + tx
                            r: T.let = e // D
                            col: T.let = e % D
                            t: T.let = base + r
                            tc: T.let = T.max(T.min(t, n - 1), 0)
                            page: T.let = pt[0, tc // P]
                            k_old: T.let = pages[page, 0, kv, tc % P, col]
                            v_old: T.let = pages[page, 1, kv, tc % P, col]
                            k_new: T.let = new_k(qkv, cos, sin, k, kv, col)
                            v_new: T.let = new_v(qkv, v, kv, col)
                            # rows past `end` are zeros, not stale shared memory (0 * NaN)
                            k_sh[r * (D + 1) + col] = T.Select(t < end, T.Select(t < n, k_old, k_new), T.float32(0))
                            v_sh[r, col] = T.Select(t < end, T.Select(t < n, v_old, v_new), T.float32(0))
                        T.tvm_storage_sync("shared")
                        for i in T.unroll(SCORES):
                            # item e: part e // PAIRS of the dot product of pair e % PAIRS; a warp's lanes take
                            # consecutive positions of one part, so their K rows fall in different banks
                            e: T.let = i * NT + tx
                            if e < PAIRS * SPLIT:
                                part: T.let = e // PAIRS
                                g: T.let = e % PAIRS // TILE
                                r: T.let = e % TILE
                                tmp[0] = T.float32(0)
                                for dd in T.unroll(DS):
                                    tmp[0] = tmp[0] + q_sh[g, part * DS + dd] * k_sh[r * (D + 1) + part * DS + dd]
                                sc4[e] = tmp[0]
                        T.tvm_storage_sync("shared")
                        for i in T.unroll(SUMS):
                            e: T.let = i * NT + tx
                            if e < PAIRS:
                                tmp[0] = T.float32(0)
                                for part in T.unroll(SPLIT):
                                    tmp[0] = tmp[0] + sc4[part * PAIRS + e]
                                sc[e // TILE, e % TILE] = T.if_then_else(base + e % TILE < end, tmp[0], T.float32(NEG))
                        T.tvm_storage_sync("shared")
                        if tx < G:
                            tmp[0] = run[0]
                            for r in T.unroll(TILE):
                                tmp[0] = T.max(tmp[0], sc[tx, r])
                            tmp[1] = T.float32(0)
                            for r in T.unroll(TILE):
                                pr[tx, r] = T.exp(sc[tx, r] - tmp[0])
                                tmp[1] = tmp[1] + T.exp(sc[tx, r] - tmp[0])
                            resc[tx] = T.exp(run[0] - tmp[0])
                            run[1] = run[1] * T.exp(run[0] - tmp[0]) + tmp[1]
                            run[0] = tmp[0]
                        T.tvm_storage_sync("shared")
                        for i in T.unroll(ACC):
                            e: T.let = i * NT + tx
                            if e < G * D:
                                acc[i] = acc[i] * resc[e // D]
                                for r in T.unroll(TILE):
                                    acc[i] = acc[i] + pr[e // D, r] * v_sh[r, e % D]
                        T.tvm_storage_sync("shared")
                    for i in T.unroll(ACC):
                        e: T.let = i * NT + tx
                        if e < G * D:
                            ws[kv, chunk, e // D, e % D] = acc[i]
                    if tx < G:
                        ws[kv, chunk, tx, D] = run[0]
                        ws[kv, chunk, tx, D + 1] = run[1]

    if rotary:
        @T.prim_func
        def f(qkv: T.Buffer((1, 1, QD + 2 * KVD), "float32"), cos: T.Buffer((1, 1, D // 2), "float32"),
              sin: T.Buffer((1, 1, D // 2), "float32"), pages_h: T.handle, pt_h: T.handle,
              past: T.Buffer((1,), "int32"), ws: T.Buffer((HKV, CHUNKS, G, D + 2), "float32"),
              k_out: T.Buffer((1, 1, HKV, D), "float32"), v_out: T.Buffer((1, 1, HKV, D), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            body(qkv, None, None, None, cos, sin, k_out, v_out, pages_h, pt_h, past, ws)
    else:
        @T.prim_func
        def f(q: T.Buffer((1, 1, H, D), "float32"), k: T.Buffer((1, 1, HKV, D), "float32"),
              v: T.Buffer((1, 1, HKV, D), "float32"), pages_h: T.handle, pt_h: T.handle,
              past: T.Buffer((1,), "int32"), ws: T.Buffer((HKV, CHUNKS, G, D + 2), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            body(None, q, k, v, None, None, None, None, pages_h, pt_h, past, ws)

    return symbol, dependent_launch(f, dependent).with_attr("global_symbol", symbol)


def _merge(kind: BlockKind, dependent: bool) -> tuple[str, tvm.tirx.PrimFunc]:
    """One thread block per query head, one thread per dimension. Every read is issued before the first
    wait (a serial loop over the chunks waited one L2 round trip per chunk: 6.2 µs at 512 positions):
    each thread loads its dimension of every chunk's accumulator into registers, chunks past `used` from
    the last used one's (always-valid) address, weighted 0 afterwards."""
    c = kind.config
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    G = H // HKV
    LOADS = (CHUNKS + D - 1) // D
    symbol = f"jl_gpu_split_attention_merge_h{H}_kv{HKV}_d{D}_c{CHUNKS}"

    @T.prim_func
    def f(ws: T.Buffer((HKV, CHUNKS, G, D + 2), "float32"), past: T.Buffer((1,), "int32"),
          out: T.Buffer((1, 1, H, D), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for tx in T.thread_binding(D, thread="threadIdx.x"):
                mx = T.alloc_buffer((CHUNKS,), "float32", scope="shared")  # each chunk's max (NEG past `used`)
                den = T.alloc_buffer((CHUNKS,), "float32", scope="shared")  # its denominator (0 past `used`)
                num = T.alloc_buffer((CHUNKS,), "float32", scope="local")  # its accumulator at dimension tx
                st = T.alloc_buffer((3,), "float32", scope="local")  # max, numerator, denominator
                await_previous_kernel(dependent)
                kv: T.let = h // G
                g: T.let = h % G
                total: T.let = past[0] + 1
                per: T.let = ((total + CHUNKS - 1) // CHUNKS + TILE - 1) // TILE * TILE
                used: T.let = (total + per - 1) // per  # the chunks the partial kernel filled (the rest is stale)
                for ch in T.unroll(CHUNKS):
                    num[ch] = ws[kv, T.min(ch, used - 1), g, tx]
                for i in T.unroll(LOADS):
                    ch: T.let = i * D + tx
                    if ch < CHUNKS:
                        mx[ch] = T.Select(ch < used, ws[kv, T.min(ch, used - 1), g, D], T.float32(NEG))
                        den[ch] = T.Select(ch < used, ws[kv, T.min(ch, used - 1), g, D + 1], T.float32(0))
                T.tvm_storage_sync("shared")
                st[0] = T.float32(NEG)
                for ch in T.unroll(CHUNKS):
                    st[0] = T.max(st[0], mx[ch])
                st[1] = T.float32(0)
                st[2] = T.float32(0)
                for ch in T.unroll(CHUNKS):
                    st[1] = st[1] + T.exp(mx[ch] - st[0]) * num[ch]
                    st[2] = st[2] + T.exp(mx[ch] - st[0]) * den[ch]
                out[0, 0, h, tx] = st[1] / st[2]

    return symbol, dependent_launch(f, dependent).with_attr("global_symbol", symbol)
