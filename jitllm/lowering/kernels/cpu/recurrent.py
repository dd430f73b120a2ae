"""TIR kernel of the gated recurrence (GLA blocks) for CPU targets: the state is updated in place.

Per (sequence, head) a serial scan over the tokens; per token one pass over the D rows of the state,
each row decayed, given k_i * v and folded into the output (vectorised over the row). Parallel over
(sequence, head) once there is enough work for the launch to pay.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind

SERIAL_WORK = 16384
"""Multiply-adds (sequences x heads x tokens x D x D) below which the scan runs on the calling thread."""


def recurrence_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """(q, k, v, a [B,S,H,D], state [B,H,D,D] in place, out [B,S,H,D]): out_t = q_t S_t, S_t = a_t S_{t-1} + k_t^T v_t."""
    c = kind.config
    H, D = c.heads, c.head_dim
    symbol = f"jl_gated_recurrence_h{H}_d{D}"

    @T.macro
    def scan(q, k, v, a, state, out, item):
        b: T.let = item // H
        h: T.let = item % H
        for t in T.serial(q.shape[1]):
            for j in T.vectorized(D):
                out[b, t, h, j] = T.float32(0)
            for i in T.serial(D):
                for j in T.vectorized(D):
                    state[b, h, i, j] = a[b, t, h, i] * state[b, h, i, j] + k[b, t, h, i] * v[b, t, h, j]
                    out[b, t, h, j] = out[b, t, h, j] + q[b, t, h, i] * state[b, h, i, j]

    @T.prim_func
    def f(q_h: T.handle, k_h: T.handle, v_h: T.handle, a_h: T.handle, state_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B = T.int64()
        S = T.int64()
        q = T.match_buffer(q_h, (B, S, H, D), "float32")
        k = T.match_buffer(k_h, (B, S, H, D), "float32")
        v = T.match_buffer(v_h, (B, S, H, D), "float32")
        a = T.match_buffer(a_h, (B, S, H, D), "float32")
        state = T.match_buffer(state_h, (B, H, D, D), "float32")
        out = T.match_buffer(out_h, (B, S, H, D), "float32")
        if B * H * S * D * D < SERIAL_WORK:
            for item in T.serial(B * H):
                scan(q, k, v, a, state, out, item)
        else:
            for item in T.parallel(B * H):
                scan(q, k, v, a, state, out, item)

    return symbol, f.with_attr("global_symbol", symbol)
