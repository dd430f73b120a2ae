"""The greedy pick for WGSL: the first largest logit's index, by one workgroup (WebGPU has no warp
shuffles in TVM's codegen, so the reduction goes through workgroup memory). Each thread keeps its own
best (value, index) in registers; the tree halves the active threads each level, a thread taking the
other half's best only when it is larger, or equal at a smaller index."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

NT = 256
"""Threads of the one workgroup: each scans every NT-th logit, then a tree in workgroup memory."""


def argmax_kernel(vocab: int) -> tuple[str, tvm.tirx.PrimFunc]:
    symbol = f"jl_wgsl_argmax_{vocab}"
    steps = (vocab + NT - 1) // NT

    @T.prim_func
    def f(logits: T.Buffer((1, 1, vocab), "float32"), token: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for blk in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                best = T.alloc_buffer((NT,), "float32", scope="shared")
                at = T.alloc_buffer((NT,), "int32", scope="shared")
                mine = T.alloc_buffer((1,), "float32", scope="local")
                best_at = T.alloc_buffer((1,), "int32", scope="local")
                other = T.alloc_buffer((1,), "float32", scope="local")
                other_at = T.alloc_buffer((1,), "int32", scope="local")
                mine[0] = T.float32(-3.4e38)
                best_at[0] = T.int32(vocab)
                for i in T.serial(steps):
                    c: T.let = i * NT + tx
                    if c < vocab:
                        if logits[0, 0, c] > mine[0]:  # (later indices win only when larger: the first is kept)
                            mine[0] = logits[0, 0, c]
                            best_at[0] = c
                best[tx] = mine[0]
                at[tx] = best_at[0]
                T.tvm_storage_sync("shared")
                for level in T.unroll(8):  # NT = 2**8: read the other half, wait, then write (two phases,
                    half: T.let = NT >> (level + 1)  # since TVM's sync planner cannot sync inside a condition)
                    if tx < half:
                        other[0] = best[tx + half]
                        other_at[0] = at[tx + half]
                    T.tvm_storage_sync("shared")
                    if tx < half:
                        if other[0] > mine[0] or (other[0] == mine[0] and other_at[0] < best_at[0]):
                            mine[0] = other[0]
                            best_at[0] = other_at[0]
                        best[tx] = mine[0]
                        at[tx] = best_at[0]
                    T.tvm_storage_sync("shared")
                if tx == 0:
                    token[0] = at[0]

    return symbol, f.with_attr("global_symbol", symbol)
