"""The ONNX Runtime target: the artifact is the block kind's ONNX graph itself (its custom ops carry their
reference bodies as model-local functions, jitllm.ir.ops), run by ONNX Runtime (runtime/backends/ort.py).
It compiles nothing, brings no kernels and so has no kernel families; its linears dequantize their
weights in the graph on every call, as the reference semantics say."""

from __future__ import annotations

from jitllm.ir.graph import OPSET
from jitllm.lowering.target import ONNX_FILE, KernelSet, TargetCaps


class OnnxRuntimeTarget(KernelSet):
    name = "onnxruntime"
    caps = TargetCaps(ONNX_FILE, fuse_linears=True, ragged_batches=True)
    """Q/K/V and gate/up stacked as on the host and CUDA: a block keeps one layout on every device, so a
    move to or from an ONNX Runtime device is one copy of its weights. Ragged variants run their reference
    bodies (and the backend's numpy append)."""
    sources = ("targets/onnxruntime.py",)
    kernels = "exact"
    """f32 throughout: ONNX Runtime runs the ops' reference bodies."""

    @classmethod
    def from_options(cls, arch: str | None, kernels: str) -> "OnnxRuntimeTarget":
        """The registry's constructor (neither a GPU arch nor a kernel family applies)."""
        return cls()

    def cache_key(self) -> dict:
        """The graph's bytes are the whole artifact; which execution provider runs it does not change it."""
        return {"target": "onnxruntime", "opset": OPSET}
