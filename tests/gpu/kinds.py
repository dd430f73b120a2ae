"""The block kinds the GPU tests use, so they can be compiled ahead of time on a machine with the full
TVM (`bench/device_cache.py`, with the rest a GPU session needs) and loaded by a runtime-only TVM on the
GPU machine."""

from __future__ import annotations

from dataclasses import replace

from jitllm.ir.config import DEFAULT_KV_TYPE, ModelConfig
from jitllm.ir.head import head_kind
from jitllm.ir.llama import BLOCK_LINEARS, llama_block_kind
from jitllm.ir.moe import cache_kind
from jitllm.lowering.target import kind_for_target
from jitllm.lowering.targets.cuda import CudaTarget
from jitllm.random_model import PRESETS, preset_layout

TEST_CFG = ModelConfig("llama", 2, 64, 4, 2, 16, 128, 256, 512, 10000.0, 1e-5)
WIDE_FFN_CFG = ModelConfig("llama", 2, 64, 4, 2, 16, 4096, 256, 512, 10000.0, 1e-5)
"""Gate/up 8192 wide: the fast family's prefill takes its 128-row tensor-core tiles there."""
SPLIT_K_CFG = ModelConfig("llama", 2, 256, 4, 2, 64, 8192, 256, 512, 10000.0, 1e-5)
"""Outputs 128-divisible and narrower than 8192: the fast family's prefill GEMMs split K (the down
projection, K 8192, over 4 splits; f16 Q/K/V and O over 2) and add the splits' sums afterwards."""


GGML_32_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
"""The weight types of the first kinds (the tests index the list)."""
FORMAT_CFG = ModelConfig("llama", 2, 256, 4, 2, 64, 256, 256, 512, 10000.0, 1e-5)
"""Inputs in multiples of 256, as the K-quants need."""
NEWER_TYPES = ("bf16", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
Q4_K_M = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q4_k", "ffn_gate": "q4_k",
          "ffn_up": "q4_k", "ffn_down": "q6_k"}
"""llama.cpp's Q4_K_M mix in a block that takes Q6_K for attn_v and ffn_down (Q/K/V then stay unfused)."""


def gpu_test_kinds():
    kinds = []
    for wtype in GGML_32_TYPES:
        kinds += [llama_block_kind(TEST_CFG, {n: wtype for n in BLOCK_LINEARS}), head_kind(TEST_CFG, wtype)]
    tiny = PRESETS["tiny"]
    kinds += [llama_block_kind(tiny, {n: "q4_1" for n in BLOCK_LINEARS}), head_kind(tiny, "q4_1")]
    kinds = [kind_for_target(k, CudaTarget()) for k in kinds]  # as the CUDA target runs them
    wide = [kind_for_target(llama_block_kind(cfg, {n: w for n in BLOCK_LINEARS}), CudaTarget())
            for cfg in (WIDE_FFN_CFG, SPLIT_K_CFG) for w in ("f16", "q4_0")]  # (prefill only, after the rest: tests index the list above)
    return kinds + [k.decode_variant() for k in kinds] + wide


def f16_kv_test_kinds():
    """Block kinds over an f16 KV pool (BlockKind.kv_type), general and decode, as the CUDA target runs them:
    test_cuda.py checks their kernels against numpy over the same f16 values."""
    kinds = [kind_for_target(replace(llama_block_kind(cfg, {n: "q4_1" for n in BLOCK_LINEARS}), kv_type="f16"),
                             CudaTarget()) for cfg in (TEST_CFG, PRESETS["tiny"])]
    return kinds + [k.decode_variant() for k in kinds]


def q8_kv_test_kinds():
    """Block kinds over a q8_0 KV pool, general and decode, as the CUDA target runs them (head dims 32 and
    64: one and two blocks of 32 a row): test_cuda.py checks them against numpy over gguf's dequantization
    of the same rows, and the decode kinds' append against the quantized new rows."""
    kinds = [kind_for_target(replace(llama_block_kind(cfg, {n: "q4_1" for n in BLOCK_LINEARS}), kv_type="q8_0"),
                             CudaTarget()) for cfg in (PRESETS["tiny-d32"], FORMAT_CFG)]
    return kinds + [k.decode_variant() for k in kinds]


def kv_model_preset(kv_type: str) -> str:
    """The random model the GPU tests load at `kv_type`: tiny, or tiny-d32 for q8_0 (its blocks of 32 need
    the head dim 32; conftest's tiny_d32)."""
    return "tiny-d32" if kv_type == "q8_0" else "tiny"


def ragged_test_kinds(target, kv_type: str = DEFAULT_KV_TYPE):
    """The tiny model's ragged variants (batched steps) as a device of `target` runs them
    (test_batched_cuda.py runs them on CUDA and compares with the host's), at the KV type it loads with
    (q8_0: tiny-d32's)."""
    tiny = preset_layout(kv_model_preset(kv_type), "q4_1").with_kv_type(kv_type)
    return [kind_for_target(k, target).ragged_variant() for k in [*tiny.block_kinds, tiny.head]]


def format_test_kinds():
    """The newer weight types' kinds, as the CUDA target runs them (exact family: their linears are the same
    kernels in both), with a Q4_K_M block; decode variants after the general ones."""
    cfg = FORMAT_CFG
    kinds = [llama_block_kind(cfg, Q4_K_M)]  # (its head is the q6_k one below)
    for wtype in NEWER_TYPES:
        kinds += [llama_block_kind(cfg, {n: wtype for n in BLOCK_LINEARS}), head_kind(cfg, wtype)]
    kinds = [kind_for_target(k, CudaTarget()) for k in kinds]
    return kinds + [k.decode_variant() for k in kinds]



MOE_MODELS = (("tiny-qwen3moe", "f32"), ("tiny-qwen3moe", "q4_0"), ("tiny-mixtral", "f16"), ("tiny-mixtral", "q8_0"))
"""The random MoE models (random_model presets, weight type) test_moe_cuda.py runs on cuda:0 and on the host."""
MOE_KV_TYPE = "f32"
"""Their KV type there (f16 KV's rounding would hide the kernels' differences)."""
EXPERT_STREAMING = ("tiny-mixtral", "f16", (3, 8))
"""The model test_moe_cuda.py streams the experts of (JITLLM_GPU_STREAM=1), and its expert caches' slots:
top-k + 1, and every expert of its two blocks (the card's whole budget)."""


def moe_test_layouts():
    """The layouts of MOE_MODELS at MOE_KV_TYPE (their block kinds and head, as the host and a GPU load them)."""
    return [preset_layout(preset, wtype).with_kv_type(MOE_KV_TYPE) for preset, wtype in MOE_MODELS]


def expert_streaming_kinds(target):
    """What expert streaming runs on a device of `target` (runtime/engine/units.py load_unit and bank): each
    MoE block's experts-apart kind and its decode variant, and the expert caches' kinds."""
    preset, wtype, slot_counts = EXPERT_STREAMING
    out = []
    for kind in preset_layout(preset, wtype).with_kv_type(MOE_KV_TYPE).block_kinds:
        apart = replace(kind_for_target(kind, target), experts_apart=True)
        out += [apart, apart.decode_variant(), *[kind_for_target(cache_kind(apart, n), target) for n in slot_counts]]
    return list(dict.fromkeys(out))
