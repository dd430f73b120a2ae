"""The explicit registry of compile targets (one small module per target)."""

from __future__ import annotations

from jitllm.errors import JitllmError
from jitllm.lowering.llvm import LlvmTarget


def get_target(name: str, arch: str | None = None, gpu_kernels: str = "fast"):
    """A target object: `.name`, `.build(IRModule)`, `.cache_key()`. `gpu_kernels`: the CUDA kernel
    family (what `jitllm run -gpu-kernels` picks; fast by default there too)."""
    if name == "llvm":
        return LlvmTarget()
    if name == "cuda":
        from jitllm.lowering.cuda import CudaTarget

        return CudaTarget(arch or "sm_90", gpu_kernels)
    raise JitllmError(f"unknown target {name!r} (known: llvm, cuda)")
