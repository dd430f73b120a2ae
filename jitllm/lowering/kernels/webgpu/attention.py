"""Decode attention for WGSL with the step's KV append (and, `rotary`, the rotary embedding) in the same
kernel: one dispatch where RotaryQKV, PagedAttention and the append took three.

One workgroup per query head. Its threads first take the head's query (rotated, scaled) and its KV
head's new key (rotated) and value into workgroup memory; the first query head of each KV group writes
that key and value into the pages at `past` (no other workgroup reads that row: every workgroup scores
the new position from its own copy, so there is no ordering between workgroups to wait for). Then per
chunk of NT positions each thread scores one (history from the pages, the last one the new key), every
thread folds the chunk's maximum and sum into the running softmax (each reads the chunk's scores: no
tree, identical values in every thread), and thread t accumulates column t % D over every
(NT // D)-th position of the chunk; the partial sums meet in workgroup memory at the end.
(TVM's WGSL has no warp shuffles or atomics on floats, so nothing here needs them.)
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind

NT = 128
"""Threads of a workgroup: positions scored per chunk, and NT // D partial sums per output column."""


def workspace_shape(kind: BlockKind) -> tuple[int]:
    """The split-attention interface's workspace (onnx_import._split_attention): this kernel needs none."""
    return (1,)


def arrival_counters(kind: BlockKind) -> np.ndarray:
    """The split-attention interface's counters: this kernel needs none."""
    return np.zeros(1, np.uint32)


