"""Every block kind: TVM (llvm) vs ONNX Runtime on the same ONNX graph vs an independent numpy reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from reference import block_forward, head_forward, paged_inputs, random_weights

from jitllm.core.layouts import K_QUANTS, WEIGHT_TYPES
from jitllm.ir.blocks import activation_inputs, build_block_graph, weight_inputs
from jitllm.ir.config import ModelConfig
from jitllm.ir.head import head_kind
from jitllm.ir.llama import BLOCK_LINEARS, fused_kind, llama_block_kind
from jitllm.lowering.cache import get_artifact
from jitllm.lowering.targets.llvm import LlvmTarget
from jitllm.runtime.backends.tvm_tensors import load_program

CFG = ModelConfig("llama", 2, 64, 4, 2, 16, 128, 256, 512, 10000.0, 1e-5)
K_CFG = ModelConfig("llama", 2, 256, 4, 2, 64, 256, 256, 512, 10000.0, 1e-5)
"""Inputs in multiples of 256, for the K-quants."""
Q8_CFG = ModelConfig("llama", 2, 64, 2, 1, 32, 128, 256, 512, 10000.0, 1e-5)
"""Head dim 32: q8_0 KV's blocks tile it."""
VARIANTS = ("separate", "fused", "fused-decode", "fused-folded")
NEWER_TYPES = ("bf16", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
"""Run in the kinds the llvm target compiles (fused, and its decode variant): their ONNX bodies are the
same function in every linear family, checked on their own in test_dequant.py."""
CASES = [(w, v) for w in WEIGHT_TYPES for v in VARIANTS if w not in NEWER_TYPES or v in ("fused", "fused-decode")]


def cfg_for(wtype: str) -> ModelConfig:
    return K_CFG if wtype in K_QUANTS else CFG
SHAPES = [(1, 5, [0]), (1, 1, [37]), (2, 3, [16, 5]), (3, 1, [1, 40, 15])]
DECODE_SHAPES = [(1, 1, [0]), (1, 1, [37])]
TOL = 2e-5


def _run_both(kind, cache_dir, feeds):
    session = ort.InferenceSession(build_block_graph(kind).SerializeToString())
    got_ort = session.run(None, feeds)
    program = load_program(get_artifact(kind, LlvmTarget(), cache_dir).path, tvm.cpu(), kind.kind == "llama")
    names = [n for n, _, _ in activation_inputs(kind) + weight_inputs(kind)]
    out = program.main(*[tvm.runtime.tensor(feeds[n]) for n in names])
    got_tvm = [o.numpy() for o in out] if kind.kind == "llama" else [out.numpy()]
    return got_ort, got_tvm, program


@pytest.mark.parametrize("wtype,variant", CASES)
def test_decoder_block(wtype, variant, cache_dir):
    """The fused decode variant's graph (and a folded kind's at any row count) folds norms, residuals,
    SwiGLU and rotary into jitllm ops: ONNX Runtime runs their function bodies (RotaryPagedAttention's
    calls two more functions), TVM (llvm) lowers them to their parts."""
    _check_decoder_block(wtype, variant, cache_dir, "f32")


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_block_over_an_f16_pool(variant, cache_dir):
    """An f16 KV pool (BlockKind.kv_type): both the reference bodies and the llvm kernels read its values
    as f32, so they match numpy over the same values at the f32 tolerance."""
    _check_decoder_block("q4_1", variant, cache_dir, "f16")


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_block_over_a_q8_0_pool(variant, cache_dir):
    """A q8_0 KV pool (head dim 32: one block per row): the reference bodies decode its quants and f16 scales
    in ONNX ops, the llvm kernels in TIR; both match numpy over gguf's dequantization of the same rows."""
    _check_decoder_block("q4_1", variant, cache_dir, "q8_0", Q8_CFG)


def _check_decoder_block(wtype: str, variant: str, cache_dir, kv_type: str, cfg: ModelConfig | None = None) -> None:
    kind = dataclasses.replace(llama_block_kind(cfg or cfg_for(wtype), {n: wtype for n in BLOCK_LINEARS}),
                               kv_type=kv_type)
    if variant != "separate":
        kind = fused_kind(kind)
        assert [s.name for s in kind.linears] == ["attn_qkv", "attn_output", "ffn_gate_up", "ffn_down"]
    if variant == "fused-folded":
        kind = dataclasses.replace(kind, folded=True)
    if variant in ("fused-decode", "fused-folded"):
        kind = kind.decode_variant() if variant == "fused-decode" else kind
        ops = {n.op_type for n in build_block_graph(kind).graph.node}
        assert {f"RmsNormLinear_{wtype}", f"LinearAdd_{wtype}", f"SwiGLULinearAdd_{wtype}"} <= ops
        # decode variants: rotary embedding and attention as one op (a GPU rotates as its attention reads)
        rotary = {"RotaryPagedAttention"} if kind.decode else {"RotaryQKV", "PagedAttention"}
        assert rotary <= ops and not ({"RotaryQKV", "PagedAttention", "RotaryPagedAttention"} - rotary) & ops
    rng = np.random.default_rng(7)
    weights = random_weights(kind, rng)
    for batch, seq, pasts in DECODE_SHAPES if kind.decode else SHAPES:
        inputs = paged_inputs(kind, rng, batch, seq, pasts)
        got_ort, got_tvm, _ = _run_both(kind, cache_dir, {**inputs, **weights})
        ref = block_forward(kind, weights, **inputs)
        for name, a, b, r in zip(("y", "k_new", "v_new"), got_ort, got_tvm, ref):
            assert np.abs(a - r).max() < TOL, (wtype, batch, seq, pasts, name, "onnxruntime")
            assert np.abs(b - r).max() < TOL, (wtype, batch, seq, pasts, name, "tvm")


@pytest.mark.parametrize("decode", [False, True], ids=["general", "decode"])
@pytest.mark.parametrize("wtype", ["q8_0", "q4_1", "f16", "bf16", "q6_k"])
def test_head(wtype, decode, cache_dir):
    cfg = cfg_for(wtype)
    kind = head_kind(cfg, wtype).decode_variant() if decode else head_kind(cfg, wtype)
    rng = np.random.default_rng(3)
    weights = random_weights(kind, rng)
    for batch, seq in [(1, 1)] if decode else [(1, 1), (2, 3)]:
        x = rng.standard_normal((batch, seq, cfg.hidden)).astype(np.float32)
        got_ort, got_tvm, _ = _run_both(kind, cache_dir, {"x": x, **weights})
        ref = head_forward(kind, weights, x)
        assert np.abs(got_ort[0] - ref).max() < TOL
        assert np.abs(got_tvm[0] - ref).max() < TOL


def test_append_writes_through_the_page_table(cache_dir):
    kind = llama_block_kind(CFG, {n: "q8_0" for n in BLOCK_LINEARS})
    rng = np.random.default_rng(11)
    inputs = paged_inputs(kind, rng, 2, 3, [14, 31])
    feeds = {**inputs, **random_weights(kind, rng)}
    _, (y, k, v), program = _run_both(kind, cache_dir, feeds)
    pages = tvm.runtime.tensor(inputs["pages"])
    program.append(pages, tvm.runtime.tensor(k), tvm.runtime.tensor(v),
                   tvm.runtime.tensor(inputs["page_table"]), tvm.runtime.tensor(inputs["past"]))
    after = pages.numpy()
    p = kind.page_size
    touched = set()
    for b, past in enumerate([14, 31]):
        for s in range(3):
            t = past + s
            page = inputs["page_table"][b, t // p]
            touched.add((page, t % p))
            assert np.array_equal(after[page, 0, :, t % p], k[b, s])
            assert np.array_equal(after[page, 1, :, t % p], v[b, s])
    for page in range(after.shape[0]):
        for slot in range(p):
            if (page, slot) not in touched:
                assert np.array_equal(after[page, :, :, slot], inputs["pages"][page, :, :, slot])


def test_fusion_needs_matching_weight_types():
    mixed = llama_block_kind(CFG, {**{n: "q4_1" for n in BLOCK_LINEARS}, "attn_v": "q8_0"})
    assert fused_kind(mixed) is mixed
