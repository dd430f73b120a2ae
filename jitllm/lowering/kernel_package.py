"""A block imported to Relax -> a kernel package: every device kernel's WGSL and the launch plan a runtime
without TVM follows (runtime/backends/wgpu_plan.py runs it).

TVM compiles the module as it would for its WebGPU runtime (Relax legalization, fusion and dlight
schedules; the TIR pipeline up to SplitHostDevice, int32 indices), and then, instead of a VM executable
(whose host code only TVM's JavaScript runtime could launch), the plan is read off the lowered IR:
- each Relax function's bindings in order: a call of a TIR function over its arguments into fresh outputs
  (shapes as expressions of the function's symbolic dims), a reshape (a view), a tuple and its items;
- each TIR function's host part: its parameters' shapes and dtypes, its `let`s, its scratch buffers (a
  global `alloc_buffer` of the function: kernels of one function passing values to the next), and each
  kernel launch (the kernel, which parameter or scratch buffer is each storage binding, the uniform's int32
  values, the grid), with every expression kept as a small JSON tree over the symbolic dims (int32
  arithmetic).
The kernels' calling convention is TVM's WebGPU one (tvm/web/src/webgpu.ts): storage buffers bound in
kernel argument order, then one uniform of the POD arguments followed by `packGridDimX`.
"""

from __future__ import annotations

import json
import re

import tvm
from tvm import relax, s_tir, tirx

from jitllm.core.errors import JitllmError
from jitllm.lowering import KERNEL_PACKAGE_FORMAT

DEVICE_KERNEL_LAUNCH = 2
"""TVM's calling convention of a device kernel (CallingConv::kDeviceKernelLaunch)."""


def _relax_passes() -> list:
    from tvm.s_tir import dlight as dl

    return [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(), dl.gpu.Matmul(), dl.gpu.Reduction(),
                                dl.gpu.GeneralReduction(), dl.gpu.Fallback()),
        relax.transform.RewriteDataflowReshape(),
        relax.transform.DeadCodeElimination(),
        relax.transform.AttachGlobalSymbol(),
    ]


def _tir_passes() -> list:
    """TVM's s_tir pipeline (tvm/s_tir/pipeline.py) up to SplitHostDevice: no packed API, since nothing
    calls the host parts but this package's runtime."""
    S, P = s_tir.transform, tirx.transform
    return [
        P.ForceNarrowIndexToInt32(), S.CanonicalizeLoop(), S.LowerCrossThreadReduction(), S.LowerInitBlock(),
        S.PlanAndUpdateBufferAllocationLocation(), S.ConvertBlocksToOpaque(), S.LiftThreadBinding(),
        S.ManifestSharedMemoryLocalStage(), S.CompactBufferAllocation(), S.LowerAutoCopy(), S.UnifyThreadBinding(),
        S.LowerMatchBuffer(), S.StmtSimplify(), S.InjectPermutedLayout(), S.AnnotateIrregularLoop(),
        S.InjectSoftwarePipeline(), S.TransformMmaBufferLayout(), S.LowerOpaqueBlock(), P.FlattenBuffer(),
        P.BF16ComputeLegalize(), P.NarrowDataType(32), S.LoopPartition(), P.VectorizeLoop(True),
        S.InjectVirtualThread(), S.InjectDoubleBuffer(), P.StorageRewrite(), S.HoistIfThenElse(), P.UnrollLoop(),
        S.RenormalizeSplitPattern(), P.StmtSimplify(), P.RemoveNoOp(), S.RewriteUnsafeSelect(),
        P.CommonSubexprElim(), P.FP8ComputeLegalize(), P.VerifyMemory(), P.AnnotateEntryFunc(),
        S.ThreadSync("shared"), S.ThreadSync("shared.dyn"), S.ThreadSync("warp"), S.InferFragment(),
        S.LowerThreadAllreduce(), S.MergeSharedMemoryAllocations(), P.SplitHostDevice(),
    ]