def decode_attention_kernel(kind: BlockKind, rotary: bool) -> tuple[str, tvm.tirx.PrimFunc]:
    """Parameters (onnx_import._split_attention's): q, k, v [1, 1, heads, D] (or, `rotary`, the fused
    projection [1, 1, (H + 2 HKV) D] and cos, sin [1, 1, D / 2]), pages, page table, past, counters; then
    the outputs: the workspace, the attention [1, 1, H, D] and (`rotary`) the rotated k and the v."""
    c, P = kind.config, kind.page_size
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    if D > NT or NT % D:
        raise ValueError(f"head_dim {D} must divide {NT}")
    G, HALF, W = H // HKV, D // 2, (H + 2 * HKV) * D
    LANES = NT // D  # partial sums per output column
    SCALE = 1.0 / (D ** 0.5)
    symbol = f"jl_wgsl_decode_attention_append{'_rotary' if rotary else ''}_h{H}_kv{HKV}_d{D}_p{P}"

    def rotated(qkv, cos, sin, base, d):
        """Element d of the head at column `base` of the projection after the interleaved-pair rotary
        embedding (pairs (2i, 2i + 1) turn by row i's angle, as kernels/cuda/basic.rotary_kernel)."""
        x0, x1 = qkv[0, 0, base + d // 2 * 2], qkv[0, 0, base + d // 2 * 2 + 1]
        cs, sn = cos[0, 0, d // 2], sin[0, 0, d // 2]
        return T.Select(d % 2 == 0, x0 * cs - x1 * sn, x0 * sn + x1 * cs)

    @T.macro
    def body(qkv, cos, sin, q, k, v, pages, pt, past, out, k_out, v_out):
        for h in T.thread_binding(H, thread="blockIdx.x"):
            for t in T.thread_binding(NT, thread="threadIdx.x"):
                q_sh = T.alloc_buffer((D,), "float32", scope="shared")
                k_new = T.alloc_buffer((D,), "float32", scope="shared")
                v_new = T.alloc_buffer((D,), "float32", scope="shared")
                scores = T.alloc_buffer((NT,), "float32", scope="shared")
                probs = T.alloc_buffer((NT,), "float32", scope="shared")
                parts = T.alloc_buffer((NT,), "float32", scope="shared")
                run = T.alloc_buffer((4,), "float32", scope="local")  # max, sum, chunk max, rescale
                acc = T.alloc_buffer((2,), "float32", scope="local")
                kv: T.let = h // G
                n: T.let = past[0]
                if t < D:
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
                    if h % G == 0:
                        page: T.let = pt[0, n // P]
                        pages[page, 0, kv, n % P, t] = k_new[t]
                        pages[page, 1, kv, n % P, t] = v_new[t]
                        if rotary:
                            k_out[0, 0, kv, t] = k_new[t]
                            v_out[0, 0, kv, t] = v_new[t]
                run[0] = T.float32(-3.0e38)
                run[1] = T.float32(0)
                acc[0] = T.float32(0)
                for chunk in T.serial((n + NT) // NT):  # positions 0..n, n the new one
                    pos: T.let = chunk * NT + t
                    old: T.let = T.max(T.min(pos, n - 1), 0)  # (a valid history row, selected away past it)
                    row_page: T.let = pt[0, old // P]
                    acc[1] = T.float32(0)
                    for d in T.serial(D):
                        acc[1] = acc[1] + q_sh[d] * T.Select(pos < n, pages[row_page, 0, kv, old % P, d], k_new[d])
                    scores[t] = T.Select(pos <= n, acc[1], T.float32(-3.0e38))
                    T.tvm_storage_sync("shared")
                    run[2] = run[0]
                    for j in T.serial(NT):
                        run[2] = T.max(run[2], scores[j])
                    run[3] = T.exp(run[0] - run[2])
                    probs[t] = T.Select(pos <= n, T.exp(scores[t] - run[2]), T.float32(0))
                    T.tvm_storage_sync("shared")
                    run[1] = run[1] * run[3]
                    for j in T.serial(NT):
                        run[1] = run[1] + probs[j]
                    run[0] = run[2]
                    acc[0] = acc[0] * run[3]
                    for i in T.serial(NT // LANES):
                        j: T.let = i * LANES + t // D
                        at: T.let = chunk * NT + j
                        vpos: T.let = T.max(T.min(at, n - 1), 0)
                        vpage: T.let = pt[0, vpos // P]
                        acc[0] = acc[0] + probs[j] * T.Select(at < n, pages[vpage, 1, kv, vpos % P, t % D],
                                                              T.Select(at == n, v_new[t % D], T.float32(0)))
                    T.tvm_storage_sync("shared")
                parts[t] = acc[0]
                T.tvm_storage_sync("shared")
                if t < D:
                    acc[1] = T.float32(0)
                    for s in T.unroll(LANES):
                        acc[1] = acc[1] + parts[s * D + t]
                    out[0, 0, h, t] = acc[1] / run[1]

    if rotary:
        @T.prim_func
        def f(qkv: T.Buffer((1, 1, W), "float32"), cos: T.Buffer((1, 1, HALF), "float32"),
              sin: T.Buffer((1, 1, HALF), "float32"), pages_h: T.handle, pt_h: T.handle,
              past: T.Buffer((1,), "int32"), counters: T.Buffer((1,), "uint32"), work: T.Buffer((1,), "float32"),
              out: T.Buffer((1, 1, H, D), "float32"), k_out: T.Buffer((1, 1, HKV, D), "float32"),
              v_out: T.Buffer((1, 1, HKV, D), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            NP = T.int32()
            MP = T.int32()
            pages = T.match_buffer(pages_h, (NP, 2, HKV, P, D), "float32")
            pt = T.match_buffer(pt_h, (1, MP), "int32")
            body(qkv, cos, sin, None, None, None, pages, pt, past, out, k_out, v_out)
    else:
        @T.prim_func
        def f(q: T.Buffer((1, 1, H, D), "float32"), k: T.Buffer((1, 1, HKV, D), "float32"),
              v: T.Buffer((1, 1, HKV, D), "float32"), pages_h: T.handle, pt_h: T.handle,
              past: T.Buffer((1,), "int32"), counters: T.Buffer((1,), "uint32"), work: T.Buffer((1,), "float32"),
              out: T.Buffer((1, 1, H, D), "float32")):
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
            NP = T.int32()
            MP = T.int32()
            pages = T.match_buffer(pages_h, (NP, 2, HKV, P, D), "float32")
            pt = T.match_buffer(pt_h, (1, MP), "int32")
            body(None, None, None, q, k, v, pages, pt, past, out, None, None)

    return symbol, f.with_attr("global_symbol", symbol)
