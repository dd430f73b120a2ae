"""The WebGPU target: WGSL from TVM's webgpu codegen, for Vulkan (and Metal) through wgpu
(runtime/backends/wgpu.py). TVM's only WebGPU runtime is JavaScript, so the artifact is a kernel package
(lowering/kernel_package.py): every kernel's WGSL and the launch plan a small Python runtime follows.

Kernels: linears over quant words (kernels/webgpu/linear.py: prefill scheduled by dlight, decode matvecs
hand-written with the norm, SwiGLU and residual add folded in), the decode attention with its KV append
and rotary embedding (kernels/webgpu/attention.py), the SIMT prefill attention, rotary, KV append and page
kernels shared with CUDA (kernels/cuda/basic.py, pages.py; int32 indices after ForceNarrowIndexToInt32),
the greedy pick (kernels/webgpu/argmax.py); prefill norms and SwiGLU are the graph's own ops, legalized
and scheduled by dlight.
"""

from __future__ import annotations

from jitllm.core.errors import JitllmError
from jitllm.lowering.target import KERNEL_PACKAGE, KernelSet, TargetCaps

KERNELS = ("exact",)
"""f32 activations throughout (the fast families' int8 and f16 tricks have no WGSL kernels yet)."""


class WebGpuTarget(KernelSet):
    """Capabilities: Q/K/V and gate/up stacked (one dispatch each, and the layout the host and CUDA use,
    so a move is one copy of a block's weights); int32 indexing; a batch-1, seq-1 decode variant of each
    kind, whose linears have one static row (a matvec of its own, kernels/webgpu/linear.gemv_kernel, where
    the general kind's matmul schedule pads the row to a 32-row tile, with the norm / SwiGLU / residual
    folded in), whose attention appends the step's K and V itself (no append dispatch after `main`), and
    whose head picks the greedy token on the device: six dispatches a llama block (the attention split over
    history chunks is two: the chunks, then their merge)."""

    name = "webgpu"
    caps = TargetCaps(KERNEL_PACKAGE, fuse_linears=True, decode_variants=True, decode_appends_kv=True,
                      index_bits=32, kv_types=("f32",))
    """f32 KV only: WGSL's f16 needs the optional shader-f16 feature, which the kernels do not ask for."""
    sources = ("targets/webgpu.py", "kernels/webgpu", "kernels/cuda/basic.py", "kernels/cuda/pages.py",
               "kernels/cuda/gemv.py", "kernels/cuda/wide.py", "kernels/formats.py", "kernels/kv_store.py")

    def __init__(self, kernels: str = "exact") -> None:
        if kernels not in KERNELS:
            raise JitllmError(f"the webgpu target has only the exact kernel family (asked for {kernels!r})")
        self.kernels = kernels

    @classmethod
    def from_options(cls, arch: str | None, kernels: str) -> "WebGpuTarget":
        """The registry's constructor: no arch applies, and the one kernel family is exact (`jitllm
        compile`'s default family, fast, means the target's own)."""
        return cls()

    def cache_key(self) -> dict:
        return {"target": {"kind": "webgpu"}, "index_bits": 32, "kernels": self.kernels}

    def tvm_target(self):
        import tvm

        return tvm.target.Target({"kind": "webgpu"}, host={"kind": "llvm"})

    def linear_kernel(self, wtype: str, n: int, k: int, rows: int | None = None):
        from jitllm.lowering.kernels.webgpu.linear import linear_kernel

        return linear_kernel(wtype, n, k, rows)

    def folded_linear_kernel(self, family: str, wtype: str, n: int, k: int, eps: float = 0.0):
        """Decode matvecs with their norm / SwiGLU / residual add in the same kernel (jitllm.ir.ops): one
        dispatch where the parts took three (x², the norm, the matvec) or two."""
        from jitllm.lowering.kernels.webgpu.linear import TYPES, gemv_kernel

        return gemv_kernel(wtype, n, k, family, eps) if wtype in TYPES else None

    def rotary_kernel(self, kind):
        """RotaryQKV as one kernel (CUDA's SIMT one, shared): one dispatch where the parts took three."""
        from jitllm.lowering.kernels.cuda.basic import rotary_kernel

        return rotary_kernel(kind)

    def attention_kernel(self, kind):
        from jitllm.lowering.kernels.cuda.basic import attention_kernel

        return attention_kernel(kind)

    def split_attention_kernel(self, kind, rotary: bool = False):
        """Decode variants: one kernel for the step's attention, its KV append and (`rotary`) the rotary
        embedding (kernels/webgpu/attention.py: the chunks, then a merge dispatch; CUDA's last-arriving merge
        needs a device-scope fence WGSL has not)."""
        from jitllm.lowering.kernels.webgpu.attention import decode_attention_kernel

        return decode_attention_kernel(kind, rotary)

    def attention_workspace_shape(self, kind):
        from jitllm.lowering.kernels.webgpu.attention import workspace_shape

        return workspace_shape(kind)

    def attention_counters(self, kind):
        from jitllm.lowering.kernels.webgpu.attention import arrival_counters

        return arrival_counters(kind)

    def append_kernel(self, kind):
        from jitllm.lowering.kernels.cuda.basic import append_kernel

        return append_kernel(kind)

    def page_kernels(self, kind) -> dict:
        from jitllm.lowering.kernels.cuda.pages import page_kernels

        return page_kernels(kind)

    def embedding_kernel(self, wtype: str, vocab: int, hidden: int):
        """The tied head's embedding row gather (lowering.EMBED_FUNCTION): prompts' rows, and the pipelined
        decode step's row of the token the step before left on the device."""
        from jitllm.lowering.kernels.webgpu.linear import TYPES, embedding_kernel

        return embedding_kernel(wtype, vocab, hidden) if wtype in TYPES else None

    def argmax_kernel(self, vocab: int):
        from jitllm.lowering.kernels.webgpu.argmax import argmax_kernel

        return argmax_kernel(vocab)

    def package(self, kind, imported) -> dict:
        """The kernel package of `kind` (lowering/kernel_package.py) from `imported()`, its Relax import,
        once the kind's weight types are known to have kernels here (refused before the import: TVM
        leaves a half-built module behind when a converter raises)."""
        from jitllm.lowering.kernel_package import build_package
        from jitllm.lowering.kernels.webgpu.linear import TYPES

        missing = sorted({spec.wtype for spec in kind.linears} - set(TYPES))
        if missing:
            raise JitllmError(f"target webgpu has no kernel for {', '.join(missing)} weights yet "
                              f"({', '.join(TYPES)} only)")
        return build_package(imported(), self.tvm_target())
