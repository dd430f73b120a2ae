"""jitllm's custom ONNX operators, each defined as a model-local ONNX function.

The function bodies are the *reference semantics*, written in standard ONNX ops so ONNX Runtime can run
the very graph we compile. The TVM lowering never uses the bodies: it replaces each call by a
hand-written TIR kernel (jitllm/lowering/kernels_*.py) that reads the quantized weights and the paged
KV pool directly.

- `Linear_<wtype>(x[.., K], *parts) -> y[.., N]`: y = x @ W.T, W dequantized from the layout in core/layouts.py.
- `PagedAttention(q[B,S,H,D], k[B,S,Hkv,D], v, pages[NP,2,Hkv,P,D], page_table[B,MP] i32, past[B] i32)`:
  causal attention of the S new tokens over the `past` positions held in the pages listed by the page
  table, followed by the new tokens themselves. It does not write the pool: appending k/v is a separate
  kernel run after the block. The pool holds f32, f16 or q8_0 rows (BlockKind.kv_type; pages[.., row],
  jitllm.ir.kv_quant's layout): history is read as f32 (q8_0: each quant times its block's f16 scale), the
  new tokens are attended at f32 (as every kernel does: they are rounded only when appended).
- `RaggedPagedAttention(q[1,T,H,D], k[1,T,Hkv,D], v, pages, page_table[B,MP] i32, past[B] i32,
  seq_starts[B+1] i32)`: the rows of B sequences in one batch (batched steps): sequence b's new tokens are
  rows seq_starts[b] .. seq_starts[b+1]-1, at positions past[b] ..; each row attends causally over its own
  sequence's `past[b]` paged positions and its earlier new rows, exactly as PagedAttention would for that
  sequence alone. It does not write the pool either.
- `GatedRecurrence(q[B,S,H,D], k, v, a, state[B,H,D,D]) -> (out[B,S,H,D], state_out)`: per head a
  D x D state folded over the S tokens in order, S_t = diag(a_t) S_{t-1} + k_t^T v_t, out_t = q_t S_t
  (gated linear attention; `a` in (0, 1) is the per-key-dimension decay). The TVM lowering updates
  `state` in place and returns it as `state_out`.

- `MoeSwiGLU_<gate wtype>_<up wtype>_<down wtype>(h[.., K], ids[.., k] i64, weights[.., k], *gate parts,
  *up parts, *down parts) -> y[.., K]`: routed SwiGLU experts, y = sum_j weights_j * down_e(silu(gate_e h) *
  up_e h) with e = ids_j. The experts' matrices are stacked along their rows (gate, up: [E * F, K]; down:
  [E * K, F]), so E and F come from the parts' shapes. The reference computes every expert for every
  token and keeps the routed ones; the kernels read only the experts some token was routed to.
- `MoeSwiGLUSlots_<gate wtype>_<up wtype>_<down wtype>(h, ids, weights, slot_map[E] i64, *parts)`: MoeSwiGLU
  over a device's expert cache: the parts stack the experts of the cache's slots, and expert e's matrices
  are those of slot slot_map[e] (experts no token picked may map anywhere). Kernels walk the experts in
  id order as MoeSwiGLU's do, so a token's sum is added up in the same order as the resident block's.

Decode variants (BlockKind.decode) fold the small ops around each linear into it, so a GPU target runs
one kernel where there were three or four (each GPU kernel costs a few µs however small; DESIGN.md §3);
targets without fused kernels lower them as their parts:
- `RmsNormLinear_<wtype>(x, norm_weight, eps, *parts)`: Linear(x / sqrt(mean(x²) + eps) * norm_weight).
- `LinearAdd_<wtype>(x, residual, *parts)`: Linear(x) + residual.
- `SwiGLULinearAdd_<wtype>(gate_up, residual, *parts)`: Linear(silu(gate) * up) + residual, where gate and
  up are the two halves of gate_up's last axis.
- `RotaryQKV(qkv[B,S,(H+2Hkv)*D], cos[B,S,D/2], sin, split[3] i64) -> q[B,S,H,D], k, v`: the fused
  projection split into q, k, v (sizes `split`), with interleaved-pair rotary embedding on q and k.
- `RotaryPagedAttention(qkv, cos, sin, split, pages, page_table, past) -> out, k, v`: RotaryQKV, then
  PagedAttention of its q, k, v (decode variants: a GPU's decode attention kernel rotates q and the new k
  as it reads them, so the step has no rotary kernel of its own).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from jitllm.core.layouts import WEIGHT_TYPES
from jitllm.ir.dequant import dequantize
from jitllm.ir.graph import DOMAIN, DTYPES, F32, OPSET, GraphBuilder
from jitllm.ir.kv_quant import Q8_BLOCK, QUANTIZED

if TYPE_CHECKING:
    import onnx

PAGED_ATTENTION = "PagedAttention"
RAGGED_ATTENTION = "RaggedPagedAttention"
GATED_RECURRENCE = "GatedRecurrence"
ROTARY_QKV = "RotaryQKV"
ROTARY_ATTENTION = "RotaryPagedAttention"
LINEAR = "Linear"
NORM_LINEAR = "RmsNormLinear"
LINEAR_ADD = "LinearAdd"
SWIGLU_LINEAR_ADD = "SwiGLULinearAdd"
MOE_SWIGLU = "MoeSwiGLU"
MOE_SWIGLU_SLOTS = "MoeSwiGLUSlots"
LINEAR_FAMILIES = (LINEAR, NORM_LINEAR, LINEAR_ADD, SWIGLU_LINEAR_ADD)
"""Ops that end in a linear layer; each is one op per weight type, named `<family>_<wtype>`."""
EXTRA_INPUTS = {LINEAR: [], NORM_LINEAR: ["norm_weight", "eps"], LINEAR_ADD: ["residual"],
                SWIGLU_LINEAR_ADD: ["residual"]}
"""Inputs of each linear family between x and the weight parts."""


def linear_op(wtype: str, family: str = LINEAR) -> str:
    return f"{family}_{wtype}"


def split_linear_op(op_type: str) -> tuple[str, str] | None:
    """(family, wtype) of a linear-family op name, else None."""
    for family in LINEAR_FAMILIES:
        if op_type.startswith(family + "_"):
            return family, op_type[len(family) + 1:]
    return None


def moe_op(wtypes: tuple[str, str, str], slots: bool = False) -> str:
    """The routed-experts op of gate, up and down weight types (`slots`: over an expert cache's slots)."""
    return "_".join((MOE_SWIGLU_SLOTS if slots else MOE_SWIGLU, *wtypes))


_MOE_OPS = {moe_op(types, slots): (types, slots) for types in itertools.product(WEIGHT_TYPES, repeat=3)
            for slots in (False, True)}
"""Op name -> (weight types, over slots) (the names cannot be split at underscores: q4_0 holds one)."""


def split_moe_op(op_type: str) -> tuple[str, str, str] | None:
    """(gate, up, down) weight types of a routed-experts op name (either family), else None."""
    found = _MOE_OPS.get(op_type)
    return None if found is None else found[0]


def is_slots_op(op_type: str) -> bool:
    """Whether a routed-experts op name is MoeSwiGLUSlots (over an expert cache)."""
    return _MOE_OPS.get(op_type, (None, False))[1]


def moe_function(wtypes: tuple[str, str, str], counts: tuple[int, int, int]) -> onnx.FunctionProto:
    """The reference body: every expert on every token ([E, M, F] activations), then the routing weights
    scattered into a dense [M, E] matrix weigh their outputs."""
    from onnx import helper

    g = GraphBuilder("moe_")
    names = [[f"{which}{i}" for i in range(n)] for which, n in zip("gud", counts)]
    wg, wu, wd = (dequantize(g, w, parts) for w, parts in zip(wtypes, names))  # [E*F, K], [E*F, K], [E*K, F]
    k_dim = g.op("Shape", "h", start=-1)
    f_dim = g.op("Shape", wd, start=1, end=2)
    experts_fk = g.op("Concat", g.const([-1]), f_dim, k_dim, axis=0)
    experts_kf = g.op("Concat", g.const([-1]), k_dim, f_dim, axis=0)
    h = g.op("Reshape", "h", g.op("Concat", g.const([-1]), k_dim, axis=0))  # [M, K]

    def per_expert(w: str, shape: str) -> str:
        return g.op("Transpose", g.op("Reshape", w, shape), perm=[0, 2, 1])

    gate = g.op("MatMul", h, per_expert(wg, experts_fk))  # [E, M, F]
    up = g.op("MatMul", h, per_expert(wu, experts_fk))
    act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    out = g.op("Transpose", g.op("MatMul", act, per_expert(wd, experts_kf)), perm=[1, 0, 2])  # [M, E, K]
    top = g.op("Shape", "ids", start=-1)
    ids = g.op("Reshape", "ids", g.op("Concat", g.const([-1]), top, axis=0))  # [M, k]
    weights = g.op("Reshape", "weights", g.op("Concat", g.const([-1]), top, axis=0))
    rows = g.op("Shape", ids, start=0, end=1)
    experts = g.op("Shape", out, start=1, end=2)
    dense = g.op("ScatterElements", g.op("ConstantOfShape", g.op("Concat", rows, experts, axis=0),
                                         value=helper.make_tensor("zero", F32, [1], [0.0])),
                 ids, weights, axis=1)  # [M, E]
    y = g.op("ReduceSum", g.op("Mul", out, g.op("Unsqueeze", dense, g.const([-1]))), g.const([1]), keepdims=0)
    g.rename(g.op("Reshape", y, g.op("Shape", "h")), "y")
    return _function(moe_op(wtypes), ["h", "ids", "weights", *[n for group in names for n in group]], ["y"], g)


def moe_slots_function(wtypes: tuple[str, str, str], counts: tuple[int, int, int]) -> onnx.FunctionProto:
    """The reference body: each picked expert's slot looked up, then MoeSwiGLU over the slots' experts."""
    g = GraphBuilder("moes_")
    parts = [f"{which}{i}" for which, n in zip("gud", counts) for i in range(n)]
    y = g.op(moe_op(wtypes), "h", g.op("Gather", "slot_map", "ids", axis=0), "weights", *parts, domain=DOMAIN)
    g.rename(y, "y")
    return _function(moe_op(wtypes, True), ["h", "ids", "weights", "slot_map", *parts], ["y"], g)


def rms_norm(g: GraphBuilder, x: str, weight: str, eps: str) -> str:
    """x / sqrt(mean(x²) + eps) * weight over the last axis (`eps`: a float32 scalar value)."""
    mean = g.op("ReduceMean", g.op("Mul", x, x), g.const([-1]), keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean, eps)))
    return g.op("Mul", g.op("Mul", x, inv), weight)


