"""The CUDA routed-experts kernel (kernels/cuda/moe.py): its arithmetic and indexing, built without thread
bindings and run on this CPU, against numpy over the same dequantized weights; MoE kinds of the GPU tests'
models compiled for CUDA (source here, cubins where nvcc exists); the refusal left for targets without one.
tests/gpu/test_moe_cuda.py runs the kernel itself."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import tvm

from jitllm.core.errors import JitllmError
from jitllm.core.layouts import WEIGHT_TYPES, weight_parts
from jitllm.core.quant import dequantize, parts_from_float
from jitllm.ir.blocks import build_block_graph
from jitllm.ir.moe import cache_kind
from jitllm.lowering.kernels.cuda.moe import moe_kernel
from jitllm.lowering.onnx_import import to_relax
from jitllm.lowering.target import kind_for_target
from jitllm.lowering.targets.cuda import CudaTarget
from jitllm.random_model import preset_layout

CASES = {  # (gate, up, down), hidden, ffn, slots
    "f32, f16, q4_0": (("f32", "f16", "q4_0"), 64, 32, 0),
    "q4_0, q8_0, q4_1 over 4 slots": (("q4_0", "q8_0", "q4_1"), 64, 32, 4),
    "bf16, q5_0, q5_1": (("bf16", "q5_0", "q5_1"), 64, 96, 0),
    "q4_k, q5_k, q6_k over 5 slots": (("q4_k", "q5_k", "q6_k"), 256, 256, 5),
}
EXPERTS, TOP = 6, 2


def _reference(deq, h, ids, wts, slot_map, f: int, k: int) -> np.ndarray:
    y = np.zeros_like(h)
    for m in range(h.shape[0]):
        for j in range(ids.shape[1]):
            b = slot_map[ids[m, j]]
            gate, up = deq[0][b * f:(b + 1) * f] @ h[m], deq[1][b * f:(b + 1) * f] @ h[m]
            y[m] += wts[m, j] * (deq[2][b * k:(b + 1) * k] @ (gate / (1 + np.exp(-gate)) * up))
    return y


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rows", [1, 5])
def test_the_kernel_computes_the_picked_experts(case, rows):
    """The kernel's loops serial (gpu=False) on llvm: each token's picks through the rows of their experts
    (or of their slots, in an order unlike the experts'), weighted and added, as numpy computes them."""
    wtypes, k, f, slots = CASES[case]
    rng = np.random.default_rng(7)
    banked = slots or EXPERTS
    shapes = [(banked * f, k), (banked * f, k), (banked * k, f)]
    parts = [parts_from_float(w, rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1]))
             for w, s in zip(wtypes, shapes)]
    h = rng.standard_normal((rows, k)).astype(np.float32)
    ids = np.stack([rng.choice(EXPERTS, TOP, replace=False) for _ in range(rows)]).astype(np.int64)
    wts = rng.random((rows, TOP)).astype(np.float32)
    slot_map = (rng.permutation(EXPERTS) % banked).astype(np.int64) if slots else np.arange(EXPERTS)
    symbol, func = moe_kernel(wtypes, EXPERTS, f, k, TOP, slots, gpu=False)
    run = tvm.compile(tvm.IRModule({symbol: func}), target="llvm")[symbol]
    args = [h, ids, wts, *([slot_map] if slots else [])]
    args += [p[name] for w, p in zip(wtypes, parts) for name, _, _ in weight_parts(w, 8, 256)]
    act, y = tvm.runtime.empty((rows, TOP * f), "float32"), tvm.runtime.empty((rows, k), "float32")
    run(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args], act, y)
    want = _reference([dequantize(w, p) for w, p in zip(wtypes, parts)], h, ids, wts, slot_map, f, k)
    assert np.abs(y.numpy() - want).max() < 2e-6 * np.abs(want).max()
    assert symbol.startswith(f"jl_gpu_moe_{'_'.join(wtypes)}_")


def test_cuda_declares_the_kernel_for_every_weight_type_and_webgpu_refuses_in_one_line():
    target = CudaTarget("sm_90")
    for wtype in WEIGHT_TYPES:
        assert target.moe_kernel((wtype, wtype, wtype), 8, 32, 256, 2) is not None
    assert CudaTarget("sm_90", "fast").moe_kernel(("q4_0",) * 3, 8, 32, 64, 2, 3)[0].endswith("_slots3")
    from jitllm.lowering.targets.webgpu import WebGpuTarget

    kind = preset_layout("tiny-qwen3moe", "q4_0").block_kinds[0]
    with pytest.raises(JitllmError, match=r"^target webgpu has no kernel for routed experts in q4_0/q4_0/q4_0 yet "
                                          r"\(moe blocks run on llvm and cuda\)$"):
        to_relax(kind, build_block_graph(kind), WebGpuTarget())


def _moe_kinds(target):
    """The GPU tests' MoE kinds as `target` runs them: general and decode, and an expert cache's."""
    out = []
    for preset, wtype in (("tiny-qwen3moe", "q4_0"), ("tiny-mixtral", "f16")):
        kind = kind_for_target(preset_layout(preset, wtype).block_kinds[0], target)
        out += [kind, kind.decode_variant(), kind_for_target(cache_kind(kind, 3), target)]
    return out


def test_moe_kinds_build_cuda_code_with_both_launches():
    """Qwen3-MoE (q4_0) and Mixtral (f16) blocks, prefill and decode, and an expert cache's kind, through
    TVM's CUDA pipeline to CUDA source (nvcc not run): the routed experts are the kernel's two launches."""
    from jitllm.lowering.targets.cuda import _pipeline

    target = CudaTarget("sm_90")
    tvm_target = target.tvm_target()
    for kind in _moe_kinds(target):
        with tvm_target, tvm.transform.PassContext(opt_level=3):
            built = tvm.compile(to_relax(kind, build_block_graph(kind), target), target=tvm_target,
                                relax_pipeline=_pipeline(tvm_target))
        source = built.mod.imports[0].imports[0].inspect_source("")
        launches = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(jl_gpu_moe_\w+)\(", source))
        assert len(launches) == 2, (kind.kind, kind.decode, launches)
        assert all(("_slots3_" in name) == (kind.kind == "moe_experts") for name in launches)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_moe_kinds_compile_to_gpu_code_with_nvcc(tmp_path):
    from jitllm.lowering.cache import get_artifact

    target = CudaTarget("sm_90", "fast")
    for kind in _moe_kinds(target)[:2]:
        artifact = get_artifact(kind, target, tmp_path)
        assert artifact.path.read_bytes().count(b"\x7fELF") >= 2  # the host library and a cubin inside it
