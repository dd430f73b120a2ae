"""The explicit registry of compile targets: one module per target, one line here each."""

from __future__ import annotations

from jitllm.core.errors import JitllmError
from jitllm.lowering.target import Target
from jitllm.lowering.targets.cuda import CudaTarget
from jitllm.lowering.targets.llvm import LlvmTarget
from jitllm.lowering.targets.onnxruntime import OnnxRuntimeTarget
from jitllm.lowering.targets.webgpu import WebGpuTarget

TARGETS: dict[str, type] = {
    "llvm": LlvmTarget,
    "cuda": CudaTarget,
    "onnxruntime": OnnxRuntimeTarget,
    "webgpu": WebGpuTarget,
}
"""Target name -> class; each class builds itself from CLI options with `from_options(arch, kernels)`."""


def get_target(name: str, arch: str | None = None, kernels: str = "fast") -> Target:
    """The target `name`. `kernels`: its kernel family, fast or exact (what `jitllm run` picks with
    -cpu-kernels / -gpu-kernels; fast by default there too, so `jitllm compile` fills what a plain
    `jitllm run` loads)."""
    if name not in TARGETS:
        raise JitllmError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
    return TARGETS[name].from_options(arch, kernels)
