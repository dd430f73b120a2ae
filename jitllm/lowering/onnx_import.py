"""ONNX block graph -> TVM Relax IRModule, with jitllm's custom ops lowered to our TIR kernels.

TVM's ONNX importer knows nothing of jitllm's functions; for the duration of one import we extend its
converter table so each `Linear_<wtype>` / `PagedAttention` call becomes a `call_tir` of a kernel from
kernels/cpu/linear.py / kernels/cpu/attention.py (the ONNX function bodies are only the reference semantics).
The folded decode ops (`RmsNormLinear_<wtype>`, `LinearAdd_…`, `SwiGLULinearAdd_…`, `RotaryQKV`,
`RotaryPagedAttention`) become one kernel on targets that have one (`folded_linear_kernel`, `rotary_kernel`,
`split_attention_kernel`) and their parts elsewhere.
The KV append kernel is added beside `main` and called by the runtime after each block step (a ragged
variant's appends each sequence's rows at its own positions: RaggedPagedAttention's batched steps), and on
targets that have one an embedding row gather beside a head's `main` (the runtime's prompt lookup where
the head is tied).
The kernels come from the target (`linear_kernel`, `attention_kernel`, `append_kernel`), so each
target brings kernels written for its hardware while the graph stays the same.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from jitllm.core.errors import JitllmError
from jitllm.core.layouts import ROW_GROUP, WEIGHT_TYPES
from jitllm.ir.block_type import KV_PAGES, RECURRENT
from jitllm.ir.blocks import block_type
from jitllm.ir.config import BlockKind
from jitllm.ir.moe import MOE_EXPERTS
from jitllm.ir.ops import (
    EXTRA_INPUTS,
    GATED_RECURRENCE,
    LINEAR,
    LINEAR_ADD,
    LINEAR_FAMILIES,
    NORM_LINEAR,
    PAGED_ATTENTION,
    RAGGED_ATTENTION,
    ROTARY_ATTENTION,
    ROTARY_QKV,
    SWIGLU_LINEAR_ADD,
    is_slots_op,
    linear_op,
    split_moe_op,
)
from jitllm.lowering import APPEND_FUNCTION, ARGMAX_FUNCTION, EMBED_FUNCTION

_PATCH_LOCK = threading.Lock()


def _add_kernel(bb: relax.BlockBuilder, symbol: str, func: tvm.tirx.PrimFunc) -> relax.GlobalVar:
    mod = bb.get()
    for gv in mod.get_global_vars():
        if gv.name_hint == symbol:
            return gv
    return bb.add_func(func, symbol)


def _converter(impl) -> type:
    """A converter class for TVM's ONNX frontend, which calls `get_converter(opset)(bb, inputs, attr, params)`."""
    return type(impl.__name__, (), {"get_converter": classmethod(lambda cls, opset: impl)})


def _rows(x: relax.Expr) -> tuple[list, object]:
    """x's leading dims and their product (an int where static)."""
    lead = list(x.ty.shape.values)[:-1]
    m = 1
    for dim in lead:
        m = m * (int(dim) if isinstance(dim, tvm.tirx.IntImm) else dim)
    return lead, m


def _static_shape(param) -> list[int]:
    return [int(d) for d in param.shape]


def _call_kernel(bb: relax.BlockBuilder, symbol: str, func: tvm.tirx.PrimFunc, args: list[relax.Expr]) -> relax.Expr:
    """call_tir of a kernel with static shapes: each argument reshaped to the kernel's own buffer shape
    where it differs (a view, no copy), but not one the kernel reads as wider elements (WGSL's quant bytes
    as words: fewer of them, and the runtime binds the bytes as they are); the parameters after the
    arguments are its float32 outputs."""
    def same_count(p, a) -> bool:
        return int(np.prod(_static_shape(p))) == int(np.prod([int(d) for d in a.ty.shape.values]))

    shaped = [a if _static_shape(p) == [int(d) for d in a.ty.shape.values] or not same_count(p, a) else
              bb.emit(relax.op.reshape(a, _static_shape(p))) for p, a in zip(func.params, args)]
    outs = [relax.TensorType(_static_shape(p), "float32") for p in func.params[len(args):]]
    return bb.emit(relax.call_tir(_add_kernel(bb, symbol, func), shaped, outs[0] if len(outs) == 1 else outs))


