"""Split (flash-decoding) decode attention for WGSL, with the step's KV append (and, `rotary`, the rotary
embedding) in the same kernel: two dispatches where RotaryQKV, PagedAttention and the append took three.

The history (`past` + 1 positions, the last one the new token's) is cut into at most CHUNKS chunks of a
multiple of TILE positions each, as many as it needs (read from `past` on the device: the grid is fixed,
so a captured step replays at any history length, and the workgroups of chunks past the history stop at
once). The first dispatch has a workgroup per (query head, chunk): an online softmax over its chunk, tile by
tile (the tile's keys through workgroup memory, read coalesced; each thread scores a part of a position,
then folds the tile into its own (max, sum, column sum) over every LANES-th position), its partial state
written to the workspace. The second, a workgroup per query head, merges the chunks' states (where one
chunk holds the whole history, the first dispatch wrote the output itself and the merge does nothing).
WGSL has no device-scope fence, so the merge is a dispatch of its own (WebGPU orders a pass's dispatches),
not CUDA's last-arriving block (kernels/cuda/split_attention.py).

The chunk-0 workgroup of the first query head of each KV group writes the new K/V row into the pages at
`past`; no workgroup reads that row from the pages: the chunk holding position `past` scores it from its
own copy of the new key and value, so there is no ordering between workgroups to wait for.
(TVM's WGSL has no warp shuffles or atomics on floats, so nothing here needs them.)
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind

NT = 128
"""Threads of a workgroup of the first dispatch."""
CHUNKS = 32
"""Chunks of the history at most (a workgroup each per query head)."""
SPLIT = 4
"""Threads per position's score in a tile (each sums head_dim / SPLIT products)."""
NEG = -3.0e38


def tile(head_dim: int) -> int:
    """Positions per tile: NT / SPLIT, or half that where a tile's keys would not fit in 16 KiB of
    workgroup memory (the least a WebGPU adapter has)."""
    return NT // SPLIT if NT // SPLIT * (head_dim + 1) * 4 <= 12 << 10 else NT // SPLIT // 2


def workspace_shape(kind: BlockKind) -> tuple[int, int, int]:
    """[query head, chunk, head_dim + 2]: each chunk's column sums, then its max and its sum."""
    c = kind.config
    return (c.heads, CHUNKS, c.head_dim + 2)


def arrival_counters(kind: BlockKind) -> np.ndarray:
    """The split-attention interface's counters: the merge is a dispatch of its own, so none are used."""
    return np.zeros(1, np.uint32)


