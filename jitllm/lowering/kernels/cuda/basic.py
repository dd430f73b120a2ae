"""GPU kernels (CUDA and other SIMT targets) for jitllm's custom ops.

- Linear: an unscheduled compute definition (dequantize + matmul over the row-interleaved layouts);
  dlight schedules it (GEMV rules for decode, matmul for prefill) when the target builds the module.
- Paged attention (prefill, multi-token steps): one thread block per (sequence, tile of queries, head),
  keys staged in shared memory a few at a time, online softmax (see attention_kernel).
- KV append: one thread block per (sequence, new token, KV head), one thread per head dim.
- Embedding gather: rows of a row-interleaved (possibly quantized) table as f32, one thread per value.
- Greedy pick: the first largest logit's index, one thread block (see argmax_kernel).

Decode kernels may be launched dependent (programmatic dependent launch, sm_90 on; see
`await_previous_kernel`).
"""

from __future__ import annotations

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from jitllm.core.layouts import QUANT_BLOCK, ROW_GROUP, WIDE_TYPES, weight_parts
from jitllm.ir.config import BlockKind
from jitllm.lowering.kernels.formats import float_weight, union_parts, weight_value, without_params
from jitllm.lowering.kernels.kv_store import Q8, buffer_amax, load, store_q8_element, stored

R = ROW_GROUP
NT = 128  # threads per attention block: must be >= head_dim and a power of two


def _i64(v: int) -> tirx.IntImm:
    return tirx.IntImm("int64", v)


def shfl_xor(value, lanes: int, dtype: str = "float32"):
    """`value` from the lane whose index differs from this one's in the bits of `lanes` (whole warp)."""
    return T.call_extern(dtype, "__shfl_xor_sync", T.uint32(0xFFFFFFFF), value, lanes, 32)


DEPENDENT_LAUNCH = "tirx.use_programtic_dependent_launch"  # TVM's spelling of the launch tag


@T.macro
def await_previous_kernel(dependent: bool):
    """With `dependent`, the start of a kernel launched dependent (`dependent_launch`): the GPU may launch
    it once the kernel before it in the stream has no thread block left running, before that kernel
    has completed (its writes flushed, its completion signalled), so each thread first waits for that.
    Every thread of every dependent kernel waits before it writes anything or reads what the kernel
    before wrote, so a chain of them stays ordered; code before this point may only read what no kernel
    of the step writes (weights: the float matvecs load their first columns there). The matvecs do not
    let the next kernel launch earlier (`release_next_kernel`): on the H200, every kernel triggering right
    after the wait cost 7% of 3B f16 decode, and the matvecs triggering after their loops measured 2-7%
    below not triggering (3-4% above on SmolLM2; docs/performance-gpu.md, stop 18)."""
    if dependent:
        T.evaluate(T.ptx.griddepcontrol.wait())


@T.macro
def release_next_kernel(dependent: bool):
    """With `dependent`, let the next kernel in the stream launch now (griddepcontrol.launch_dependents;
    it launches once every thread block of this grid has done so or exited), before this one completes:
    its blocks take the SMs this grid leaves idle and do what precedes their `await_previous_kernel`.
    For a latency-bound kernel with few busy blocks (the split decode attention), not the matvecs (whose
    blocks fill the GPU: see above)."""
    if dependent:
        T.evaluate(T.ptx.griddepcontrol.launch_dependents())


def dependent_launch(func: tvm.tirx.PrimFunc, dependent: bool) -> tvm.tirx.PrimFunc:
    """`func` launched dependent where `dependent` (its body must begin with `await_previous_kernel`)."""
    return func.with_attr("tirx.kernel_launch_params", [DEPENDENT_LAUNCH]) if dependent else func


def absent_weight_params(wtype: str) -> set[str]:
    """The weight parameters (q, d, mn: quants or float weights, scales, minimums) a kernel written for
    every format drops for `wtype`: those beyond its parts in jitllm.core.layouts.weight_parts."""
    return set(("d", "mn")[len(weight_parts(wtype, ROW_GROUP, QUANT_BLOCK)) - 1:])


