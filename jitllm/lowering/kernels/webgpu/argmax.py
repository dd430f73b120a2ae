"""The greedy pick for WGSL: the first largest logit's index, in two dispatches (WebGPU has no warp shuffles
in TVM's codegen, so each reduction goes through workgroup memory): a workgroup per SPAN logits keeps its
slice's best (value, index) in scratch, then one workgroup picks among those. In both, each thread keeps its
own best in registers; the tree halves the active threads each level, a thread taking the other half's best
only when it is larger, or equal at a smaller index — so the pick is the lowest index of the largest value,
however the logits are cut (as the one-workgroup kernel before it, and numpy's argmax for finite logits)."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

NT = 256
"""Threads of a workgroup: a tree of 8 levels in workgroup memory."""
SPAN = 4 * NT
"""Logits a workgroup of the first dispatch reduces (4 a thread)."""
NEG = -3.4e38


def argmax_kernel(vocab: int) -> tuple[str, tvm.tirx.PrimFunc]:
    symbol = f"jl_wgsl_argmax2_{vocab}"
    slices = (vocab + SPAN - 1) // SPAN
    steps = (slices + NT - 1) // NT  # (slices a thread of the second dispatch scans)

    @T.macro
    def tree(best, at, mine, best_at, other, other_at, tx):
        """Each thread's (mine, best_at) into best[0], at[0]."""
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

    @T.prim_func
    def f(logits: T.Buffer((1, 1, vocab), "float32"), token: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        slice_best = T.alloc_buffer((slices,), "float32")
        slice_at = T.alloc_buffer((slices,), "int32")
        for blk in T.thread_binding(slices, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                best = T.alloc_buffer((NT,), "float32", scope="shared")
                at = T.alloc_buffer((NT,), "int32", scope="shared")
                mine = T.alloc_buffer((1,), "float32", scope="local")
                best_at = T.alloc_buffer((1,), "int32", scope="local")
                other = T.alloc_buffer((1,), "float32", scope="local")
                other_at = T.alloc_buffer((1,), "int32", scope="local")
                mine[0] = T.float32(NEG)
                best_at[0] = T.int32(vocab)
                for i in T.unroll(SPAN // NT):
                    c: T.let = blk * SPAN + i * NT + tx
                    if c < vocab:
                        if logits[0, 0, c] > mine[0]:  # (later indices win only when larger: the first is kept)
                            mine[0] = logits[0, 0, c]
                            best_at[0] = c
                tree(best, at, mine, best_at, other, other_at, tx)
                if tx == 0:
                    slice_best[blk] = best[0]
                    slice_at[blk] = at[0]
        for blk in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                best = T.alloc_buffer((NT,), "float32", scope="shared")
                at = T.alloc_buffer((NT,), "int32", scope="shared")
                mine = T.alloc_buffer((1,), "float32", scope="local")
                best_at = T.alloc_buffer((1,), "int32", scope="local")
                other = T.alloc_buffer((1,), "float32", scope="local")
                other_at = T.alloc_buffer((1,), "int32", scope="local")
                mine[0] = T.float32(NEG)
                best_at[0] = T.int32(vocab)
                for i in T.serial(steps):
                    s: T.let = i * NT + tx
                    if s < slices:  # (slices in order: their indices grow, so the first larger is kept)
                        if slice_best[s] > mine[0]:
                            mine[0] = slice_best[s]
                            best_at[0] = slice_at[s]
                tree(best, at, mine, best_at, other, other_at, tx)
                if tx == 0:
                    token[0] = at[0]

    return symbol, f.with_attr("global_symbol", symbol)