def _function(name: str, inputs: list[str], outputs: list[str], g: GraphBuilder) -> onnx.FunctionProto:
    from onnx import helper

    calls_ours = any(node.domain == DOMAIN for node in g.nodes)  # a function calling jitllm's functions
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(DOMAIN, 1)] if calls_ours else [])
    return helper.make_function(DOMAIN, name, inputs, outputs, g.nodes, opset_imports=opsets)


def linear_function(wtype: str, num_parts: int, family: str = LINEAR) -> onnx.FunctionProto:
    g = GraphBuilder("lin_")
    parts = [f"p{i}" for i in range(num_parts)]
    x = "x"
    if family == NORM_LINEAR:
        x = rms_norm(g, x, "norm_weight", "eps")
    elif family == SWIGLU_LINEAR_ADD:
        gate, up = g.op("Split", x, outputs=2, axis=-1, num_outputs=2)
        x = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    w = dequantize(g, wtype, parts)
    y = g.op("MatMul", x, g.op("Transpose", w, perm=[1, 0]))
    if family in (LINEAR_ADD, SWIGLU_LINEAR_ADD):
        y = g.op("Add", y, "residual")
    g.rename(y, "y")
    return _function(linear_op(wtype, family), ["x", *EXTRA_INPUTS[family], *parts], ["y"], g)