def decode_attention_kernel(kind: BlockKind, rotary: bool) -> tuple[str, tvm.tirx.PrimFunc]:
    """Parameters (onnx_import._split_attention's): q, k, v [1, 1, heads, D] (or, `rotary`, the fused
    projection [1, 1, (H + 2 HKV) D] and cos, sin [1, 1, D / 2]), pages, page table, past, counters; then
    the outputs: the workspace, the attention [1, 1, H, D] and (`rotary`) the rotated k and the v."""
    c, P = kind.config, kind.page_size
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    TILE = tile(D)
    if D > NT or NT % D or D % (NT // TILE) or TILE % (NT // D):
        raise ValueError(f"head_dim {D} must divide {NT} and be a multiple of {NT // TILE}")
    G, HALF, W = H // HKV, D // 2, (H + 2 * HKV) * D
    PARTS = NT // TILE  # threads per score
    DS = D // PARTS  # products each sums
    LANES = NT // D  # threads per output column (each folds every LANES-th position of a tile)
    KLOAD = TILE * D // NT  # a tile's key elements each thread loads
    VLOAD = TILE // LANES  # and value elements
    SCALE = 1.0 / (D ** 0.5)
    symbol = f"jl_wgsl_split_attention_append{'_rotary' if rotary else ''}_h{H}_kv{HKV}_d{D}_p{P}_c{CHUNKS}"

    def rotated(qkv, cos, sin, base, d):
        """Element d of the head at column `base` of the projection after the interleaved-pair rotary
        embedding (pairs (2i, 2i + 1) turn by row i's angle, as kernels/cuda/basic.rotary_kernel)."""
        x0, x1 = qkv[0, 0, base + d // 2 * 2], qkv[0, 0, base + d // 2 * 2 + 1]
        cs, sn = cos[0, 0, d // 2], sin[0, 0, d // 2]
        return T.Select(d % 2 == 0, x0 * cs - x1 * sn, x0 * sn + x1 * cs)

    @T.macro
    def chunks(qkv, cos, sin, q, k, v, pages, pt, past, ws, out, k_out, v_out):
        for blk in T.thread_binding(H * CHUNKS, thread="blockIdx.x"):
            for t in T.thread_binding(NT, thread="threadIdx.x"):
                q_sh = T.alloc_buffer((D,), "float32", scope="shared")
                k_new = T.alloc_buffer((D,), "float32", scope="shared")
                v_new = T.alloc_buffer((D,), "float32", scope="shared")
                # keys padded to D + 1 floats a row, flat so buffer compaction keeps the padding: a score's
                # threads read different rows, which the padding puts in different banks
                k_sh = T.alloc_buffer((TILE * (D + 1),), "float32", scope="shared")
                part = T.alloc_buffer((NT,), "float32", scope="shared")  # partial dot products
                sc = T.alloc_buffer((TILE,), "float32", scope="shared")  # the tile's scores
                sums = T.alloc_buffer((NT,), "float32", scope="shared")  # each thread's sum, at the end
                cols = T.alloc_buffer((NT,), "float32", scope="shared")  # and column sum
                vl = T.alloc_buffer((VLOAD,), "float32", scope="local")
                run = T.alloc_buffer((4,), "float32", scope="local")  # max, sum, column sum, new max
                tmp = T.alloc_buffer((1,), "float32", scope="local")
                h: T.let = blk // CHUNKS
                chunk: T.let = blk % CHUNKS
                kv: T.let = h // G
                n: T.let = past[0]
                per: T.let = ((n + CHUNKS) // CHUNKS + TILE - 1) // TILE * TILE  # positions a chunk
                used: T.let = (n + per) // per  # chunks holding positions 0..n
                start: T.let = chunk * per
                end: T.let = T.min(start + per, n + 1)
                col: T.let = t % D
                lane: T.let = t // D
                if t < D and chunk < used:  # (chunk 0 holds position 0: the append's workgroups are in)
                    if rotary:
                        q_sh[t] = rotated(qkv, cos, sin, h * D, t) * T.float32(SCALE)
                        k_new[t] = rotated(qkv, cos, sin, H * D + kv * D, t)
                        v_new[t] = qkv[0, 0, (H + HKV) * D + kv * D + t]
                    else:
                        q_sh[t] = q[0, 0, h, t] * T.float32(SCALE)
                        k_new[t] = k[0, 0, kv, t]
                        v_new[t] = v[0, 0, kv, t]
                T.tvm_storage_sync("shared")
                if t < D:
                    if chunk == 0 and h % G == 0:
                        page: T.let = pt[0, n // P]
                        pages[page, 0, kv, n % P, t] = k_new[t]
                        pages[page, 1, kv, n % P, t] = v_new[t]
                        if rotary:
                            k_out[0, 0, kv, t] = k_new[t]
                            v_out[0, 0, kv, t] = v_new[t]
                run[0] = T.float32(NEG)
                run[1] = T.float32(0)
                run[2] = T.float32(0)
                # (chunks past the history run no tile: the loop's count, not a branch around the barriers)
                for tl in T.serial(T.max(end - start + TILE - 1, 0) // TILE):
                    base: T.let = start + tl * TILE
                    for i in T.unroll(KLOAD):  # keys: old rows from always-valid addresses, selected
                        e: T.let = i * NT + t
                        r: T.let = base + e // D
                        old: T.let = T.max(T.min(r, n - 1), 0)
                        k_sh[e // D * (D + 1) + e % D] = T.Select(
                            r < n, pages[pt[0, old // P], 0, kv, old % P, e % D],
                            T.Select(r == n, k_new[e % D], T.float32(0)))
                    for i in T.unroll(VLOAD):  # values: this thread's column at its positions
                        r: T.let = base + i * LANES + lane
                        old: T.let = T.max(T.min(r, n - 1), 0)
                        vl[i] = T.Select(r < n, pages[pt[0, old // P], 1, kv, old % P, col],
                                         T.Select(r == n, v_new[col], T.float32(0)))
                    T.tvm_storage_sync("shared")
                    tmp[0] = T.float32(0)  # thread t: part t // TILE of position t % TILE's score
                    for dd in T.unroll(DS):
                        tmp[0] = tmp[0] + q_sh[t // TILE * DS + dd] * k_sh[t % TILE * (D + 1) + t // TILE * DS + dd]
                    part[t] = tmp[0]
                    T.tvm_storage_sync("shared")
                    if t < TILE:
                        tmp[0] = T.float32(0)
                        for p in T.unroll(PARTS):
                            tmp[0] = tmp[0] + part[p * TILE + t]
                        sc[t] = T.Select(base + t < end, tmp[0], T.float32(NEG))
                    T.tvm_storage_sync("shared")
                    run[3] = run[0]
                    for j in T.unroll(TILE):
                        run[3] = T.max(run[3], sc[j])
                    tmp[0] = T.exp(run[0] - run[3])  # the rescale of what came before
                    run[1] = run[1] * tmp[0]
                    run[2] = run[2] * tmp[0]
                    for i in T.unroll(VLOAD):
                        tmp[0] = T.exp(sc[i * LANES + lane] - run[3])
                        run[1] = run[1] + tmp[0]
                        run[2] = run[2] + tmp[0] * vl[i]
                    run[0] = run[3]
                    T.tvm_storage_sync("shared")
                sums[t] = run[1]
                cols[t] = run[2]
                T.tvm_storage_sync("shared")
                if t < D:
                    if chunk < used:
                        run[1] = T.float32(0)
                        run[2] = T.float32(0)
                        for s in T.unroll(LANES):  # (every thread of a lane has the lane's sum)
                            run[1] = run[1] + sums[s * D]
                            run[2] = run[2] + cols[s * D + t]
                        if used == 1:
                            out[0, 0, h, t] = run[2] / run[1]
                        else:
                            ws[h, chunk, t] = run[2]
                            if t == 0:
                                ws[h, chunk, D] = run[0]
                                ws[h, chunk, D + 1] = run[1]

    @T.macro
    def merge(past, ws, out):
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for t in T.thread_binding(D, thread="threadIdx.x"):
                run = T.alloc_buffer((3,), "float32", scope="local")  # the largest max, sum, column sum
                n: T.let = past[0]
                per: T.let = ((n + CHUNKS) // CHUNKS + TILE - 1) // TILE * TILE
                used: T.let = (n + per) // per
                if used > 1:
                    run[0] = T.float32(NEG)
                    for ch in T.serial(used):
                        run[0] = T.max(run[0], ws[h, ch, D])
                    run[1] = T.float32(0)
                    run[2] = T.float32(0)
                    for ch in T.serial(used):
                        run[1] = run[1] + T.exp(ws[h, ch, D] - run[0]) * ws[h, ch, D + 1]
                        run[2] = run[2] + T.exp(ws[h, ch, D] - run[0]) * ws[h, ch, t]
                    out[0, 0, h, t] = run[2] / run[1]

    if rotary:
        @T.prim_func
        def f(qkv: T.Buffer((1, 1, W), "float32"), cos: T.Buffer((1, 1, HALF), "float32"),
              sin: T.Buffer((1, 1, HALF), "float32"), pages_h: T.handle, pt_h: T.handle,
              past: T.Buffer((1,), "int32"), counters: T.Buffer((1,), "uint32"),
              ws: T.Buffer((H, CHUNKS, D + 2), "float32"), out: T.Buffer((1, 1, H, D), "float32"),
              k_out: T.Buffer((1, 1, HKV, D), "float32"), v_out: T.Buffer((1, 1, HKV, D), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            NP = T.int32()
            MP = T.int32()
            pages = T.match_buffer(pages_h, (NP, 2, HKV, P, D), "float32")
            pt = T.match_buffer(pt_h, (1, MP), "int32")
            chunks(qkv, cos, sin, None, None, None, pages, pt, past, ws, out, k_out, v_out)
            merge(past, ws, out)
    else:
        @T.prim_func
        def f(q: T.Buffer((1, 1, H, D), "float32"), k: T.Buffer((1, 1, HKV, D), "float32"),
              v: T.Buffer((1, 1, HKV, D), "float32"), pages_h: T.handle, pt_h: T.handle,
              past: T.Buffer((1,), "int32"), counters: T.Buffer((1,), "uint32"),
              ws: T.Buffer((H, CHUNKS, D + 2), "float32"), out: T.Buffer((1, 1, H, D), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            NP = T.int32()
            MP = T.int32()
            pages = T.match_buffer(pages_h, (NP, 2, HKV, P, D), "float32")
            pt = T.match_buffer(pt_h, (1, MP), "int32")
            chunks(None, None, None, q, k, v, pages, pt, past, ws, out, None, None)
            merge(past, ws, out)

    return symbol, f.with_attr("global_symbol", symbol)
