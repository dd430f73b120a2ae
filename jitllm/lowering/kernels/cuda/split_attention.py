"""Split-history paged decode attention for GPUs (batch 1, one new token), one kernel.

One query token has too little work for one thread block per head (DESIGN.md §3: 8 blocks at batch 1,
77 of 164 µs per block). Here the history is cut into `CHUNKS` equal chunks per KV head; one thread
block per (KV head, chunk) runs an online softmax over its chunk for all the query heads of its group,
tile by tile through shared memory, and writes its partial state (accumulator, max, denominator) to a
workspace. The last block of a KV head to finish merges its chunks into the attention's output: each
block counts itself in on an arrival counter of its KV head once its state is written (a fence, then
an atomic increment that wraps to 0 on the last arrival, so the counters are back at 0 for the next
launch), and the block that arrives last reads every chunk's state from L2. The counters are a
constant of the decode module (zeros, kept on the device with its other constants); a separate merge
kernel cost a launch and a boundary per block (1.9 µs + ~1.7 µs on the H200, docs/performance-gpu.md).

Chunks start at 32 positions each, so at short histories most chunks are past the history: their
blocks stop after the append, and neither count nor are merged. The grid never depends on the history
length (it is read from `past` on the device), so the launch can live in a CUDA graph.

The kernel also appends the step's K and V to the pages (the chunk-0 block of each KV head writes
position `past`, which no block reads from the pages: the scores take the new token's K and V from the
inputs), so a decode step needs no separate append launch (`APPENDS_KV`). In fused decode variants
(RotaryPagedAttention) it reads q, k and v from the Q/K/V projection itself and applies the rotary
embedding as it reads them, so the step has no rotary launch either. Launched dependent
(kernels_gpu.await_previous_kernel), each block loads its first tile of old keys and values before it
waits (the history, like `past` and the page table, is no output of the step's kernels), and lets the
next kernel launch at once (kernels_gpu.release_next_kernel): at short histories most of its blocks
stop at once and the few left are latency-bound, so the O projection's blocks take the idle SMs and
load their first weights meanwhile (docs/performance-gpu.md, stop 19: 3B f16 and SmolLM2 faster,
3B Q4_0 within its noise).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind
from jitllm.lowering.kernels.cuda.basic import await_previous_kernel, dependent_launch, release_next_kernel
from jitllm.lowering.kernels.kv_store import Q8, block_amax, load, store_q8_element, stored

CHUNKS = 64  # chunks per KV head
TILE = 32  # positions per shared-memory tile
NT = 128  # threads per block
BATCH = 16  # chunks the merge reads at a time (CHUNKS a multiple of it)
SPLIT = 4  # threads per score (each sums D / SPLIT products: short dependency chains)
NEG = -3.0e38
APPENDS_KV = True
"""The kernel writes the step's K and V into the pages (the runtime skips the append kernel)."""