def rotary_qkv_function() -> onnx.FunctionProto:
    g = GraphBuilder("rot_")
    q, k, v = g.op("Split", "qkv", "split", axis=-1, outputs=3)
    half = g.op("Shape", "cos", start=2)  # [D/2]
    head_dim = g.op("Mul", half, g.const([2]))
    heads_shape = g.op("Concat", g.const([0, 0, -1]), head_dim, axis=0)
    cos = g.op("Unsqueeze", "cos", g.const([2, 4]))  # [B, S, 1, D/2, 1]
    sin = g.op("Unsqueeze", "sin", g.const([2, 4]))

    def rope(x: str) -> str:
        pairs = g.op("Reshape", x, g.op("Concat", g.const([0, 0, -1]), half, g.const([2]), axis=0))
        x0, x1 = g.op("Split", pairs, g.const([1, 1]), axis=-1, outputs=2)
        out0 = g.op("Sub", g.op("Mul", x0, cos), g.op("Mul", x1, sin))
        out1 = g.op("Add", g.op("Mul", x0, sin), g.op("Mul", x1, cos))
        return g.op("Reshape", g.op("Concat", out0, out1, axis=-1), heads_shape)

    g.rename(rope(q), "q")
    g.rename(rope(k), "k")
    g.rename(g.op("Reshape", v, heads_shape), "v")
    return _function(ROTARY_QKV, ["qkv", "cos", "sin", "split"], ["q", "k", "v"], g)


