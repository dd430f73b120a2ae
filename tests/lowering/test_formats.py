"""kernels/formats.py, the arithmetic the newer formats' kernels share on every target: one weight's value
(what the CUDA prefill linear and embedding gather compute per weight), built for llvm here, against
gguf.quants.dequantize of the GGML bytes its parts were repacked from."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import tvm
from reference import random_ggml
from tvm import te

from jitllm.core.layouts import HIGH_BITS, ROW_GROUP, WIDE_TYPES, high_bit_position, weight_parts
from jitllm.core.quant import parts_from_ggml
from jitllm.lowering.kernels.formats import float_weight, high_bit_slot, union_parts, weight_value
from jitllm.lowering.targets.llvm import LlvmTarget

N, K = 16, 512
R = ROW_GROUP


@pytest.mark.parametrize("wtype", ("bf16", *WIDE_TYPES))
def test_weight_value_is_ggufs_dequantization(wtype):
    raw = random_ggml(wtype, N, K, np.random.default_rng(0))
    parts = parts_from_ggml(wtype, raw, N, K)
    specs = weight_parts(wtype, N, K)
    inputs = [te.placeholder(shape, dtype, name=name) for name, shape, dtype in specs]

    def value(row, col):
        if wtype == "bf16":
            return float_weight(wtype, inputs[0][row // R, col, row % R])
        return weight_value(wtype, union_parts(wtype, inputs), row // R, row % R, col)

    w = te.compute((N, K), value, name="w")
    lib = tvm.compile(tvm.IRModule({"f": te.create_prim_func([*inputs, w]).with_attr("global_symbol", "f")}),
                      target=LlvmTarget().tvm_target())
    out = tvm.runtime.tensor(np.zeros((N, K), np.float32))
    lib["f"](*[tvm.runtime.tensor(parts[name]) for name, _, _ in specs], out)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[wtype.upper()])
    # scale * q + offset where gguf computes scale * (q - 32): equal up to one rounding of scale * q
    assert np.abs(out.numpy() - expected).max() <= 1e-6 * np.abs(expected).max()


@pytest.mark.parametrize("bits", sorted(set(HIGH_BITS.values())))
def test_high_bit_slots_follow_the_layout_and_share_a_byte_per_column(bits):
    """Elements j and 16 + j (one qs byte) keep their high bits in one qh byte, which the GPU matvec loads once."""
    for j in range(16):
        assert [high_bit_slot(j, h, bits) for h in (0, 1)] == [high_bit_position(16 * h + j, bits) for h in (0, 1)]
        assert high_bit_slot(j, 0, bits)[0] == high_bit_slot(j, 1, bits)[0]
