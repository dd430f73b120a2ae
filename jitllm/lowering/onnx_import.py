"""ONNX block graph -> TVM Relax IRModule, with jitllm's custom ops lowered to our TIR kernels.

TVM's ONNX importer knows nothing of jitllm's functions; for the duration of one import we extend its
converter table so each `Linear_<wtype>` / `PagedAttention` call becomes a `call_tir` of a kernel from
kernels_linear.py / kernels_attention.py (the ONNX function bodies are only the reference semantics).
The KV append kernel is added beside `main` and called by the runtime after each block step.
The kernels come from the target (`linear_kernel`, `attention_kernel`, `append_kernel`), so each
target brings kernels written for its hardware while the graph stays the same.
"""

from __future__ import annotations

import contextlib
import threading

import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from jitllm.ir.config import ROW_GROUP, WEIGHT_TYPES, BlockKind
from jitllm.errors import JitllmError
from jitllm.ir.ops import GATED_RECURRENCE, PAGED_ATTENTION, linear_op
from jitllm.lowering import APPEND_FUNCTION
from jitllm.lowering.kernels_pages import page_kernels


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


def _linear_converter(wtype: str, target):
    def linear(bb, inputs, attr, params):
        x, *parts = [bb.normalize(i) for i in inputs]
        shape = list(x.ty.shape.values)
        lead = shape[:-1]
        k = int(shape[-1])
        g = int(parts[0].ty.shape.values[0])
        n = g * ROW_GROUP
        m = 1
        for dim in lead:
            m = m * (int(dim) if isinstance(dim, tvm.tirx.IntImm) else dim)
        static_rows = {"rows": m} if isinstance(m, int) else {}  # only decode variants (GPU) have them
        symbol, func = target.linear_kernel(wtype, n, k, **static_rows)
        gv = _add_kernel(bb, symbol, func)
        # The kernel's own buffers say how it wants x and y laid out: [M, ...] with static trailing dims.
        x_buf, y_buf = func.params[0], func.params[-1]
        x2 = bb.emit(relax.op.reshape(x, [m, *[int(d) for d in x_buf.shape[1:]]]))
        y_type = relax.TensorType([m, *[int(d) for d in y_buf.shape[1:]]], "float32")
        y = bb.emit(relax.call_tir(gv, [x2, *parts], y_type))
        return relax.op.reshape(y, [*lead, n])

    return _converter(linear)


def _attention_converter(kind: BlockKind, target):
    def paged_attention(bb, inputs, attr, params):
        inputs = [bb.normalize(i) for i in inputs]
        if kind.decode and hasattr(target, "split_attention_kernels"):
            (psym, pfunc), (msym, mfunc) = target.split_attention_kernels(kind)
            shape = target.attention_workspace_shape(kind)
            ws = bb.emit(relax.call_tir(_add_kernel(bb, psym, pfunc), inputs, relax.TensorType(shape, "float32")))
            return relax.call_tir(_add_kernel(bb, msym, mfunc), [ws, inputs[5]], inputs[0].ty)
        symbol, func = target.attention_kernel(kind)
        gv = _add_kernel(bb, symbol, func)
        return relax.call_tir(gv, inputs, inputs[0].ty)

    return _converter(paged_attention)


def _recurrence_converter(kind: BlockKind, target):
    def gated_recurrence(bb, inputs, attr, params):
        q, k, v, a, state = [bb.normalize(i) for i in inputs]
        symbol, func = target.recurrence_kernel(kind)
        gv = _add_kernel(bb, symbol, func)
        # out is fresh, state_out is the state input updated in place (no copy, no allocation)
        return bb.emit(relax.call_tir_inplace(gv, [q, k, v, a, state], [-1, 4], [q.ty, state.ty]))

    return _converter(gated_recurrence)


@contextlib.contextmanager
def _custom_ops(kind: BlockKind, target):
    extra = {linear_op(w): _linear_converter(w, target) for w in WEIGHT_TYPES}
    extra[PAGED_ATTENTION] = _attention_converter(kind, target)
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
    if kind.kind == "gla" and not hasattr(target, "recurrence_kernel"):
        raise JitllmError(f"target {target.name} has no kernel for gla blocks yet (hybrid models run on llvm)")
    graph_only = onnx.ModelProto()
    graph_only.CopyFrom(model)
    del graph_only.functions[:]
    with _custom_ops(kind, target):
        mod = onnx_frontend.from_onnx(graph_only, keep_params_in_input=False, sanitize_input_names=False)
    if kind.kind == "llama":
        _, func = target.append_kernel(kind)
        mod[APPEND_FUNCTION] = func.with_attr("global_symbol", APPEND_FUNCTION)
        for name, func in page_kernels(kind, gpu=target.name != "llvm").items():
            mod[name] = func
    return mod