def _plain_linear(bb, target, wtype: str, x: relax.Expr, parts: list[relax.Expr]) -> relax.Expr:
    lead, m = _rows(x)
    k = int(x.ty.shape.values[-1])
    n = int(parts[0].ty.shape.values[0]) * ROW_GROUP
    static_rows = {"rows": m} if isinstance(m, int) else {}  # only decode variants (GPU) have them
    symbol, func = target.linear_kernel(wtype, n, k, **static_rows)
    gv = _add_kernel(bb, symbol, func)
    # The kernel's own buffers say how it wants x and y laid out: [M, ...] with static trailing dims.
    x_buf, y_buf = func.params[0], func.params[-1]
    x2 = bb.emit(relax.op.reshape(x, [m, *[int(d) for d in x_buf.shape[1:]]]))
    y_type = relax.TensorType([m, *[int(d) for d in y_buf.shape[1:]]], "float32")
    y = bb.emit(relax.call_tir(gv, [x2, *parts], y_type))
    return bb.emit(relax.op.reshape(y, [*lead, n]))


def _prefill_linear(bb, target, family: str, wtype: str, x: relax.Expr, extras: list, parts: list, n: int,
                    eps: float) -> relax.Expr | None:
    """The target's folded kernels over any number of rows, with x and the residual as [M, ...]
    matrices: an operand pass then a GEMM (`prefill_gemm_kernels`; where it splits K, a kernel adding
    the splits' sums after it), or one kernel
    (`prefill_linear_kernel`); None where the target has neither for this family and shape."""
    lead, m = _rows(x)
    kx = int(x.ty.shape.values[-1])
    k = kx // 2 if family == SWIGLU_LINEAR_ADD else kx
    if isinstance(m, int):
        return None
    gemm_calls = target.prefill_gemm_kernels(family, wtype, n, k, eps)
    one = None if gemm_calls else target.prefill_linear_kernel(family, wtype, n, k, eps)
    if not (gemm_calls or one):
        return None
    x2 = bb.emit(relax.op.reshape(x, [m, kx]))
    residual = [bb.emit(relax.op.reshape(e, [m, n])) for e in extras] if family != NORM_LINEAR else []
    out = relax.TensorType([m, n], "float32")
    if gemm_calls:
        norm = [extras[0]] if family == NORM_LINEAR else []
        a = bb.emit(relax.call_tir(_add_kernel(bb, *gemm_calls.operand), [x2, *norm],
                                   relax.TensorType([m, k], "float16")))
        gemm = _add_kernel(bb, *gemm_calls.gemm)
        if gemm_calls.split_sum is None:
            y = bb.emit(relax.call_tir(gemm, [a, *parts, *residual], out))
        else:  # each K split's sums, then added (with the residual)
            sums = bb.emit(relax.call_tir(gemm, [a, *parts], relax.TensorType([gemm_calls.splits, m, n], "float32")))
            y = bb.emit(relax.call_tir(_add_kernel(bb, *gemm_calls.split_sum), [sums, *residual], out))
    else:
        args = [x2, extras[0], *parts] if family == NORM_LINEAR else [x2, *parts, *residual]
        y = bb.emit(relax.call_tir(_add_kernel(bb, *one), args, out))
    return relax.op.reshape(y, [*lead, n])