def rotary_attention_function() -> onnx.FunctionProto:
    g = GraphBuilder("ra_")
    q, k, v = g.op(ROTARY_QKV, "qkv", "cos", "sin", "split", outputs=3, domain=DOMAIN)
    g.rename(g.op(PAGED_ATTENTION, q, k, v, "pages", "page_table", "past", domain=DOMAIN), "out")
    g.rename(k, "k")
    g.rename(v, "v")
    return _function(ROTARY_ATTENTION, ["qkv", "cos", "sin", "split", "pages", "page_table", "past"],
                     ["out", "k", "v"], g)


def _pool_values(g: GraphBuilder, gathered: str, kv_type: str) -> str:
    """Rows gathered from the pool, [., MP, 2, Hkv, P, row], as f32 values [., MP, 2, Hkv, P, D]: cast from
    f32 or f16; q8_0's quants times their block's scale, the scale's f16 bits decoded arithmetically (ONNX
    has no bitcast): (1024 + mantissa) * 2^(exponent - 25), subnormals mantissa * 2^-24."""
    f32, i32 = F32, DTYPES["int32"]
    if kv_type not in QUANTIZED:
        return g.op("Cast", gathered, to=f32)
    width = g.op("Shape", gathered, start=5)  # [1]: D + 2 D / 32
    d_dim = g.op("Div", g.op("Mul", width, g.const([Q8_BLOCK])), g.const([Q8_BLOCK + 2]))
    last = g.const([5])
    quants = g.op("Cast", g.op("Slice", gathered, g.const([0]), d_dim, last), to=f32)
    raw = g.op("Cast", g.op("Slice", gathered, d_dim, width, last), to=i32)
    unsigned = g.op("Mod", g.op("Add", raw, g.const(256, "int32")), g.const(256, "int32"))
    pairs = g.op("Reshape", unsigned, g.const([0, 0, 0, 0, 0, -1, 2]))  # little-endian f16 bytes
    bits = g.op("Add", g.op("Gather", pairs, g.const(0), axis=6),
                g.op("Mul", g.op("Gather", pairs, g.const(1), axis=6), g.const(256, "int32")))
    exponent = g.op("Mod", g.op("Div", bits, g.const(1024, "int32")), g.const(32, "int32"))
    mantissa = g.op("Cast", g.op("Mod", bits, g.const(1024, "int32")), to=f32)
    normal = g.op("Mul", g.op("Add", mantissa, g.const(1024.0, "float32")),
                  g.op("Pow", g.const(2.0, "float32"),
                       g.op("Sub", g.op("Cast", exponent, to=f32), g.const(25.0, "float32"))))
    magnitude = g.op("Where", g.op("Equal", exponent, g.const(0, "int32")),
                     g.op("Mul", mantissa, g.const(2.0 ** -24, "float32")), normal)
    scale = g.op("Where", g.op("GreaterOrEqual", bits, g.const(32768, "int32")), g.op("Neg", magnitude), magnitude)
    blocks = g.op("Reshape", quants, g.const([0, 0, 0, 0, 0, -1, Q8_BLOCK]))
    values = g.op("Mul", blocks, g.op("Unsqueeze", scale, g.const([6])))
    return g.op("Reshape", values, g.op("Concat", g.op("Shape", gathered, end=5), d_dim, axis=0))


