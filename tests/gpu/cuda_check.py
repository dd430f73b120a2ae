"""Whether this machine has a CUDA device the GPU tests can run on (the real driver, not the build stub)."""

from __future__ import annotations

import tvm


def cuda_available() -> bool:
    try:
        from jitllm.lowering.targets.cuda_runtime import ensure_cuda_runtime

        ensure_cuda_runtime(allow_stub=False)
        return tvm.cuda(0).exist
    except Exception:
        return False
