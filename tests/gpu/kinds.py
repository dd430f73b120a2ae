"""The block kinds the GPU tests use, so they can be compiled ahead of time on a machine with the full
TVM (`bench/device_cache.py`, with the rest a GPU session needs) and loaded by a runtime-only TVM on the
GPU machine."""

from __future__ import annotations

from jitllm.ir.config import WEIGHT_TYPES, ModelConfig
from jitllm.ir.llama import BLOCK_LINEARS, head_kind, kind_for_target, llama_block_kind
from jitllm.lowering.cuda import CudaTarget
from jitllm.random_model import PRESETS

TEST_CFG = ModelConfig("llama", 2, 64, 4, 2, 16, 128, 256, 512, 10000.0, 1e-5)
WIDE_FFN_CFG = ModelConfig("llama", 2, 64, 4, 2, 16, 4096, 256, 512, 10000.0, 1e-5)
"""Gate/up 8192 wide: the fast family's prefill takes its 128-row tensor-core tiles there."""


def gpu_test_kinds():
    kinds = []
    for wtype in WEIGHT_TYPES:
        kinds += [llama_block_kind(TEST_CFG, {n: wtype for n in BLOCK_LINEARS}), head_kind(TEST_CFG, wtype)]
    tiny = PRESETS["tiny"]
    kinds += [llama_block_kind(tiny, {n: "q4_1" for n in BLOCK_LINEARS}), head_kind(tiny, "q4_1")]
    kinds = [kind_for_target(k, CudaTarget()) for k in kinds]  # as the CUDA target runs them
    wide = [kind_for_target(llama_block_kind(WIDE_FFN_CFG, {n: w for n in BLOCK_LINEARS}), CudaTarget())
            for w in ("f16", "q4_0")]  # (prefill only, after the rest: tests index the list above)
    return kinds + [k.decode_variant() for k in kinds] + wide

