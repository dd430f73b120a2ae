"""The explicit registry of compile targets (one small module per target)."""

from __future__ import annotations

from jitllm.core.errors import JitllmError
from jitllm.lowering.llvm import LlvmTarget


def get_target(name: str, arch: str | None = None, kernels: str = "fast"):
    """A target object: `.name`, `.build(IRModule)`, `.cache_key()`. `kernels`: the target's kernel
    family, fast or exact (what `jitllm run` picks with -cpu-kernels / -gpu-kernels; fast by default
    there too, so `jitllm compile` fills what a plain `jitllm run` loads)."""
    if name == "llvm":
        return LlvmTarget(kernels)
    if name == "cuda":
        from jitllm.lowering.cuda import CudaTarget

        return CudaTarget(arch or "sm_90", kernels)
    raise JitllmError(f"unknown target {name!r} (known: llvm, cuda)")