def linear_kernel(wtype: str, n: int, k: int, rows: int | None = None) -> tuple[str, tvm.tirx.PrimFunc]:
    """One activation row (`rows` == 1, decode) takes the hand-scheduled GEMV of kernels/cuda/gemv.py;
    otherwise an unscheduled compute definition for dlight's matmul rules."""
    if rows == 1:
        from jitllm.lowering.kernels.cuda.gemv import gemv_kernel

        return gemv_kernel(wtype, n, k)
    symbol = f"jl_gpu_linear_{wtype}_{n}x{k}" + (f"_m{rows}" if rows else "")
    g, nb = n // R, k // QUANT_BLOCK
    m = _i64(rows) if rows else tirx.Var("m", "int64")
    x = te.placeholder((m, _i64(k)), "float32", name="x")
    if wtype in ("f32", "f16"):
        w = te.placeholder((_i64(g), _i64(k), _i64(R)), "float32" if wtype == "f32" else "float16", name="w")
        parts = [w]

        def weight(row, col):
            return w[row // R, col, row % R].astype("float32")
    elif wtype == "bf16" or wtype in WIDE_TYPES:
        parts = [te.placeholder([_i64(v) for v in shape], dtype, name=name) for name, shape, dtype in
                 weight_parts(wtype, n, k)]

        def weight(row, col):
            if wtype == "bf16":
                return float_weight(wtype, parts[0][row // R, col, row % R])
            return weight_value(wtype, union_parts(wtype, parts), row // R, row % R, col)
    else:
        qshape = (_i64(g), _i64(nb), _i64(32 if wtype == "q8_0" else 16), _i64(R))
        qs = te.placeholder(qshape, "int8" if wtype == "q8_0" else "uint8", name="qs")
        d = te.placeholder((_i64(g), _i64(nb), _i64(R)), "float16", name="d")
        parts = [qs, d]
        if wtype == "q4_1":
            mn = te.placeholder((_i64(g), _i64(nb), _i64(R)), "float16", name="mn")
            parts.append(mn)

        def weight(row, col):
            grp, lane, blk, j = row // R, row % R, col // QUANT_BLOCK, col % QUANT_BLOCK
            scale = d[grp, blk, lane].astype("float32")
            if wtype == "q8_0":
                return scale * qs[grp, blk, j, lane].astype("float32")
            shift = (j // 16 * 4).astype("uint8")
            nibble = tirx.bitwise_and(tirx.shift_right(qs[grp, blk, j % 16, lane], shift), tirx.const(15, "uint8"))
            if wtype == "q4_0":
                return scale * (nibble.astype("float32") - 8.0)
            return scale * nibble.astype("float32") + mn[grp, blk, lane].astype("float32")

    wmat = te.compute((_i64(n), _i64(k)), weight, name="dequant")
    red = te.reduce_axis((_i64(0), _i64(k)), name="k")
    y = te.compute((m, _i64(n)), lambda i, j: te.sum(x[i, red] * wmat[j, red], axis=red), name="matmul")
    func = te.create_prim_func([x, *parts, y])
    return symbol, func.with_attr("global_symbol", symbol)


BQ, BKV = 32, 16  # prefill attention: queries per thread block, keys per step


def attention_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """Causal attention of S new queries over the paged history plus the new keys (prefill and
    multi-token steps). One thread block per (sequence, tile of BQ queries, head); per step of BKV
    keys it stages K and V in shared memory, each thread scores one query against 4 keys, one thread
    per query updates the online softmax, and each thread accumulates its output column for its
    queries. Keys past a query's position (and past the tile's last query) are skipped."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    GROUP = H // HKV
    scale = 1.0 / (D ** 0.5)
    if D > NT or NT % D:
        raise ValueError(f"head_dim {D} must divide {NT}")
    QG = NT // D  # query groups: thread t owns column t % D of queries t // D, t // D + QG, ...
    QPT = BQ // QG  # queries per thread in the output
    KPT = BQ * BKV // NT  # keys per thread when scoring
    QPAD = D + 1  # padded rows: threads reading one column of different rows hit different banks
    symbol = f"jl_gpu_paged_attention_h{H}_kv{HKV}_d{D}_p{P}"

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
        for blk in T.thread_binding(B * ((S + BQ - 1) // BQ) * H, thread="blockIdx.x"):
            for tx in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                qs = T.alloc_buffer((BQ * QPAD,), "float32", scope="shared")
                ks = T.alloc_buffer((BKV * QPAD,), "float32", scope="shared")
                vs = T.alloc_buffer((BKV * D,), "float32", scope="shared")
                ps = T.alloc_buffer((BQ * BKV,), "float32", scope="shared")  # scores
                pp = T.alloc_buffer((BQ * BKV,), "float32", scope="shared")  # probabilities
                row_sum = T.alloc_buffer((BQ,), "float32", scope="shared")
                rescale = T.alloc_buffer((BQ,), "float32", scope="shared")
                st = T.alloc_buffer((2,), "float32", scope="local")
                sm = T.alloc_buffer((4,), "float32", scope="local")
                acc = T.alloc_buffer((QPT,), "float32", scope="local")
                score = T.alloc_buffer((KPT,), "float32", scope="local")
                vv = T.alloc_buffer((4,), "float32", scope="local")
                p4 = T.alloc_buffer((4,), "float32", scope="local")
                tiles: T.let = (S + BQ - 1) // BQ
                b: T.let = blk // (tiles * H)
                s0: T.let = blk // H % tiles * BQ
                h: T.let = blk % H
                kv: T.let = h // GROUP
                n: T.let = T.Cast("int64", past[b])
                keys: T.let = n + T.min(s0 + BQ, S)  # keys the tile's last query sees
                for i in T.serial(BQ * D // NT):
                    e: T.let = i * NT + tx
                    qr: T.let = e // D
                    qs[qr * QPAD + e % D] = T.if_then_else(
                        s0 + qr < S, q[b, T.min(s0 + qr, S - 1), h, e % D] * T.float32(scale), T.float32(0))
                st[0] = T.float32(-3.0e38)
                st[1] = T.float32(0)
                for i in T.unroll(QPT):
                    acc[i] = T.float32(0)
                for step in T.serial((keys + BKV - 1) // BKV):
                    k0: T.let = step * BKV
                    T.tvm_storage_sync("shared")
                    for i in T.serial(BKV * D // NT):
                        e: T.let = i * NT + tx
                        kr: T.let = e // D
                        pos: T.let = T.min(k0 + kr, keys - 1)
                        fresh: T.let = T.max(pos - n, T.int64(0))
                        page: T.let = T.Cast("int64", pt[b, T.min(pos, T.max(n - 1, T.int64(0))) // P])
                        ks[kr * QPAD + e % D] = T.Select(pos < n, load(pages, [page, 0, kv, pos % P, e % D]),
                                                         k[b, T.min(fresh, S - 1), kv, e % D])
                        vs[kr * D + e % D] = T.Select(pos < n, load(pages, [page, 1, kv, pos % P, e % D]),
                                                      v[b, T.min(fresh, S - 1), kv, e % D])
                    T.tvm_storage_sync("shared")
                    qr: T.let = tx // (BKV // KPT)
                    kc: T.let = tx % (BKV // KPT) * KPT
                    for j in T.unroll(KPT):
                        score[j] = T.float32(0)
                    for dd in T.serial(D):
                        for j in T.unroll(KPT):
                            score[j] = score[j] + qs[qr * QPAD + dd] * ks[(kc + j) * QPAD + dd]
                    for j in T.unroll(KPT):
                        ps[qr * BKV + kc + j] = T.Select(k0 + kc + j <= n + s0 + qr, score[j], T.float32(-3.0e38))
                    T.tvm_storage_sync("shared")
                    if tx < BQ:  # thread tx keeps row tx's running max (st[0]) and sum (st[1])
                        sm[0] = st[0]
                        for j in T.serial(BKV):
                            sm[0] = T.max(sm[0], ps[tx * BKV + j])
                        sm[1] = T.exp(st[0] - sm[0])
                        rescale[tx] = sm[1]
                        sm[2] = T.float32(0)
                        for j in T.serial(BKV):
                            sm[3] = T.exp(ps[tx * BKV + j] - sm[0])
                            pp[tx * BKV + j] = sm[3]
                            sm[2] = sm[2] + sm[3]
                        st[0] = sm[0]
                        st[1] = st[1] * sm[1] + sm[2]
                    T.tvm_storage_sync("shared")
                    for i in T.unroll(QPT):
                        acc[i] = acc[i] * rescale[tx // D + i * QG]
                    for j4 in T.serial(BKV // 4):  # 4 keys: their V values in registers, each query's 4 probabilities in one load
                        for r in T.unroll(4):
                            vv[r] = vs[(j4 * 4 + r) * D + tx % D]
                        for i in T.unroll(QPT):
                            for r in T.vectorized(4):
                                p4[r] = pp[(tx // D + i * QG) * BKV + j4 * 4 + r]
                            for r in T.unroll(4):
                                acc[i] = acc[i] + p4[r] * vv[r]
                if tx < BQ:
                    row_sum[tx] = st[1]
                T.tvm_storage_sync("shared")
                for i in T.unroll(QPT):
                    qo: T.let = tx // D + i * QG
                    if s0 + qo < S:
                        out[b, s0 + qo, h, tx % D] = acc[i] / row_sum[qo]

    return symbol, f.with_attr("global_symbol", symbol)


def append_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """The new K/V rows into the pool (a q8_0 pool's: each thread its quant, its block's scale from the
    block's 32 values it reads itself)."""
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    HKV, D = c.kv_heads, c.head_dim
    symbol = f"jl_gpu_kv_append_kv{HKV}_d{D}_p{P}"

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
        for bsh in T.thread_binding(B * S * HKV, thread="blockIdx.x"):
            for dd in T.thread_binding(T.int64(D), thread="threadIdx.x"):
                b: T.let = bsh // (S * HKV)
                s: T.let = bsh // HKV % S
                h: T.let = bsh % HKV
                pos: T.let = T.Cast("int64", past[b]) + s
                page: T.let = T.Cast("int64", pt[b, pos // P])
                if KV == Q8:
                    store_q8_element(pages, page, 0, h, pos % P, dd, k[b, s, h, dd], buffer_amax(k, (b, s, h), dd), D)
                    store_q8_element(pages, page, 1, h, pos % P, dd, v[b, s, h, dd], buffer_amax(v, (b, s, h), dd), D)
                else:
                    pages[page, 0, h, pos % P, dd] = stored(k[b, s, h, dd], KV)
                    pages[page, 1, h, pos % P, dd] = stored(v[b, s, h, dd], KV)

    return symbol, f.with_attr("global_symbol", symbol)


def rotary_kernel(kind: BlockKind) -> tuple[str, tvm.tirx.PrimFunc]:
    """RotaryQKV over any number of tokens (decode variants and folded prefill kinds): per token, thread
    blocks of 128 threads over the fused projection's row, four values (two (x[2i], x[2i+1]) pairs) per
    thread; q and k heads are rotated, v heads copied. q, k and v come out as [tokens, heads, head_dim].
    (One 64-thread block per (token, head) with a pair each took 24 us for 512 tokens of the 3B shape.)"""
    c = kind.config
    H, HKV, D = c.heads, c.kv_heads, c.head_dim
    W, HALF = (H + 2 * HKV) * D, D // 2
    NT = 128
    blocks = (W // 4 + NT - 1) // NT  # per token
    symbol = f"jl_gpu_rotary_qkv_h{H}_kv{HKV}_d{D}"

    @T.prim_func
    def f(qkv_h: T.handle, cos_h: T.handle, sin_h: T.handle, q_h: T.handle, k_h: T.handle, v_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        M = T.int64()
        qkv = T.match_buffer(qkv_h, (M, W), "float32")
        cos = T.match_buffer(cos_h, (M, HALF), "float32")
        sin = T.match_buffer(sin_h, (M, HALF), "float32")
        q = T.match_buffer(q_h, (M, H, D), "float32")
        k = T.match_buffer(k_h, (M, HKV, D), "float32")
        v = T.match_buffer(v_h, (M, HKV, D), "float32")
        for mb in T.thread_binding(M * blocks, thread="blockIdx.x"):
            for t in T.thread_binding(T.int64(NT), thread="threadIdx.x"):
                x = T.alloc_buffer((4,), "float32", scope="local")
                y = T.alloc_buffer((4,), "float32", scope="local")
                cs = T.alloc_buffer((2,), "float32", scope="local")
                sn = T.alloc_buffer((2,), "float32", scope="local")
                m: T.let = mb // blocks
                e: T.let = mb % blocks * NT + t  # four values e*4 .. e*4 + 3 of the row
                h: T.let = e * 4 // D
                d: T.let = e * 4 % D
                if e < W // 4:
                    for j in T.vectorized(4):
                        x[j] = qkv[m, e * 4 + j]
                    if h < H + HKV:
                        for j in T.vectorized(2):
                            cs[j] = cos[m, d // 2 + j]
                        for j in T.vectorized(2):
                            sn[j] = sin[m, d // 2 + j]
                        for j in T.serial(2):
                            y[2 * j] = x[2 * j] * cs[j] - x[2 * j + 1] * sn[j]
                            y[2 * j + 1] = x[2 * j] * sn[j] + x[2 * j + 1] * cs[j]
                        if h < H:
                            for j in T.vectorized(4):
                                q[m, h, d + j] = y[j]
                        else:
                            for j in T.vectorized(4):
                                k[m, h - H, d + j] = y[j]
                    else:
                        for j in T.vectorized(4):
                            v[m, h - H - HKV, d + j] = x[j]

    return symbol, f.with_attr("global_symbol", symbol)


def embedding_kernel(wtype: str, vocab: int, hidden: int) -> tuple[str, tvm.tirx.PrimFunc]:
    """ids [1, n] (int32) -> x [1, n, hidden] (f32): the rows of a [vocab, hidden] table in the row-group
    layout (jitllm.core.layouts.weight_parts; parameters ids, the parts, x), dequantized as
    jitllm.core.quant.dequantize_rows does on the host."""
    symbol = f"jl_gpu_embedding_{wtype}_{vocab}x{hidden}"
    if wtype in WIDE_TYPES:
        from jitllm.lowering.kernels.cuda.wide import wide_embedding_kernel

        return symbol, wide_embedding_kernel(wtype, vocab, hidden).with_attr("global_symbol", symbol)
    parts = weight_parts(wtype, vocab, hidden)
    (_, qshape, qdtype), NB = parts[0], hidden // QUANT_BLOCK
    G, K, NT_E = vocab // R, hidden, 128
    CB = (hidden + NT_E - 1) // NT_E  # thread blocks per row

    @T.prim_func
    def f(ids_h: T.handle, q: T.Buffer(qshape, qdtype), d: T.Buffer((G, NB, R), "float16"),
          mn: T.Buffer((G, NB, R), "float16"), x_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        n = T.int64()
        ids = T.match_buffer(ids_h, (1, n), "int32")
        x = T.match_buffer(x_h, (1, n, K), "float32")
        for bx in T.thread_binding(n * CB, thread="blockIdx.x"):
            for t in T.thread_binding(T.int64(NT_E), thread="threadIdx.x"):
                tok: T.let = bx // CB
                c: T.let = bx % CB * NT_E + t
                g: T.let = ids[0, tok] // R
                lane: T.let = ids[0, tok] % R
                if c < K:
                    if wtype == "f32" or wtype == "f16" or wtype == "bf16":
                        x[0, tok, c] = float_weight(wtype, q[g, c, lane])
                    elif wtype == "q8_0":
                        x[0, tok, c] = T.Cast("float32", d[g, c // 32, lane]) * T.Cast("float32", q[g, c // 32, c % 32, lane])
                    else:
                        nib: T.let = T.Cast("float32", T.bitwise_and(T.shift_right(
                            q[g, c // 32, c % 16, lane], T.Cast("uint8", c % 32 // 16 * 4)), T.uint8(15)))
                        if wtype == "q4_1":
                            x[0, tok, c] = T.Cast("float32", d[g, c // 32, lane]) * nib + T.Cast("float32", mn[g, c // 32, lane])
                        else:
                            x[0, tok, c] = T.Cast("float32", d[g, c // 32, lane]) * (nib - T.float32(8))

    return symbol, without_params(f, absent_weight_params(wtype)).with_attr("global_symbol", symbol)


ARGMAX_THREADS = 1024
ARGMAX_BATCH = 8  # vector loads each thread has in flight


@T.macro
def _keep_first_largest(best, at, value, index):
    """(best, at) <- (value, index) where value is larger, or equal at a smaller index."""
    if value > best[0] or (value == best[0] and index < at[0]):
        best[0] = value
        at[0] = index


@T.macro
def _warp_argmax(best, at):
    for m in T.unroll(5):
        other: T.let = shfl_xor(best[0], 16 >> m)
        other_at: T.let = shfl_xor(at[0], 16 >> m, "int32")
        _keep_first_largest(best, at, other, other_at)


def argmax_kernel(vocab: int, dependent: bool = False) -> tuple[str, tvm.tirx.PrimFunc]:
    """(logits [1, 1, vocab] f32, token [1] int32): the index of the first largest logit, as numpy's argmax
    (NaNs aside: they never win here). One thread block: the logits just left the head's matvec, so they
    are read from L2, 16 bytes per load and ARGMAX_BATCH loads in flight per thread; each thread keeps the
    first largest of its strided share (its indices only grow), then the warps' meet by shuffles (on
    ties the smaller index) and the block's through shared memory. `dependent`: launched dependent."""
    V = vocab
    VEC = 4 if V % 4 == 0 else 1
    NT, B = ARGMAX_THREADS, ARGMAX_BATCH
    N = V // VEC
    ROUNDS = (N + NT * B - 1) // (NT * B)
    symbol = f"jl_gpu_argmax_{V}"

    @T.prim_func
    def f(logits: T.Buffer((1, 1, V), "float32"), token: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        for b in T.thread_binding(1, thread="blockIdx.x"):
            for t in T.thread_binding(NT, thread="threadIdx.x"):
                vals = T.alloc_buffer((B * VEC,), "float32", scope="local")
                best = T.alloc_buffer((1,), "float32", scope="local")
                at = T.alloc_buffer((1,), "int32", scope="local")
                warp_best = T.alloc_buffer((NT // 32,), "float32", scope="shared")
                warp_at = T.alloc_buffer((NT // 32,), "int32", scope="shared")
                await_previous_kernel(dependent)
                best[0] = T.float32("-inf")
                at[0] = V
                for r in T.serial(ROUNDS):
                    for u in T.unroll(B):
                        for e in T.vectorized(VEC):
                            vals[u * VEC + e] = logits[0, 0, T.min((r * B + u) * NT + t, N - 1) * VEC + e]
                    for u in T.unroll(B):
                        v: T.let = (r * B + u) * NT + t
                        for e in T.unroll(VEC):
                            if v < N and vals[u * VEC + e] > best[0]:  # (a thread's indices only grow)
                                best[0] = vals[u * VEC + e]
                                at[0] = v * VEC + e
                _warp_argmax(best, at)
                if t % 32 == 0:
                    warp_best[t // 32] = best[0]
                    warp_at[t // 32] = at[0]
                T.tvm_storage_sync("shared")
                if t < 32:
                    best[0] = warp_best[t]
                    at[0] = warp_at[t]
                    _warp_argmax(best, at)
                    if t == 0:
                        token[0] = T.Select(at[0] == V, 0, at[0])  # every logit -inf or NaN: index 0

    return symbol, dependent_launch(f, dependent).with_attr("global_symbol", symbol)
