"""CPU TIR kernel of the routed SwiGLU experts (`MoeSwiGLU`, jitllm.ir.ops), exact family: f32 activations
times each weight exactly dequantized, for every weight type of core/layouts.py.

Experts are walked one at a time and every token routed to an expert goes through it while its rows are
read, so prefill reads each expert's weights once for all its tokens (tokens grouped by expert), and an
expert no token was routed to is never read (a decode step reads its top-k experts only). Within an
expert the work is parallel over row groups, gate and up in one pass over h, then down over the
activations.

Over an expert cache (`slots`, MoeSwiGLUSlots) the weights hold `slots` experts and expert e's rows are
those of slot slot_map[e]; the experts are still walked in id order, so each token's sum is added up in
the order the resident kernel adds it (the same bits).
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import ROW_GROUP
from jitllm.lowering.kernels.formats import expert_buffers, weight_at, without_params

R = ROW_GROUP


def _base(slot_map, e, slots: int):
    """The slot whose rows hold expert e: slot_map[e] over a cache, else e itself."""
    return T.Cast("int32", slot_map[e]) if slots else e


def moe_kernel(wtypes: tuple[str, str, str], experts: int, ffn: int, hidden: int, top_k: int, slots: int = 0
               ) -> tuple[str, tvm.tirx.PrimFunc]:
    """(symbol, PrimFunc) of y[M, K] from h[M, K], ids[M, top_k] (int64), weights[M, top_k] and the gate,
    up ([E * F, K]) and down ([E * K, F]) experts' parts; with `slots`, a slot map [E] (int64) after the
    weights and parts of `slots` experts."""
    gt, ut, dt = wtypes
    E, F, K, TOP = experts, ffn, hidden, top_k
    S = slots or experts
    GF, GK = F // R, K // R
    (gb, gu_unused), (ub, uu_unused), (db, du_unused) = (expert_buffers(gt, S * F, K), expert_buffers(ut, S * F, K),
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
          y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        h = T.match_buffer(h_h, (M, K), "float32")
        ids = T.match_buffer(ids_h, (M, TOP), "int64")
        wts = T.match_buffer(wts_h, (M, TOP), "float32")
        y = T.match_buffer(y_h, (M, K), "float32")
        act = T.alloc_buffer((M, F), "float32")
        route = T.alloc_buffer((M,), "float32")
        routed = T.alloc_buffer((M,), "int32")
        hits = T.alloc_buffer((1,), "int32")
        acc = T.alloc_buffer((GF, 2, R), "float32")  # per row group: outside the parallel loop (DESIGN.md §3)
        acc_down = T.alloc_buffer((GK, R), "float32")
        for m in T.serial(M):
            for c in T.serial(K):
                y[m, c] = T.float32(0)
        for e in T.serial(E):
            hits[0] = 0
            for m in T.serial(M):
                route[m] = T.float32(0)
                routed[m] = 0
                for j in T.serial(TOP):
                    if ids[m, j] == T.Cast("int64", e):
                        route[m] = wts[m, j]
                        routed[m] = 1
                        hits[0] = hits[0] + 1
            if hits[0] > 0:
                for g in T.parallel(GF):
                    for m in T.serial(M):
                        if routed[m] == 1:
                            for r in T.vectorized(R):
                                acc[g, 0, r] = T.float32(0)
                                acc[g, 1, r] = T.float32(0)
                            for kk in T.serial(K):
                                for r in T.vectorized(R):
                                    acc[g, 0, r] = acc[g, 0, r] + weight_at(
                                        gt, g_w, g_qs, g_qh, g_sc, g_mn, g_d, g_d2, _base(slot_map, e, slots) * GF + g, kk, r) * h[m, kk]
                                    acc[g, 1, r] = acc[g, 1, r] + weight_at(
                                        ut, u_w, u_qs, u_qh, u_sc, u_mn, u_d, u_d2, _base(slot_map, e, slots) * GF + g, kk, r) * h[m, kk]
                            for r in T.vectorized(R):
                                act[m, g * R + r] = acc[g, 0, r] * T.sigmoid(acc[g, 0, r]) * acc[g, 1, r]
                for g in T.parallel(GK):
                    for m in T.serial(M):
                        if routed[m] == 1:
                            for r in T.vectorized(R):
                                acc_down[g, r] = T.float32(0)
                            for kk in T.serial(F):
                                for r in T.vectorized(R):
                                    acc_down[g, r] = acc_down[g, r] + weight_at(
                                        dt, d_w, d_qs, d_qh, d_sc, d_mn, d_d, d_d2, _base(slot_map, e, slots) * GK + g, kk, r) * act[m, kk]
                            for r in T.vectorized(R):
                                y[m, g * R + r] = y[m, g * R + r] + route[m] * acc_down[g, r]

    unused = {f"g_{p}" for p in gu_unused} | {f"u_{p}" for p in uu_unused} | {f"d_{p}" for p in du_unused}
    if not slots:
        unused.add("slot_map")
    symbol = f"jl_moe_{gt}_{ut}_{dt}_{E}x{F}x{K}_top{TOP}" + (f"_slots{slots}" if slots else "")
    return symbol, without_params(f, unused).with_attr("global_symbol", symbol)
