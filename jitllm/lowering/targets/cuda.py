"""The CUDA target: kernels from kernels/cuda, dlight schedules, nvcc-compiled GPU code keyed by arch.

Artifacts must hold compiled GPU code, not CUDA source (a runtime-only TVM cannot compile source), so
the build forces nvcc and, without a driver, runs on a stub libcuda (targets/cuda_runtime.py).
"""

from __future__ import annotations

import os
import re

import tvm

from jitllm.core.errors import JitllmError
from jitllm.lowering.target import SHARED_LIBRARY, KernelSet, TargetCaps

KERNELS = ("exact", "fast")


class CudaTarget(KernelSet):
    """Capabilities: Q/K/V and gate/up as one matvec each (every GPU kernel has a fixed cost of a few µs,
    DESIGN.md §3); decode steps use a batch-1, seq-1 variant of each kind (GEMV schedules), whose `main`
    writes the step's K and V into the pages itself (the split attention's partial kernel does,
    kernels/cuda/split_attention.APPENDS_KV: the runtime launches no append after it); prefill kinds take
    the folded ops as decode variants do (BlockKind.folded): one rotary kernel (rotary_kernel), residual
    adds inside the tensor-core linears, norms inside them too (exact family, prefill_linear_kernel,
    SwiGLU one elementwise pass) or in the operand pass before each GEMM, which applies SwiGLU as well
    (fast family on sm_80 on, prefill_gemm_kernels). Ragged variants (batched steps) take the ragged
    attention and append of kernels/cuda/ragged.py; they run eagerly (no captured graphs). MoE blocks' routed
    experts take kernels/cuda/moe.py in every weight type (moe_kernel)."""

    name = "cuda"
    caps = TargetCaps(SHARED_LIBRARY, fuse_linears=True, fold_prefill=True, decode_variants=True,
                      decode_appends_kv=True, ragged_batches=True, kernels_flag="gpu-kernels")
    sources = ("targets/cuda.py", "targets/cuda_runtime.py", "kernels/cuda", "kernels/formats.py",
               "kernels/kv_store.py")

    def __init__(self, arch: str = "sm_90", kernels: str = "exact") -> None:
        """`kernels`: "exact" (f32 activations everywhere; tensor cores through f16 hi + lo halves) or
        "fast" (decode matvecs over GGML-quantized weights quantize the activations to int8 and use
        dp4a, kernels/cuda/gemv_int8.py; prefill linears multiply f16 operands alone, written once by an
        operand pass and multiplied by ldmatrix + mma.sync, kernels/cuda/gemm.py (sm_80 on; WMMA in
        kernels/cuda/mma.py before), and so does the prefill attention, kernels/cuda/attention_mma.py;
        float-weight decode matvecs are the same in both)."""
        match = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
        if match is None:
            raise JitllmError(f"bad CUDA arch {arch!r} (expected sm_XX, e.g. sm_90 or sm_90a)")
        if kernels not in KERNELS:
            raise JitllmError(f"unknown GPU kernels {kernels!r} (known: {', '.join(KERNELS)})")
        self.arch, self.kernels = arch, kernels
        self.compute_capability = int(match.group(1))
        self.dependent_launch = self.compute_capability >= 90
        """Decode kernels launched dependent (programmatic dependent launch, Hopper on): each may start
        while the one before it finishes (kernels/cuda/basic.await_previous_kernel)."""

    @classmethod
    def from_options(cls, arch: str | None, kernels: str) -> "CudaTarget":
        """The registry's constructor (sm_90 unless an arch is named)."""
        return cls(arch or "sm_90", kernels)

    def tvm_target(self) -> tvm.target.Target:
        return tvm.target.Target({"kind": "cuda", "arch": self.arch}, host={"kind": "llvm"})

    def cache_key(self) -> dict:
        return {"target": {"kind": "cuda", "arch": self.arch}, "host": "llvm", "kernels": self.kernels}

    def linear_kernel(self, wtype: str, n: int, k: int, rows: int | None = None):
        """Decode matvecs (one row) as `folded_linear_kernel` gives them; prefill (rows unknown) on tensor
        cores where the arch has them (sm_70 on) and the shape fits; the rest as kernels_gpu.linear_kernel
        gives them."""
        from jitllm.ir.ops import LINEAR
        from jitllm.lowering.kernels.cuda.basic import linear_kernel

        if rows == 1:
            return self.folded_linear_kernel(LINEAR, wtype, n, k)
        mma = self.prefill_linear_kernel(LINEAR, wtype, n, k) if rows is None else None
        return mma or linear_kernel(wtype, n, k, rows)

    def prefill_linear_kernel(self, family: str, wtype: str, n: int, k: int, eps: float = 0.0):
        """A linear over any number of rows with its norm or residual add folded (jitllm.ir.ops) on
        tensor cores (sm_70 on, shapes and families kernels_gpu_mma takes), else None. The fast family
        runs the wide gate/up projections 128 rows per thread block."""
        from jitllm.lowering.kernels.cuda.mma import mma_linear_kernel

        if self.compute_capability < 70:
            return None
        bm = 128 if self.kernels == "fast" and n >= 8192 else 64
        return mma_linear_kernel(wtype, n, k, self.kernels == "exact", bm, family, eps)

    def prefill_gemm_kernels(self, family: str, wtype: str, n: int, k: int, eps: float = 0.0):
        """The fast family's prefill linear on sm_80 on as a PrefillGemm (operand pass, GEMM, split sum): x (its
        norm or SwiGLU applied) written once as f16, then the ldmatrix + mma.sync GEMM with the residual
        added as it stores, or, where its tiling splits K, by the kernel that adds the splits' sums
        (kernels_gpu_gemm); None elsewhere or where the shape does not tile."""
        from jitllm.ir.ops import LINEAR_ADD, SWIGLU_LINEAR_ADD
        from jitllm.lowering.kernels.cuda.gemm import (
            PrefillGemm,
            gemm_kernel,
            operand_kernel,
            splitk_sum_kernel,
            tiling_for,
        )

        if self.kernels != "fast" or self.compute_capability < 80:
            return None
        residual, tiling = family in (LINEAR_ADD, SWIGLU_LINEAR_ADD), tiling_for(n, k, wtype)
        gemm = gemm_kernel(wtype, n, k, residual, tiling)
        if gemm is None:
            return None
        split_sum = splitk_sum_kernel(n, tiling.splits, residual) if tiling.splits > 1 else None
        return PrefillGemm(operand_kernel(family, k, eps), gemm, split_sum, tiling.splits)

    def folded_linear_kernel(self, family: str, wtype: str, n: int, k: int, eps: float = 0.0):
        """Decode matvecs with their norm / SwiGLU / residual add in the same kernel (jitllm.ir.ops)."""
        if self._int8_activations(wtype):
            from jitllm.lowering.kernels.cuda.gemv_int8 import int8_gemv_kernel

            return int8_gemv_kernel(wtype, n, k, family, eps, dependent=self.dependent_launch)
        from jitllm.lowering.kernels.cuda.gemv import gemv_kernel

        return gemv_kernel(wtype, n, k, family, eps, self.dependent_launch)

    def _int8_activations(self, wtype: str) -> bool:
        """dp4a (sm_61 on) over a GGML format, with the fast family."""
        from jitllm.lowering.kernels.cuda.gemv_int8 import FORMATS

        return self.kernels == "fast" and wtype in FORMATS and self.compute_capability >= 61

    def rotary_kernel(self, kind):
        from jitllm.lowering.kernels.cuda.basic import rotary_kernel

        return rotary_kernel(kind)

    def attention_kernel(self, kind):
        """Prefill attention: on tensor cores with f16 operands in the fast family (sm_70 on, head dims
        the fragments tile), the f32 CUDA-core kernel otherwise."""
        from jitllm.lowering.kernels.cuda import attention_mma as mma
        from jitllm.lowering.kernels.cuda.basic import attention_kernel

        if self.kernels == "fast" and self.compute_capability >= 70 and mma.applies(kind):
            return mma.mma_attention_kernel(kind)
        return attention_kernel(kind)

    def split_attention_kernel(self, kind, rotary: bool = False):
        """Decode variants: attention split over chunks of the history, merged by the last block of each KV
        head; with `rotary`, from the fused projection, rotating q and the new k as they are read
        (RotaryPagedAttention)."""
        from jitllm.lowering.kernels.cuda.split_attention import split_attention_kernel

        return split_attention_kernel(kind, rotary, self.dependent_launch)

    def attention_workspace_shape(self, kind):
        from jitllm.lowering.kernels.cuda.split_attention import workspace_shape

        return workspace_shape(kind)

    def attention_counters(self, kind):
        """The split attention's arrival counters: a constant of the decode module (kernels_gpu_attention)."""
        from jitllm.lowering.kernels.cuda.split_attention import arrival_counters

        return arrival_counters(kind)

    def embedding_kernel(self, wtype: str, vocab: int, hidden: int):
        """The head's embedding row gather (lowering.EMBED_FUNCTION), used where the head is tied."""
        from jitllm.lowering.kernels.cuda.basic import embedding_kernel

        return embedding_kernel(wtype, vocab, hidden)

    def argmax_kernel(self, vocab: int):
        """The greedy pick beside the head's decode `main` (lowering.ARGMAX_FUNCTION)."""
        from jitllm.lowering.kernels.cuda.basic import argmax_kernel

        return argmax_kernel(vocab, self.dependent_launch)

    def append_kernel(self, kind):
        from jitllm.lowering.kernels.cuda.basic import append_kernel

        return append_kernel(kind)

    def ragged_attention_kernel(self, kind):
        """Batched steps (ragged variants): the exact prefill attention's thread blocks per session."""
        from jitllm.lowering.kernels.cuda.ragged import ragged_attention_kernel

        return ragged_attention_kernel(kind)

    def ragged_append_kernel(self, kind):
        from jitllm.lowering.kernels.cuda.ragged import ragged_append_kernel

        return ragged_append_kernel(kind)

    def page_kernels(self, kind) -> dict:
        from jitllm.lowering.kernels.cuda.pages import page_kernels

        return page_kernels(kind)

    def moe_kernel(self, wtypes, experts, ffn, hidden, top_k, slots=0):
        """Routed experts (MoE blocks, and expert caches) in every weight type, both families: the exact
        kernel of kernels/cuda/moe.py (two launches over the routed (token, pick) pairs)."""
        from jitllm.lowering.kernels.cuda.moe import moe_kernel

        return moe_kernel(wtypes, experts, ffn, hidden, top_k, slots)

    def build(self, mod: tvm.IRModule):
        from jitllm.lowering.targets.cuda_runtime import ensure_cuda_runtime

        ensure_cuda_runtime(allow_stub=True)
        os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
        target = self.tvm_target()
        with target, tvm.transform.PassContext(opt_level=3):
            return tvm.compile(mod, target=target, relax_pipeline=_pipeline(target))


def _pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's CUDA pipeline with our dlight rule order (LowBatchGEMV before Matmul: DESIGN.md §3)."""
    from tvm import relax
    from tvm.relax.backend.cuda import pipeline as cuda_pipeline
    from tvm.s_tir import dlight as dl

    legalize = [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        dl.ApplyDefaultSchedule(dl.gpu.GEMV(), dl.gpu.LowBatchGEMV(), dl.gpu.Matmul(), dl.gpu.Reduction(),
                                dl.gpu.GeneralReduction(), dl.gpu.Fallback()),
    ]
    return tvm.transform.Sequential(
        cuda_pipeline.library_dispatch_passes(target) + legalize
        + cuda_pipeline.dataflow_lower_passes(target) + cuda_pipeline.finalize_passes(target))
