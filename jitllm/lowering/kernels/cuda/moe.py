"""CUDA TIR kernel of the routed SwiGLU experts (`MoeSwiGLU`, `MoeSwiGLUSlots`: jitllm.ir.ops), exact family:
f32 activations times each weight dequantized as it is read (every weight type: formats.weight_at).

Two launches over the routed (token, pick) pairs only, so a decode step reads the rows of its top-k experts
and of no other expert:
1. gate/up: a thread block per (token, pick) and group of the expert's row groups, one thread per row:
   act[m, j * F + f] = silu(gate_e[f] . h[m]) * (up_e[f] . h[m]) for expert e = ids[m, j], whose rows start
   at e * F in the stacked bank (or at its slot's, slot_map[e] * F, over an expert cache);
2. down: a thread block per token and group of y's row groups, one thread per row, adding the picks in
   pick order: y[m, c] = sum_j weights[m, j] * (down_e[c] . act[m, j * F ..]).
A thread walks its row's inputs in order, with no sums across threads; a warp's threads are the 8
interleaved rows of 4 row groups, so each load of a column covers whole 32-byte sectors (f32). `act`
([M, top_k * F]) is the kernel's first output, written by the first launch and read by the second (the
runtime allocates it, as any output: nothing is allocated inside the kernel, so a captured graph holds it).

Prefill runs every (token, pick) pair, so an expert picked by several tokens is read once per pick (the
llvm kernel groups tokens by expert instead); a correctness kernel, its speed not tuned. Over a cache the
picks are still added in pick order, so resident and streamed experts give the same bits on CUDA.

`gpu=False` builds the same loops serial, without thread bindings: the arithmetic and indexing then run
on a CPU (the tests check them there; a machine without a GPU cannot run the kernel itself).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import ROW_GROUP
from jitllm.lowering.kernels.formats import expert_buffers, weight_at, without_params

R = ROW_GROUP
MAX_GROUPS = 32
"""Row groups per thread block at most (R * 32 = 256 threads)."""


def groups_per_block(groups: int) -> int:
    """Row groups per thread block: the largest power of two up to MAX_GROUPS that divides `groups`."""
    n = MAX_GROUPS
    while groups % n:
        n //= 2
    return n


def _axis(extent, thread: str, gpu: bool):
    """A loop bound to `thread` on the GPU, serial without (gpu=False)."""
    return T.thread_binding(extent, thread=thread) if gpu else T.serial(extent)


def _expert_base(ids, slot_map, m, j, slots: int):
    """The slot (or, without a cache, the expert) whose rows pick j of token m reads."""
    e = ids[m, j]
    return T.Cast("int32", slot_map[e]) if slots else T.Cast("int32", e)


def moe_kernel(wtypes: tuple[str, str, str], experts: int, ffn: int, hidden: int, top_k: int, slots: int = 0,
               gpu: bool = True) -> tuple[str, tvm.tirx.PrimFunc]:
    """(symbol, PrimFunc): h[M, K], ids[M, top_k] (int64), weights[M, top_k], with `slots` a slot map [E]
    (int64), the gate, up ([S * F, K]) and down ([S * K, F]) experts' parts (S: `slots`, else `experts`),
    then the outputs act [M, top_k * F] (scratch) and y [M, K]."""
    gt, ut, dt = wtypes
    E, F, K, TOP = experts, ffn, hidden, top_k
    S = slots or experts
    GF, GK = F // R, K // R
    BF, BK = groups_per_block(GF), groups_per_block(GK)
    (gb, g_absent), (ub, u_absent), (db, d_absent) = (expert_buffers(gt, S * F, K), expert_buffers(ut, S * F, K),
                                                      expert_buffers(dt, S * K, F))
    (g0s, g0t), (g1s, g1t), (g2s, g2t), (g3s, g3t), (g4s, g4t), (g5s, g5t), (g6s, g6t) = gb
    (u0s, u0t), (u1s, u1t), (u2s, u2t), (u3s, u3t), (u4s, u4t), (u5s, u5t), (u6s, u6t) = ub
    (d0s, d0t), (d1s, d1t), (d2s, d2t), (d3s, d3t), (d4s, d4t), (d5s, d5t), (d6s, d6t) = db

    @T.prim_func
    def f(h_h: T.handle, ids_h: T.handle, wts_h: T.handle, slot_map: T.Buffer((E,), "int64"),
          g_w: T.Buffer(g0s, g0t), g_qs: T.Buffer(g1s, g1t), g_qh: T.Buffer(g2s, g2t), g_sc: T.Buffer(g3s, g3t),
          g_mn: T.Buffer(g4s, g4t), g_d: T.Buffer(g5s, g5t), g_d2: T.Buffer(g6s, g6t),
          u_w: T.Buffer(u0s, u0t), u_qs: T.Buffer(u1s, u1t), u_qh: T.Buffer(u2s, u2t), u_sc: T.Buffer(u3s, u3t),
          u_mn: T.Buffer(u4s, u4t), u_d: T.Buffer(u5s, u5t), u_d2: T.Buffer(u6s, u6t),
          d_w: T.Buffer(d0s, d0t), d_qs: T.Buffer(d1s, d1t), d_qh: T.Buffer(d2s, d2t), d_sc: T.Buffer(d3s, d3t),
          d_mn: T.Buffer(d4s, d4t), d_d: T.Buffer(d5s, d5t), d_d2: T.Buffer(d6s, d6t),
          act_h: T.handle, y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        h = T.match_buffer(h_h, (M, K), "float32")
        ids = T.match_buffer(ids_h, (M, TOP), "int64")
        wts = T.match_buffer(wts_h, (M, TOP), "float32")
        act = T.match_buffer(act_h, (M, TOP * F), "float32")
        y = T.match_buffer(y_h, (M, K), "float32")
        for mj in _axis(M * TOP, "blockIdx.x", gpu):
            for bg in _axis(GF // BF, "blockIdx.y", gpu):
                for t in _axis(BF * R, "threadIdx.x", gpu):
                    acc = T.alloc_buffer((2,), "float32", scope="local")
                    m: T.let = mj // TOP
                    j: T.let = mj % TOP
                    g: T.let = _expert_base(ids, slot_map, m, j, slots) * GF + bg * BF + t // R
                    r: T.let = t % R
                    acc[0] = T.float32(0)
                    acc[1] = T.float32(0)
                    for kk in T.serial(K):
                        acc[0] = acc[0] + weight_at(gt, g_w, g_qs, g_qh, g_sc, g_mn, g_d, g_d2, g, kk, r) * h[m, kk]
                        acc[1] = acc[1] + weight_at(ut, u_w, u_qs, u_qh, u_sc, u_mn, u_d, u_d2, g, kk, r) * h[m, kk]
                    act[m, j * F + (bg * BF) * R + t] = acc[0] * T.sigmoid(acc[0]) * acc[1]
        for m2 in _axis(M, "blockIdx.x", gpu):
            for bg2 in _axis(GK // BK, "blockIdx.y", gpu):
                for t2 in _axis(BK * R, "threadIdx.x", gpu):
                    acc2 = T.alloc_buffer((2,), "float32", scope="local")
                    r2: T.let = t2 % R
                    acc2[1] = T.float32(0)
                    for j2 in T.serial(TOP):
                        acc2[0] = T.float32(0)
                        for kk2 in T.serial(F):
                            acc2[0] = acc2[0] + weight_at(
                                dt, d_w, d_qs, d_qh, d_sc, d_mn, d_d, d_d2,
                                _expert_base(ids, slot_map, m2, j2, slots) * GK + bg2 * BK + t2 // R, kk2, r2
                            ) * act[m2, j2 * F + kk2]
                        acc2[1] = acc2[1] + wts[m2, j2] * acc2[0]
                    y[m2, (bg2 * BK) * R + t2] = acc2[1]

    unused = {f"g_{p}" for p in g_absent} | {f"u_{p}" for p in u_absent} | {f"d_{p}" for p in d_absent}
    if not slots:
        unused.add("slot_map")
    symbol = f"jl_gpu_moe_{gt}_{ut}_{dt}_{E}x{F}x{K}_top{TOP}" + (f"_slots{slots}" if slots else "")
    return symbol, without_params(f, unused).with_attr("global_symbol", symbol)
