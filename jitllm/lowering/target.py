"""The Target protocol: what a compile target declares (its capabilities), the kernels it brings for
jitllm's custom ops (its kernel set) and the kind of artifact it leaves in the cache.

A target is one file in lowering/targets/ and one line in that package's registry. Callers read a
target's `caps` and call its kernel methods; they never probe its attributes or compare its name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import tvm

from jitllm.ir.blocks import block_type
from jitllm.ir.config import BlockKind

SHARED_LIBRARY = "shared-library"
"""A TVM executable exported as one .so (llvm, cuda)."""
KERNEL_PACKAGE = "kernel-package"
"""Kernel sources and a launch plan for a runtime that compiles them itself (webgpu's WGSL)."""
ONNX_FILE = "onnx"
"""The block's ONNX graph itself, run by a runtime that takes ONNX (ONNX Runtime)."""
ARTIFACT_SUFFIXES = {SHARED_LIBRARY: ".so", KERNEL_PACKAGE: ".kernels", ONNX_FILE: ".onnx"}
"""(Not .json, the suffix of every artifact's sidecar beside it.)"""


@dataclass(frozen=True)
class TargetCaps:
    """What a target offers, declared once (callers read these instead of probing the target)."""

    artifact: str = SHARED_LIBRARY
    """The artifact format: one of ARTIFACT_SUFFIXES."""
    fuse_linears: bool = False
    """Q/K/V and gate/up stacked into one linear each (jitllm.ir.llama.fused_kind)."""
    fold_prefill: bool = False
    """Prefill graphs take the folded ops (BlockKind.folded): the target has prefill kernels for them."""
    decode_variants: bool = False
    """A batch-1, seq-1 variant of each kind is compiled beside it and runs decode steps (BlockKind.decode)."""
    decode_appends_kv: bool = False
    """A decode variant's `main` writes the step's K and V into the pages itself (no append call after it)."""
    ragged_batches: bool = False
    """It compiles ragged variants (BlockKind.ragged): one step over the rows of many sessions."""
    index_bits: int = 64
    """Width of the integers kernels index with (WGSL has no 64-bit integers)."""
    kernels_flag: str | None = None
    """The CLI flag that picks the target's kernel family (`cpu-kernels`), where it has families."""
    kv_types: tuple[str, ...] = ("f32", "f16", "q8_0")
    """The KV cache types its pools store (BlockKind.kv_type; q8_0: llama.cpp's blocks, jitllm.ir.kv_quant);
    f32 always. A block whose kind asks for another stores f32 on this target (kind_for_target), its pages
    converted when it moves."""


class KernelSet:
    """One method per custom op of jitllm.ir.ops (and per helper function compiled beside `main`), each
    returning `(symbol, PrimFunc)` or None where the target has no kernel of its own for it (the import
    then lowers the op through its parts, or says the target cannot take the block)."""

    def linear_kernel(self, wtype: str, n: int, k: int, rows: int | None = None):
        """y = x @ W.T over `rows` rows (None: any number)."""
        return None

    def folded_linear_kernel(self, family: str, wtype: str, n: int, k: int, eps: float = 0.0):
        """A one-row linear with its norm / SwiGLU / residual add folded in (jitllm.ir.ops)."""
        return None

    def prefill_linear_kernel(self, family: str, wtype: str, n: int, k: int, eps: float = 0.0):
        """A folded linear over any number of rows, as one kernel."""
        return None

    def prefill_gemm_kernels(self, family: str, wtype: str, n: int, k: int, eps: float = 0.0):
        """A folded linear over any number of rows as an operand pass, a GEMM and a split sum (PrefillGemm)."""
        return None

    def rotary_kernel(self, kind: BlockKind):
        """RotaryQKV as one kernel over any number of tokens."""
        return None

    def attention_kernel(self, kind: BlockKind):
        """PagedAttention over any number of new tokens."""
        return None

    def ragged_attention_kernel(self, kind: BlockKind):
        """RaggedPagedAttention: the rows of several sequences, each over its own pages (ragged variants)."""
        return None

    def split_attention_kernel(self, kind: BlockKind, rotary: bool = False):
        """Decode attention split over chunks of the history (with `rotary`, from the fused projection);
        where there is one, `attention_workspace_shape` and `attention_counters` describe its buffers."""
        return None

    def attention_workspace_shape(self, kind: BlockKind):
        return None

    def attention_counters(self, kind: BlockKind):
        return None

    def append_kernel(self, kind: BlockKind):
        """The KV append compiled beside a decoder block's `main` (lowering.APPEND_FUNCTION)."""
        return None

    def ragged_append_kernel(self, kind: BlockKind):
        """The KV append of a ragged variant (each sequence's rows at its own positions)."""
        return None

    def page_kernels(self, kind: BlockKind) -> dict:
        """The page export/import kernels compiled beside a decoder block, by function name."""
        return {}

    def moe_kernel(self, wtypes: tuple[str, str, str], experts: int, ffn: int, hidden: int, top_k: int,
                   slots: int = 0):
        """MoeSwiGLU (routed experts) over any number of tokens, reading only the routed experts; with
        `slots`, MoeSwiGLUSlots: the weights hold that many experts, and a slot map (after the routing
        weights) says which slot holds each expert. The parameters after the inputs are float32 [M, ...]
        outputs, y the last; any before it are scratch the kernel's launches pass on (CUDA's activations)."""
        return None

    def recurrence_kernel(self, kind: BlockKind):
        """GatedRecurrence, updating the state in place."""
        return None

    def embedding_kernel(self, wtype: str, vocab: int, hidden: int):
        """The head's embedding row gather (lowering.EMBED_FUNCTION)."""
        return None

    def argmax_kernel(self, vocab: int):
        """The greedy pick beside a head's decode `main` (lowering.ARGMAX_FUNCTION)."""
        return None


class Target(Protocol):
    """A compile target (see the module docstring); kernel methods as KernelSet's."""

    name: str
    caps: TargetCaps
    kernels: str
    """Its kernel family ("fast" or "exact"; targets without families say "fast")."""
    sources: tuple[str, ...]
    """Files and folders (relative to jitllm/lowering) its artifacts are generated from: their contents
    are part of every artifact's cache key."""

    def cache_key(self) -> dict: ...

    def build(self, mod: tvm.IRModule):
        """Compile an imported block (SHARED_LIBRARY targets only; the others' artifacts are not built by TVM)."""
        ...


def kv_type_on(kv_type: str, target: Target) -> str:
    """The KV cache type a pool of `target` stores for a model loaded with `kv_type`: f32 where the
    target lacks that type."""
    return kv_type if kv_type in target.caps.kv_types else "f32"


def kind_for_target(kind: BlockKind, target: Target) -> BlockKind:
    """The kind as `target` compiles it: its KV type where the target stores it (else f32), Q/K/V and
    gate/up stacked where it fuses linears, and then the prefill graph's small ops folded into the
    linears and the rotary op where it folds prefill."""
    if kind.kv_type != kv_type_on(kind.kv_type, target):
        kind = replace(kind, kv_type="f32")
    if not target.caps.fuse_linears:
        return kind
    fused = block_type(kind).fused(kind)
    if target.caps.fold_prefill and fused.fused:
        return replace(fused, folded=True)
    return fused