def build_package(mod: tvm.IRModule, target: tvm.target.Target) -> dict:
    """The package (a JSON-ready dict) of an imported block module: `kernels` (name -> WGSL and launch
    metadata), `functions` (TIR host parts) and `programs` (Relax functions)."""
    with target, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(_relax_passes())(mod)
        tir = tvm.IRModule({gv: f.without_attr("target") for gv, f in mod.functions.items()
                            if isinstance(f, tirx.PrimFunc)})
        tir = tirx.transform.BindTarget(target)(tir)
        low = tvm.transform.Sequential(_tir_passes())(tir)
    device, host = {}, {}
    for gv, func in low.functions.items():
        conv = func.attrs.get("calling_conv") if func.attrs is not None else None
        (device if conv is not None and int(conv) == DEVICE_KERNEL_LAUNCH else host)[gv] = func
    kernels = _kernels(tvm.IRModule(device), target)
    functions = {gv.name_hint: _host_function(f, kernels) for gv, f in host.items()}
    programs = {gv.name_hint: _program(f, mod) for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    return {"format": KERNEL_PACKAGE_FORMAT, "kernels": kernels, "functions": functions, "programs": programs}


def _kernels(device: tvm.IRModule, target: tvm.target.Target) -> dict:
    from tvm.tirx.compilation_pipeline import finalize_device_passes

    device_target = tvm.target.Target({"kind": target.kind.name, **{k: v for k, v in target.attrs.items()}})
    device = finalize_device_passes()(device)
    built = tvm.get_global_func("target.build.webgpu")(device, device_target)
    info = json.loads(built.inspect_source("func_info"))
    sources = _split_sources(built.inspect_source(""))
    out = {}
    for name, finfo in info.items():
        tags = [t for t in finfo["launch_param_tags"] if not t.startswith("paramWriteAccess:")]
        writes = next((json.loads(t.split(":", 1)[1]) for t in finfo["launch_param_tags"]
                       if t.startswith("paramWriteAccess:")), [])
        handles = sum(1 for t in finfo["arg_types"] if t == "handle")
        out[name] = {"wgsl": sources[name], "storage": handles, "pods": finfo["arg_types"][handles:],
                     "launch": tags, "writes": writes}
    return out


_FUNCTION_MARK = re.compile(r"^// Function: (\S+)\n//-+\n", re.M)


def _split_sources(text: str) -> dict[str, str]:
    """Each kernel's WGSL from the device module's concatenated source (each begins with a
    `// Function: NAME` banner, printed once or twice)."""
    marks = list(_FUNCTION_MARK.finditer(text))
    out: dict[str, str] = {}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        out[mark.group(1)] = out.get(mark.group(1), "") + text[mark.end():end]
    return out


_BINARY = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//", tirx.FloorMod: "%",
           tirx.Div: "/", tirx.Mod: "rem", tirx.Min: "min", tirx.Max: "max", tirx.EQ: "==", tirx.NE: "!=",
           tirx.LT: "<", tirx.LE: "<=", tirx.GT: ">", tirx.GE: ">=", tirx.And: "and", tirx.Or: "or"}


def expr_tree(e) -> int | float | str | list:
    """A PrimExpr over named scalars as JSON: an int, a variable's name, or [op, operands...]."""
    if isinstance(e, (int, float)):
        return e
    if isinstance(e, tirx.IntImm):
        return int(e.value)
    if isinstance(e, tirx.FloatImm):
        return float(e.value)
    if isinstance(e, tirx.Var):
        return e.name
    if isinstance(e, tirx.Cast):
        return ["cast", str(e.dtype), expr_tree(e.value)]
    if isinstance(e, tirx.Select):
        return ["select", expr_tree(e.condition), expr_tree(e.true_value), expr_tree(e.false_value)]
    if isinstance(e, tirx.Not):
        return ["not", expr_tree(e.a)]
    op = _BINARY.get(type(e))
    if op is None:
        raise JitllmError(f"webgpu: cannot plan the expression {e} ({type(e).__name__})")
    return [op, expr_tree(e.a), expr_tree(e.b)]


def _host_function(func: tirx.PrimFunc, kernels: dict) -> dict:
    """A TIR function's host part: params [{shape, dtype}], and its steps in order: ["let", name, expr],
    ["scratch", [shape exprs], dtype] (a buffer numbered after the params and the scratch before it) and
    ["launch", kernel, [param or scratch number of each storage binding], [pod exprs], [grid exprs]]."""
    params, data_of = [], {}  # buffer (its object handle) -> parameter index
    for i, buf in enumerate(func.params):  # (a parameter is its buffer)
        params.append({"shape": [expr_tree(d) for d in buf.shape], "dtype": str(buf.dtype)})
        data_of[buf.__chandle__()] = i
    steps: list = []

    def visit(stmt) -> None:
        if isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                visit(s)
        elif isinstance(stmt, tirx.Bind):
            steps.append(["let", stmt.var.name, expr_tree(stmt.value)])
        elif isinstance(stmt, tirx.LetStmt):
            steps.append(["let", stmt.var.name, expr_tree(stmt.value)])
            visit(stmt.body)
        elif isinstance(stmt, tirx.AllocBuffer):
            buf = stmt.buffer
            if buf.scope() != "global":
                raise JitllmError(f"webgpu: cannot plan a host allocation in {buf.scope()} memory ({buf.name})")
            data_of[buf.__chandle__()] = len(params) + sum(s[0] == "scratch" for s in steps)
            steps.append(["scratch", [expr_tree(d) for d in buf.shape], str(buf.dtype)])
        elif isinstance(stmt, tirx.DeclBuffer):  # a view over a parameter's data (tirx.buffer_data(param))
            data_of[stmt.buffer.__chandle__()] = data_of.get(_buffer_of(stmt.data))
        elif isinstance(stmt, tirx.AttrStmt):
            visit(stmt.body)
        elif isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call):
            steps.append(_launch(stmt.value, data_of, kernels))
        else:
            raise JitllmError(f"webgpu: cannot plan the host statement {type(stmt).__name__}: {stmt}")

    visit(func.body)
    return {"params": params, "steps": steps}