def workspace_shape(kind: BlockKind) -> tuple[int, int, int, int]:
    """[kv head, chunk, query head of the group, head_dim + 2 (max, denominator)]."""
    c = kind.config
    return (c.kv_heads, CHUNKS, c.heads // c.kv_heads, c.head_dim + 2)


def arrival_counters(kind: BlockKind) -> np.ndarray:
    """The counters' initial (and, between launches, lasting) value: one zero per KV head."""
    return np.zeros(kind.config.kv_heads, np.uint32)


def _ldcg(buf, *index):
    """buf[index] read from L2 (bypassing L1): another block of the launch wrote it."""
    return T.call_extern("float32", "__ldcg", T.address_of(buf[index]))


def _fence():
    """This thread's writes visible to the whole device before its later ones (__threadfence)."""
    return T.evaluate(T.call_extern("void", "__threadfence"))


def _rotated(qkv, cos, sin, base, d):
    """Element d of the head whose first column in `qkv` is `base`, after the interleaved-pair rotary
    embedding (pairs (2i, 2i + 1) turn by the angle of row i of the tables; ir.llama._rope)."""
    pair = d // 2
    partner = qkv[0, 0, base + d + 1 - 2 * (d % 2)]
    sign = T.Select(d % 2 == 0, T.float32(-1), T.float32(1))
    return qkv[0, 0, base + d] * cos[0, 0, pair] + sign * partner * sin[0, 0, pair]


def split_attention_kernel(kind: BlockKind, rotary: bool = False,
                           dependent: bool = False) -> tuple[str, tvm.tirx.PrimFunc]:
    """(symbol, PrimFunc). Inputs q, k, v (or, with `rotary`, the fused projection and the rotary tables:
    jitllm.ir.ops' RotaryPagedAttention, q and the new k rotated as read), pages, page table, past and the
    arrival counters; outputs the workspace, the attention [1, 1, heads, head_dim] and, with `rotary`, the
    rotated k and v (the block's outputs too). `dependent`: launched dependent."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
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
    STATES = (G * CHUNKS + NT - 1) // NT  # (head, chunk) maxima and denominators the merge reads
    symbol = f"jl_gpu_split_attention_append{'_rotary' if rotary else ''}_h{H}_kv{HKV}_d{D}_p{P}_c{CHUNKS}"

    # Where the step's q, k, v come from: their own inputs, or (rotary: qkv is given) the projection,
    # rotated as read (Python helpers: they build each load's expression while the kernel is parsed).
    def query(qkv, cos, sin, q, h, d):
        return q[0, 0, h, d] if qkv is None else _rotated(qkv, cos, sin, h * D, d)

    def new_k(qkv, cos, sin, k, kv, d):
        return k[0, 0, kv, d] if qkv is None else _rotated(qkv, cos, sin, QD + kv * D, d)

    def new_v(qkv, v, kv, d):
        return v[0, 0, kv, d] if qkv is None else qkv[0, 0, QD + KVD + kv * D + d]

    @T.macro
    def old_kv(kl, vl, pages, pt, kv, n, base, tx):
        """Positions base.. of the history into registers, from always-valid addresses (the position
        clamped into the history; what is past it is selected away later): no branch between the loads,
        so a thread's loads are all in flight at once."""
        for i in T.unroll(KLOAD):
            e: T.let = i * NT + tx
            tc: T.let = T.max(T.min(base + e // D, n - 1), 0)
            page: T.let = pt[0, tc // P]
            kl[i] = load(pages, [page, 0, kv, tc % P, e % D])
            vl[i] = load(pages, [page, 1, kv, tc % P, e % D])

    @T.macro
    def tile_step(qkv, k, v, cos, sin, kl, vl, q_sh, k_sh, v_sh, sc4, sc, pr, resc, acc, tmp, run, kv, n, end,
                  base, tx):
        """One tile of positions (its history keys and values in kl, vl) folded into the online softmax."""
        for i in T.unroll(KLOAD):
            e: T.let = i * NT + tx
            r: T.let = e // D
            col: T.let = e % D
            t: T.let = base + r
            k_new: T.let = new_k(qkv, cos, sin, k, kv, col)
            v_new: T.let = new_v(qkv, v, kv, col)
            # rows past `end` are zeros, not stale shared memory (0 * NaN)
            k_sh[r * (D + 1) + col] = T.Select(t < end, T.Select(t < n, kl[i], k_new), T.float32(0))
            v_sh[r, col] = T.Select(t < end, T.Select(t < n, vl[i], v_new), T.float32(0))
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

    @T.macro
    def merge(ws, out, mx, dn, wt, tot, num, acc, tmp, kv, used, tx):
        """The last block of KV head kv: out = every used chunk's accumulator weighted by exp(its max - the
        largest max), over the same weighting of their denominators. The accumulators are read BATCH chunks
        at a time, every element of a thread at once (one L2 round trip per batch); loads past `used` come
        from the last used chunk's address and are weighted 0."""
        for i in T.unroll(STATES):
            e: T.let = i * NT + tx
            if e < G * CHUNKS:
                g: T.let = e // CHUNKS
                ch: T.let = e % CHUNKS
                mx[g, ch] = T.Select(ch < used, _ldcg(ws, kv, T.min(ch, used - 1), g, D), T.float32(NEG))
                dn[g, ch] = T.Select(ch < used, _ldcg(ws, kv, T.min(ch, used - 1), g, D + 1), T.float32(0))
        T.tvm_storage_sync("shared")
        if tx < G:
            tmp[0] = T.float32(NEG)
            for ch in T.unroll(CHUNKS):
                tmp[0] = T.max(tmp[0], mx[tx, ch])
            tmp[1] = T.float32(0)
            for ch in T.unroll(CHUNKS):  # (exp computed twice: a shared write read back here would need a sync)
                wt[tx, ch] = T.exp(mx[tx, ch] - tmp[0])
                tmp[1] = tmp[1] + T.exp(mx[tx, ch] - tmp[0]) * dn[tx, ch]
            tot[tx] = tmp[1]
        T.tvm_storage_sync("shared")
        for i in T.unroll(ACC):
            acc[i] = T.float32(0)
        for b in T.serial((used + BATCH - 1) // BATCH):
            for i in T.unroll(ACC):
                e: T.let = i * NT + tx
                if e < G * D:
                    for j in T.unroll(BATCH):
                        num[i * BATCH + j] = _ldcg(ws, kv, T.min(b * BATCH + j, used - 1), e // D, e % D)
            for i in T.unroll(ACC):
                e: T.let = i * NT + tx
                if e < G * D:
                    for j in T.unroll(BATCH):
                        acc[i] = acc[i] + wt[e // D, b * BATCH + j] * num[i * BATCH + j]
        for i in T.unroll(ACC):
            e: T.let = i * NT + tx
            if e < G * D:
                out[0, 0, kv * G + e // D, e % D] = acc[i] / tot[e // D]

    @T.macro
    def body(qkv, q, k, v, cos, sin, k_out, v_out, pages_h, pt_h, past, counters, ws, out):
        NP = T.int64()
        MP = T.int64()
        pages = T.match_buffer(pages_h, (NP, 2, HKV, P, W), KV)
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
                mx = T.alloc_buffer((G, CHUNKS), "float32", scope="shared")  # merge: chunk maxima
                wt = T.alloc_buffer((G, CHUNKS), "float32", scope="shared")  # merge: chunk weights
                dn = T.alloc_buffer((G, CHUNKS), "float32", scope="shared")  # merge: chunk denominators
                tot = T.alloc_buffer((G,), "float32", scope="shared")  # merge: each head's weighted sum of them
                arrival = T.alloc_buffer((1,), "int32", scope="shared")  # how many blocks of the head were in
                acc = T.alloc_buffer((ACC,), "float32", scope="local")
                kl = T.alloc_buffer((KLOAD,), "float32", scope="local")  # a tile's history keys
                vl = T.alloc_buffer((KLOAD,), "float32", scope="local")  # and values
                num = T.alloc_buffer((ACC * BATCH,), "float32", scope="local")  # merge: a batch of chunk accumulators
                tmp = T.alloc_buffer((2,), "float32", scope="local")
                run = T.alloc_buffer((2,), "float32", scope="local")  # thread g < G: head g's max, denominator
                last = T.alloc_buffer((1,), "int32", scope="local")
                kv: T.let = blk // CHUNKS
                chunk: T.let = blk % CHUNKS
                n: T.let = past[0]
                total: T.let = n + 1
                per: T.let = ((total + CHUNKS - 1) // CHUNKS + TILE - 1) // TILE * TILE
                start: T.let = chunk * per
                end: T.let = T.min(start + per, total)
                used: T.let = (total + per - 1) // per  # chunks holding positions
                release_next_kernel(dependent)  # (the O projection's blocks load weights while this runs)
                if chunk < used:  # the history is no output of the step's kernels: its first tile before the wait
                    old_kv(kl, vl, pages, pt, kv, n, start, tx)
                await_previous_kernel(dependent)
                if chunk == 0:  # the KV append: position n, which no block of this launch reads from the pages
                    for i in T.unroll(APPEND):
                        e: T.let = i * NT + tx
                        if e < D:
                            slot: T.let = pt[0, n // P]
                            if rotary:  # the rotated k and v are the block's outputs too
                                kr: T.let = new_k(qkv, cos, sin, k, kv, e)
                                vr: T.let = new_v(qkv, v, kv, e)
                                if KV == Q8:  # (each thread its block's scale from the block's 32 values)
                                    store_q8_element(pages, slot, 0, kv, n % P, e, kr,
                                                     block_amax(new_k, (qkv, cos, sin, k, kv), e), D)
                                    store_q8_element(pages, slot, 1, kv, n % P, e, vr,
                                                     block_amax(new_v, (qkv, v, kv), e), D)
                                else:
                                    pages[slot, 0, kv, n % P, e] = stored(kr, KV)
                                    pages[slot, 1, kv, n % P, e] = stored(vr, KV)
                                k_out[0, 0, kv, e] = kr
                                v_out[0, 0, kv, e] = vr
                            else:
                                if KV == Q8:
                                    store_q8_element(pages, slot, 0, kv, n % P, e, new_k(qkv, cos, sin, k, kv, e),
                                                     block_amax(new_k, (qkv, cos, sin, k, kv), e), D)
                                    store_q8_element(pages, slot, 1, kv, n % P, e, new_v(qkv, v, kv, e),
                                                     block_amax(new_v, (qkv, v, kv), e), D)
                                else:
                                    pages[slot, 0, kv, n % P, e] = stored(new_k(qkv, cos, sin, k, kv, e), KV)
                                    pages[slot, 1, kv, n % P, e] = stored(new_v(qkv, v, kv, e), KV)
                # chunks past the history (most of them at short histories: 64 per KV head, 32 positions
                # at least each) do nothing more: neither counted nor merged
                if chunk < used:
                    for i in T.unroll(QLOAD):
                        e: T.let = i * NT + tx
                        if e < G * D:
                            q_sh[e // D, e % D] = query(qkv, cos, sin, q, kv * G + e // D, e % D) * T.float32(SCALE)
                    run[0] = T.float32(NEG)
                    run[1] = T.float32(0)
                    for i in T.unroll(ACC):
                        acc[i] = T.float32(0)
                    T.tvm_storage_sync("shared")
                    tile_step(qkv, k, v, cos, sin, kl, vl, q_sh, k_sh, v_sh, sc4, sc, pr, resc, acc, tmp, run, kv, n,
                              end, start, tx)
                    for tile in T.serial((end - start + TILE - 1) // TILE - 1):
                        old_kv(kl, vl, pages, pt, kv, n, start + (tile + 1) * TILE, tx)
                        tile_step(qkv, k, v, cos, sin, kl, vl, q_sh, k_sh, v_sh, sc4, sc, pr, resc, acc, tmp, run,
                                  kv, n, end, start + (tile + 1) * TILE, tx)
                    for i in T.unroll(ACC):
                        e: T.let = i * NT + tx
                        if e < G * D:
                            ws[kv, chunk, e // D, e % D] = acc[i]
                    if tx < G:
                        ws[kv, chunk, tx, D] = run[0]
                        ws[kv, chunk, tx, D + 1] = run[1]
                    _fence()
                    T.tvm_storage_sync("shared")
                    if tx == 0:  # wraps to 0 on the last arrival: the counter is ready for the next launch
                        arrival[0] = T.Cast("int32", T.call_extern(
                            "uint32", "atomicInc", T.address_of(counters[kv]), T.Cast("uint32", used - 1)))
                    T.tvm_storage_sync("shared")
                    last[0] = arrival[0]  # (a shared load in a condition trips TVM's sync planner)
                    if last[0] == used - 1:
                        _fence()
                        merge(ws, out, mx, dn, wt, tot, num, acc, tmp, kv, used, tx)

    if rotary:
        @T.prim_func
        def f(qkv: T.Buffer((1, 1, QD + 2 * KVD), "float32"), cos: T.Buffer((1, 1, D // 2), "float32"),
              sin: T.Buffer((1, 1, D // 2), "float32"), pages_h: T.handle, pt_h: T.handle,
              past: T.Buffer((1,), "int32"), counters: T.Buffer((HKV,), "uint32"),
              ws: T.Buffer((HKV, CHUNKS, G, D + 2), "float32"), out: T.Buffer((1, 1, H, D), "float32"),
              k_out: T.Buffer((1, 1, HKV, D), "float32"), v_out: T.Buffer((1, 1, HKV, D), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            body(qkv, None, None, None, cos, sin, k_out, v_out, pages_h, pt_h, past, counters, ws, out)
    else:
        @T.prim_func
        def f(q: T.Buffer((1, 1, H, D), "float32"), k: T.Buffer((1, 1, HKV, D), "float32"),
              v: T.Buffer((1, 1, HKV, D), "float32"), pages_h: T.handle, pt_h: T.handle,
              past: T.Buffer((1,), "int32"), counters: T.Buffer((HKV,), "uint32"),
              ws: T.Buffer((HKV, CHUNKS, G, D + 2), "float32"), out: T.Buffer((1, 1, H, D), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            body(None, q, k, v, None, None, None, None, pages_h, pt_h, past, counters, ws, out)

    return symbol, dependent_launch(f, dependent).with_attr("global_symbol", symbol)