def paged_attention_function(kv_type: str = "f32") -> onnx.FunctionProto:
    g = GraphBuilder("att_")
    i64 = DTYPES["int64"]
    f32 = F32
    # History gathered from the pool: [B, MP, 2, Hkv, P, D] -> K/V [B, Hkv, MP*P, D].
    hist = _pool_values(g, g.op("Gather", "pages", "page_table", axis=0), kv_type)
    hist = g.op("Transpose", hist, perm=[0, 2, 3, 1, 4, 5])
    d_dim = g.op("Shape", "q", start=3)
    hist = g.op("Reshape", hist, g.op("Concat", g.const([0, 0, 0, -1]), d_dim, axis=0))
    kh = g.op("Gather", hist, g.const(0), axis=1)
    vh = g.op("Gather", hist, g.const(1), axis=1)
    k_all = g.op("Concat", kh, g.op("Transpose", "k", perm=[0, 2, 1, 3]), axis=2)  # [B, Hkv, T, D]
    v_all = g.op("Concat", vh, g.op("Transpose", "v", perm=[0, 2, 1, 3]), axis=2)
    # Queries grouped by KV head: [B, Hkv, g, S, D].
    hkv = g.op("Shape", "k", start=2, end=3)
    s_len = g.op("Shape", "q", start=1, end=2)
    qt = g.op("Transpose", "q", perm=[0, 2, 1, 3])
    qg = g.op("Reshape", qt, g.op("Concat", g.const([0]), hkv, g.const([-1]), s_len, d_dim, axis=0))
    kt = g.op("Unsqueeze", g.op("Transpose", k_all, perm=[0, 1, 3, 2]), g.const([2]))
    scale = g.op("Sqrt", g.op("Cast", d_dim, to=f32))
    scores = g.op("Div", g.op("MatMul", qg, kt), scale)  # [B, Hkv, g, S, T]
    # Mask: history position j is visible if j < past[b]; new token j' if j' <= s.
    hist_len = g.op("Shape", kh, start=2, end=3)  # MP*P
    zero, one = g.const(0), g.const(1)
    squeeze0 = g.const([0])
    t_len = g.op("Add", hist_len, s_len)
    jpos = g.op("Range", zero, g.op("Squeeze", t_len, squeeze0), one)  # [T]
    spos = g.op("Range", zero, g.op("Squeeze", s_len, squeeze0), one)  # [S]
    past = g.op("Unsqueeze", g.op("Cast", "past", to=i64), g.const([1]))  # [B, 1]
    vis_hist = g.op("Less", g.op("Unsqueeze", jpos, g.const([0])), past)  # [B, T]
    rel = g.op("Sub", jpos, hist_len)  # [T]
    vis_new = g.op(
        "And",
        g.op("GreaterOrEqual", rel, zero),
        g.op("LessOrEqual", g.op("Unsqueeze", rel, g.const([0])), g.op("Unsqueeze", spos, g.const([1]))),
    )  # [S, T]
    mask = g.op("Or", g.op("Unsqueeze", vis_hist, g.const([1])), g.op("Unsqueeze", vis_new, g.const([0])))
    mask = g.op("Unsqueeze", mask, g.const([1, 2]))  # [B, 1, 1, S, T]
    scores = g.op("Where", mask, scores, g.const(-1e30, "float32"))
    probs = g.op("Softmax", scores, axis=-1)
    # values no query sees are zeroed, not only weighted by 0: a page's unused slots hold whatever the pool
    # held (0 * NaN is NaN)
    seen = g.op("Or", vis_hist, g.op("GreaterOrEqual", g.op("Unsqueeze", rel, g.const([0])), zero))  # [B, T]
    v_seen = g.op("Where", g.op("Unsqueeze", seen, g.const([1, 3])), v_all, g.const(0.0, "float32"))
    out = g.op("MatMul", probs, g.op("Unsqueeze", v_seen, g.const([2])))  # [B, Hkv, g, S, D]
    out = g.op("Reshape", out, g.op("Concat", g.const([0, -1]), s_len, d_dim, axis=0))  # [B, H, S, D]
    g.rename(g.op("Transpose", out, perm=[0, 2, 1, 3]), "out")
    return _function(PAGED_ATTENTION, ["q", "k", "v", "pages", "page_table", "past"], ["out"], g)