def _buffer_of(data) -> int | None:
    """The buffer whose data `data` is (tirx.buffer_data(buffer)), by object identity (names repeat: a
    split's outputs are all `T_split`), or None."""
    if isinstance(data, tvm.ir.Call) and data.op.name == "tirx.buffer_data":
        return data.args[0].__chandle__()
    return None


def _launch(call: tvm.ir.Call, data_of: dict, kernels: dict) -> list:
    name = str(call.args[0].value)
    kernel = kernels[name]
    args = list(call.args[1:])
    handles, pods = args[:kernel["storage"]], args[kernel["storage"]:kernel["storage"] + len(kernel["pods"])]
    grid = args[kernel["storage"] + len(kernel["pods"]):]
    bound = []
    for h in handles:
        index = data_of.get(_buffer_of(h))
        if index is None:
            raise JitllmError(f"webgpu: kernel {name} takes a buffer that is not a parameter ({h})")
        bound.append(index)
    return ["launch", name, bound, [expr_tree(p) for p in pods], [expr_tree(g) for g in grid]]


def _program(func: relax.Function, mod: tvm.IRModule) -> dict:
    """A Relax function's params [{shape, dtype}] and bindings [{op, ...}] over numbered values."""
    ids: dict = {}

    def value_id(var) -> int:
        if var not in ids:
            ids[var] = len(ids)
        return ids[var]

    def shape_of(ty) -> list:
        return [expr_tree(d) for d in ty.shape.values]

    params = [{"shape": shape_of(p.ty), "dtype": str(p.ty.dtype), "id": value_id(p)} for p in func.params]
    bindings = []
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.call_tir"):
                for arg in b.value.args[1].fields:  # (a constant argument, such as attention counters)
                    if isinstance(arg, tvm.ir.expr.GenericConst) and arg not in ids:
                        bindings.append({"id": value_id(arg), **_binding(arg, value_id, mod)})
            bindings.append({"id": value_id(b.var), **_binding(b.value, value_id, mod)})
    return {"params": params, "bindings": bindings, "output": _output(func.body.body, value_id)}


def _binding(value, value_id, mod: tvm.IRModule) -> dict:
    if isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_tir"):
        callee, args = value.args[0], value.args[1]
        if len(value.args) > 2:
            raise JitllmError(f"webgpu: call_tir with shape arguments is not planned ({callee.name_hint})")
        out = value.ty_args[0]
        if _is_reshape(mod[callee], args, out):  # (one RewriteDataflowReshape leaves: the function's output)
            return {"op": "reshape", "arg": value_id(args.fields[0]), "shape": [expr_tree(d) for d in out.shape.values]}
        outs = list(out.fields) if isinstance(out, relax.TupleType) else [out]
        return {"op": "call", "function": callee.name_hint, "args": [value_id(a) for a in args.fields],
                "outs": [{"shape": [expr_tree(d) for d in o.shape.values], "dtype": str(o.dtype)} for o in outs],
                "tuple": isinstance(out, relax.TupleType)}
    if isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.reshape"):
        return {"op": "reshape", "arg": value_id(value.args[0]), "shape": [expr_tree(d) for d in value.args[1].values]}
    if isinstance(value, relax.TupleGetItem):
        return {"op": "item", "arg": value_id(value.tuple_value), "index": int(value.index)}
    if isinstance(value, relax.Tuple):
        return {"op": "tuple", "args": [value_id(f) for f in value.fields]}
    if isinstance(value, relax.Var):
        return {"op": "alias", "arg": value_id(value)}
    if isinstance(value, tvm.ir.expr.GenericConst):
        array = value.value.numpy()
        return {"op": "const", "dtype": str(array.dtype), "shape": list(array.shape), "values": array.ravel().tolist()}
    raise JitllmError(f"webgpu: cannot plan the Relax binding {value}")


def _is_reshape(callee, args: relax.Tuple, out) -> bool:
    """Whether a call_tir only copies its one argument into an output of the same type and element
    count in the same order (a legalized reshape): then it is planned as a view, not a dispatch."""
    if len(args.fields) != 1 or isinstance(out, relax.TupleType) or not isinstance(callee, tirx.PrimFunc):
        return False
    src = args.fields[0].ty
    return (str(src.dtype) == str(out.dtype) and _count(src.shape.values) == _count(out.shape.values)
            and relax.analysis.has_reshape_pattern(callee))


def _count(dims) -> int | None:
    """The element count of static dims (None where any is symbolic)."""
    n = 1
    for d in dims:
        if not isinstance(d, tirx.IntImm):
            return None
        n *= int(d)
    return n


def _output(body, value_id) -> int | list:
    if isinstance(body, relax.Tuple):
        return [value_id(f) for f in body.fields]
    return value_id(body)
