"""The CPU target: TVM's llvm backend with a CPU model chosen from the host's features at run time.

`mcpu=native` silently falls back to SSE2 on some hosts (DESIGN.md §3), so we name a level explicitly:
x86-64-v3 where AVX2/FMA/F16C exist, plain x86-64 otherwise, and a generic target on other machines.
"""

from __future__ import annotations

import platform
from functools import lru_cache

import tvm


@lru_cache(maxsize=1)
def host_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def host_target_dict() -> dict:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        level = "x86-64-v3" if {"avx2", "fma", "f16c"} <= host_cpu_flags() else "x86-64"
        return {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": level}
    if machine in ("aarch64", "arm64"):
        return {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic"}
    return {"kind": "llvm"}


class LlvmTarget:
    """Host CPU kernels: kernels_linear.py and kernels_attention.py (imported only to compile, since a
    runtime-only TVM has no TVMScript)."""

    name = "llvm"
    sources = ("llvm.py", "kernels_linear.py", "kernels_attention.py")

    def linear_kernel(self, wtype: str, n: int, k: int):
        from jitllm.lowering.kernels_linear import linear_kernel

        return linear_kernel(wtype, n, k)

    def attention_kernel(self, kind):
        from jitllm.lowering.kernels_attention import attention_kernel

        return attention_kernel(kind)

    def append_kernel(self, kind):
        from jitllm.lowering.kernels_attention import append_kernel

        return append_kernel(kind)

    def tvm_target(self) -> tvm.target.Target:
        return tvm.target.Target(host_target_dict())

    def build(self, mod: tvm.IRModule):
        with tvm.transform.PassContext(opt_level=3):
            return tvm.compile(mod, target=self.tvm_target())

    def cache_key(self) -> dict:
        return {"target": host_target_dict(), "arch": platform.machine()}