def ragged_attention_function(kv_type: str = "f32") -> onnx.FunctionProto:
    """Each row as a query of its own, over the pages of its sequence's table and over the new rows of its
    sequence up to itself (masks from the row -> sequence map that seq_starts gives)."""
    g = GraphBuilder("rag_")
    i64 = DTYPES["int64"]
    f32 = F32
    zero, one = g.const(0), g.const(1)
    d_dim = g.op("Shape", "q", start=3)
    t_len = g.op("Shape", "q", start=1, end=2)  # [1]: T
    rows = g.op("Range", zero, g.op("Squeeze", t_len, g.const([0])), one)  # [T]
    starts = g.op("Cast", "seq_starts", to=i64)
    ends = g.op("Slice", starts, g.const([1]), g.const([1 << 62]))  # [B]
    # the sequence of each row: how many sequences end at or before it
    seq = g.op("ReduceSum", g.op("Cast", g.op("LessOrEqual", g.op("Unsqueeze", ends, g.const([0])),
                                               g.op("Unsqueeze", rows, g.const([1]))), to=i64),
               g.const([1]), keepdims=0)  # [T]
    # history per row: [T, MP, 2, Hkv, P, D] -> K/V [T, Hkv, MP*P, D]
    hist = _pool_values(g, g.op("Gather", "pages", g.op("Gather", "page_table", seq, axis=0), axis=0), kv_type)
    hist = g.op("Transpose", hist, perm=[0, 2, 3, 1, 4, 5])
    hist = g.op("Reshape", hist, g.op("Concat", g.const([0, 0, 0, -1]), d_dim, axis=0))
    kh = g.op("Gather", hist, g.const(0), axis=1)
    vh = g.op("Gather", hist, g.const(1), axis=1)
    hist_len = g.op("Shape", kh, start=2, end=3)
    q = g.op("Squeeze", "q", g.const([0]))  # [T, H, D]
    hkv = g.op("Shape", "k", start=2, end=3)
    qg = g.op("Reshape", q, g.op("Concat", t_len, hkv, g.const([-1]), d_dim, axis=0))  # [T, Hkv, g, D]
    scale = g.op("Sqrt", g.op("Cast", d_dim, to=f32))
    s_hist = g.op("Div", g.op("MatMul", qg, g.op("Transpose", kh, perm=[0, 1, 3, 2])), scale)  # [T, Hkv, g, L]
    kn = g.op("Transpose", g.op("Squeeze", "k", g.const([0])), perm=[1, 2, 0])  # [Hkv, D, T]
    vn = g.op("Transpose", g.op("Squeeze", "v", g.const([0])), perm=[1, 0, 2])  # [Hkv, T, D]
    s_new = g.op("Div", g.op("MatMul", qg, g.op("Unsqueeze", kn, g.const([0]))), scale)  # [T, Hkv, g, T]
    past = g.op("Cast", g.op("Gather", "past", seq, axis=0), to=i64)  # [T]
    jpos = g.op("Range", zero, g.op("Squeeze", hist_len, g.const([0])), one)  # [L]
    vis_hist = g.op("Less", g.op("Unsqueeze", jpos, g.const([0])), g.op("Unsqueeze", past, g.const([1])))  # [T, L]
    same = g.op("Equal", g.op("Unsqueeze", seq, g.const([1])), g.op("Unsqueeze", seq, g.const([0])))  # [T, T]
    causal = g.op("LessOrEqual", g.op("Unsqueeze", rows, g.const([0])), g.op("Unsqueeze", rows, g.const([1])))
    vis_new = g.op("And", same, causal)
    mask = g.op("Unsqueeze", g.op("Concat", vis_hist, vis_new, axis=1), g.const([1, 2]))  # [T, 1, 1, L + T]
    scores = g.op("Where", mask, g.op("Concat", s_hist, s_new, axis=-1), g.const(-1e30, "float32"))
    probs = g.op("Softmax", scores, axis=-1)
    p_hist, p_new = g.op("Split", probs, g.op("Concat", hist_len, t_len, axis=0), axis=-1, outputs=2)
    # history slots no row sees are zeroed, not only weighted by 0 (a page's unused slots may hold NaN)
    v_seen = g.op("Where", g.op("Unsqueeze", vis_hist, g.const([1, 3])), vh, g.const(0.0, "float32"))
    out = g.op("Add", g.op("MatMul", p_hist, v_seen), g.op("MatMul", p_new, g.op("Unsqueeze", vn, g.const([0]))))
    out = g.op("Reshape", out, g.op("Concat", g.const([1]), t_len, g.const([-1]), d_dim, axis=0))  # [1, T, H, D]
    g.rename(out, "out")
    return _function(RAGGED_ATTENTION, ["q", "k", "v", "pages", "page_table", "past", "seq_starts"], ["out"], g)