def _linear_converter(family: str, wtype: str, target):
    """A linear-family op: one folded kernel where the target has them (one-row decode steps; any row
    count where it has prefill ones), else the family's elementwise ops before the target's plain
    linear kernel (or its folded residual add) and after it."""
    def linear(bb, inputs, attr, params):
        x, *rest = [bb.normalize(i) for i in inputs]
        extra = len(EXTRA_INPUTS[family])
        extras, parts = rest[:extra], rest[extra:]
        eps = float(extras[1].value.numpy()) if family == NORM_LINEAR else 0.0
        lead, m = _rows(x)
        k = int(x.ty.shape.values[-1]) // (2 if family == SWIGLU_LINEAR_ADD else 1)
        n = int(parts[0].ty.shape.values[0]) * ROW_GROUP
        folded = target.folded_linear_kernel(family, wtype, n, k, eps) if family != LINEAR and m == 1 else None
        if folded is not None:
            args = [x, extras[0], *parts] if family == NORM_LINEAR else [x, *parts, *extras]
            return relax.op.reshape(_call_kernel(bb, *folded, args), [*lead, n])
        if family != LINEAR and (y := _prefill_linear(bb, target, family, wtype, x, extras, parts, n, eps)) is not None:
            return y
        if family == NORM_LINEAR:
            mean = bb.emit(relax.op.mean(relax.op.multiply(x, x), axis=[-1], keepdims=True))
            inv = bb.emit(relax.op.rsqrt(relax.op.add(mean, relax.const(eps, "float32"))))
            x = bb.emit(relax.op.multiply(relax.op.multiply(x, inv), extras[0]))
        elif family == SWIGLU_LINEAR_ADD:
            halves = bb.emit(relax.op.split(x, 2, axis=-1))
            gate, up = bb.emit(relax.TupleGetItem(halves, 0)), bb.emit(relax.TupleGetItem(halves, 1))
            x = bb.emit(relax.op.multiply(relax.op.multiply(gate, relax.op.sigmoid(gate)), up))
            if (y := _prefill_linear(bb, target, LINEAR_ADD, wtype, x, extras, parts, n, eps)) is not None:
                return y
        y = _plain_linear(bb, target, wtype, x, parts)
        return relax.op.add(y, extras[0]) if family in (LINEAR_ADD, SWIGLU_LINEAR_ADD) else y

    return _converter(linear)


def _rotary(kind: BlockKind, target):
    """RotaryQKV: the target's kernel where it has one (any number of tokens), else reshapes, slices and
    products."""
    c = kind.config
    H, HKV, D = c.heads, c.kv_heads, c.head_dim

    def rotary(bb, inputs, attr, params):
        qkv, cos, sin, _split = [bb.normalize(i) for i in inputs]
        lead, m = _rows(qkv)
        kernel = target.rotary_kernel(kind)
        if kernel is not None:  # any number of rows, as [M, ...] tensors
            flat = [bb.emit(relax.op.reshape(a, [m, int(a.ty.shape.values[-1])])) for a in (qkv, cos, sin)]
            outs = [relax.TensorType([m, count, D], "float32") for count in (H, HKV, HKV)]
            qkv_out = bb.emit(relax.call_tir(_add_kernel(bb, *kernel), flat, outs))
            return relax.Tuple([bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(qkv_out, i)), [*lead, count, D]))
                                for i, count in enumerate((H, HKV, HKV))])
        heads = bb.emit(relax.op.reshape(qkv, [*lead, H + 2 * HKV, D // 2, 2]))
        cs = bb.emit(relax.op.reshape(cos, [*lead, 1, D // 2, 1]))
        sn = bb.emit(relax.op.reshape(sin, [*lead, 1, D // 2, 1]))

        def take(begin: int, end: int, axis: int, x=heads):
            return bb.emit(relax.op.strided_slice(x, axes=[axis], begin=[begin], end=[end]))

        def rope(x: relax.Expr, count: int) -> relax.Expr:
            pair = len(lead) + 2  # the pair axis of [*lead, heads, D/2, 2], positive (TOPI's slice takes no -1)
            x0, x1 = take(0, 1, pair, x), take(1, 2, pair, x)
            out0 = relax.op.subtract(relax.op.multiply(x0, cs), relax.op.multiply(x1, sn))
            out1 = relax.op.add(relax.op.multiply(x0, sn), relax.op.multiply(x1, cs))
            return bb.emit(relax.op.reshape(relax.op.concat([out0, out1], axis=-1), [*lead, count, D]))

        axis = len(lead)
        q = rope(take(0, H, axis), H)
        k = rope(take(H, H + HKV, axis), HKV)
        v = bb.emit(relax.op.reshape(take(H + HKV, H + 2 * HKV, axis), [*lead, HKV, D]))
        return relax.Tuple([q, k, v])

    return rotary


def _split_attention(bb, kind: BlockKind, target, rotary: bool, inputs: list) -> list | None:
    """The target's split decode attention (one kernel: its chunks merged by the last block of each KV
    head, counted in on counters kept as a constant of the module): [out] or, with `rotary`, [out, k, v];
    None where the target has none."""
    c = kind.config
    split = target.split_attention_kernel(kind, rotary)
    if split is None:
        return None
    symbol, func = split
    counters = relax.const(target.attention_counters(kind))
    outs = [relax.TensorType(target.attention_workspace_shape(kind), "float32"),
            relax.TensorType([1, 1, c.heads, c.head_dim], "float32")]
    if rotary:
        outs += [relax.TensorType([1, 1, c.kv_heads, c.head_dim], "float32")] * 2
    call = bb.emit(relax.call_tir(_add_kernel(bb, symbol, func), [*inputs, counters], outs))
    return [bb.emit(relax.TupleGetItem(call, i)) for i in range(1, len(outs))]


def _attention(kind: BlockKind, target):
    def paged_attention(bb, inputs, attr, params):
        inputs = [bb.normalize(i) for i in inputs]
        split = _split_attention(bb, kind, target, False, inputs) if kind.decode else None
        if split is not None:
            return split[0]
        symbol, func = target.attention_kernel(kind)
        gv = _add_kernel(bb, symbol, func)
        return relax.call_tir(gv, inputs, inputs[0].ty)

    return paged_attention


def _ragged_attention(kind: BlockKind, target):
    def ragged_attention(bb, inputs, attr, params):
        inputs = [bb.normalize(i) for i in inputs]
        kernel = target.ragged_attention_kernel(kind)
        if kernel is None:
            raise JitllmError(f"target {target.name} has no ragged attention kernel for head dim "
                              f"{kind.config.head_dim}, so it cannot run batched steps of this model")
        return relax.call_tir(_add_kernel(bb, *kernel), inputs, inputs[0].ty)

    return ragged_attention


def _rotary_attention(kind: BlockKind, target):
    """RotaryPagedAttention (decode variants): the target's split decode attention that rotates q and the
    new k as it reads them, where it has one (no rotary launch); else RotaryQKV, then PagedAttention."""
    rotary, attention = _rotary(kind, target), _attention(kind, target)

    def rotary_attention(bb, inputs, attr, params):
        qkv, cos, sin, split, pages, pt, past = [bb.normalize(i) for i in inputs]
        fused = _split_attention(bb, kind, target, True, [qkv, cos, sin, pages, pt, past])
        if fused is not None:
            return relax.Tuple(fused)
        q, k, v = rotary(bb, [qkv, cos, sin, split], attr, params).fields
        return relax.Tuple([bb.emit(attention(bb, [q, k, v, pages, pt, past], attr, params)), k, v])

    return rotary_attention


def cache_slots(kind: BlockKind) -> int:
    """The expert slots a kind's routed-experts op reads: the cache's (a moe_experts kind), else every expert."""
    c = kind.config
    return kind.linear("ffn_gate_exps").out_features // c.expert_ffn if block_type(kind) is MOE_EXPERTS else 0


def _moe_converter(kind: BlockKind, target, wtypes: tuple[str, str, str], slots: bool):
    """MoeSwiGLU (`slots`: MoeSwiGLUSlots, with the slot map after the weights): the target's routed-experts
    kernel, over the tokens as [M, ...] rows; its parameters after the inputs are its float32 [M, ...]
    outputs, y the last (any before it: scratch the kernel passes between its launches)."""
    c = kind.config

    def moe(bb, inputs, attr, params):
        h, ids, weights, *parts = [bb.normalize(i) for i in inputs]
        symbol, func = target.moe_kernel(wtypes, c.experts, c.expert_ffn, c.hidden, c.experts_used, cache_slots(kind))
        lead, m = _rows(h)  # (to_relax checked the kernel exists)
        flat = [bb.emit(relax.op.reshape(h, [m, c.hidden]))] + [
            bb.emit(relax.op.reshape(a, [m, c.experts_used])) for a in (ids, weights)]
        args = [*flat, *parts]
        outs = [relax.TensorType([m, *[int(d) for d in p.shape[1:]]], "float32")
                for p in func.params[len(args):]]
        call = bb.emit(relax.call_tir(_add_kernel(bb, symbol, func), args, outs[0] if len(outs) == 1 else outs))
        y = call if len(outs) == 1 else bb.emit(relax.TupleGetItem(call, len(outs) - 1))
        return relax.op.reshape(y, [*lead, c.hidden])

    return _converter(moe)


def _recurrence_converter(kind: BlockKind, target):
    def gated_recurrence(bb, inputs, attr, params):
        q, k, v, a, state = [bb.normalize(i) for i in inputs]
        symbol, func = target.recurrence_kernel(kind)
        gv = _add_kernel(bb, symbol, func)
        # out is fresh, state_out is the state input updated in place (no copy, no allocation)
        return bb.emit(relax.call_tir_inplace(gv, [q, k, v, a, state], [-1, 4], [q.ty, state.ty]))

    return _converter(gated_recurrence)


def _row_gather(bb, inputs, attr, params):
    """A ragged head's one Gather (its sessions' last rows, never negative): out-of-range indices clipped
    rather than read out of bounds (TVM's default `take` trusts them, and says so at every compile)."""
    data, indices = [bb.normalize(i) for i in inputs]
    return relax.op.take(data, indices, attr.get("axis", 0), mode="clip")


@contextlib.contextmanager
def _custom_ops(kind: BlockKind, target, op_types: set[str]):
    extra = {linear_op(w, family): _linear_converter(family, w, target)
             for w in WEIGHT_TYPES for family in LINEAR_FAMILIES}
    extra |= {op: _moe_converter(kind, target, wtypes, is_slots_op(op)) for op in op_types
              if (wtypes := split_moe_op(op))}
    extra[ROTARY_QKV] = _converter(_rotary(kind, target))
    extra[PAGED_ATTENTION] = _converter(_attention(kind, target))
    extra[ROTARY_ATTENTION] = _converter(_rotary_attention(kind, target))
    extra[RAGGED_ATTENTION] = _converter(_ragged_attention(kind, target))
    if kind.ragged and block_type(kind).head:
        extra["Gather"] = _converter(_row_gather)
    extra[GATED_RECURRENCE] = _recurrence_converter(kind, target)
    with _PATCH_LOCK:
        original = onnx_frontend._get_convert_map
        onnx_frontend._get_convert_map = lambda: {**original(), **extra}
        try:
            yield
        finally:
            onnx_frontend._get_convert_map = original


def to_relax(kind: BlockKind, model: onnx.ModelProto, target) -> tvm.IRModule:
    """Import the block graph; `main` takes (activations..., weights...) in graph-input order."""
    state, head = block_type(kind).state, block_type(kind).head
    if state == RECURRENT and target.recurrence_kernel(kind) is None:
        raise JitllmError(f"target {target.name} has no kernel for gla blocks yet (hybrid models run on llvm)")
    op_types = {node.op_type for node in model.graph.node}
    c = kind.config
    for wtypes in filter(None, map(split_moe_op, op_types)):
        if target.moe_kernel(wtypes, c.experts, c.expert_ffn, c.hidden, c.experts_used, cache_slots(kind)) is None:
            raise JitllmError(f"target {target.name} has no kernel for routed experts in {'/'.join(wtypes)} yet "
                              f"(moe blocks run on llvm and cuda)")
    graph_only = onnx.ModelProto()
    graph_only.CopyFrom(model)
    del graph_only.functions[:]
    with _custom_ops(kind, target, op_types):
        mod = onnx_frontend.from_onnx(graph_only, keep_params_in_input=False, sanitize_input_names=False)
    if state == KV_PAGES:
        _, func = target.ragged_append_kernel(kind) if kind.ragged else target.append_kernel(kind)
        mod[APPEND_FUNCTION] = func.with_attr("global_symbol", APPEND_FUNCTION)
        for name, func in target.page_kernels(kind).items():
            mod[name] = func
    spec = kind.linears[0]
    helper = None if not head else (target.argmax_kernel(spec.out_features) if kind.decode else
                                               target.embedding_kernel(spec.wtype, spec.out_features, spec.in_features))
    if helper is not None:
        name = ARGMAX_FUNCTION if kind.decode else EMBED_FUNCTION
        mod[name] = helper[1].with_attr("global_symbol", name)
    return mod