def gated_recurrence_function() -> onnx.FunctionProto:
    """The recurrence as an ONNX Scan over the sequence axis: one step's body per token."""
    from onnx import helper

    f32 = F32
    body = GraphBuilder("rec_")
    last, second = body.const([-1]), body.const([-2])
    decayed = body.op("Mul", body.op("Unsqueeze", "a_t", last), "s_in")  # [B, H, D, D] rows scaled by a
    s_new = body.op("Add", decayed, body.op("Mul", body.op("Unsqueeze", "k_t", last), body.op("Unsqueeze", "v_t", second)))
    o_t = body.op("Squeeze", body.op("MatMul", body.op("Unsqueeze", "q_t", second), s_new), second)
    body.rename(s_new, "s_out")
    body.rename(o_t, "o_t")
    step = helper.make_graph(
        body.nodes, "gated_recurrence_step",
        [helper.make_tensor_value_info(n, f32, None) for n in ("s_in", "q_t", "k_t", "v_t", "a_t")],
        [helper.make_tensor_value_info(n, f32, None) for n in ("s_out", "o_t")],
    )
    g = GraphBuilder("gr_")
    state, out = g.op("Scan", "state", "q", "k", "v", "a", outputs=2, body=step, num_scan_inputs=4,
                      scan_input_axes=[1, 1, 1, 1], scan_output_axes=[1])
    g.rename(out, "out")
    g.rename(state, "state_out")
    return _function(GATED_RECURRENCE, ["q", "k", "v", "a", "state"], ["out", "state_out"], g)


def functions_for(nodes: list[onnx.NodeProto], kv_type: str = "f32") -> list[onnx.FunctionProto]:
    """The model-local functions that a graph's jitllm-domain nodes call, one per op type (the attention
    ones reading a pool of `kv_type`)."""
    from jitllm.core.layouts import ROW_GROUP, SUPER_BLOCK, weight_parts

    others = {PAGED_ATTENTION: lambda: paged_attention_function(kv_type),
              RAGGED_ATTENTION: lambda: ragged_attention_function(kv_type),
              GATED_RECURRENCE: gated_recurrence_function,
              ROTARY_QKV: rotary_qkv_function, ROTARY_ATTENTION: rotary_attention_function}
    functions: dict[str, onnx.FunctionProto] = {}
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if node.domain != DOMAIN or node.op_type in functions:
            continue
        linear, experts = split_linear_op(node.op_type), split_moe_op(node.op_type)
        if experts:
            counts = tuple(len(weight_parts(w, ROW_GROUP, SUPER_BLOCK)) for w in experts)
            slots = is_slots_op(node.op_type)
            functions[node.op_type] = (moe_slots_function if slots else moe_function)(experts, counts)
            pending += functions[node.op_type].node  # (the slots' body calls MoeSwiGLU)
        elif linear:
            family, wtype = linear
            functions[node.op_type] = linear_function(wtype, len(weight_parts(wtype, ROW_GROUP, SUPER_BLOCK)), family)
        else:
            functions[node.op_type] = others[node.op_type]()
            pending += functions[node.op_type].node  # a function calling others (RotaryPagedAttention)
    return list(functions.values())
