"""GGML blocks -> jitllm's part layouts -> floats, against gguf.quants.dequantize of the same bytes; and the
K-quant encoder's bytes against gguf's own quantizers' error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from reference import random_ggml

from jitllm.core import kquant_encode
from jitllm.core.layouts import K_QUANTS
from jitllm.core.quant import check_parts, dequantize, dequantize_rows, parts_from_float, parts_from_ggml

N, K = 24, 512  # three row groups, two K-quant super-blocks


@pytest.mark.parametrize("wtype", ["bf16", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_repacked_blocks_dequantize_as_gguf_does(wtype):
    rng = np.random.default_rng(0)
    raw = random_ggml(wtype, N, K, rng)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[wtype.upper()])
    parts = parts_from_ggml(wtype, raw, N, K)
    check_parts(wtype, N, K, parts)
    np.testing.assert_array_equal(dequantize(wtype, parts), expected)
    rows = rng.permutation(N)[:5]
    np.testing.assert_array_equal(dequantize_rows(wtype, parts, rows), expected[rows])


def test_large_matrices_are_repacked_in_row_chunks_with_the_same_result(monkeypatch):
    from jitllm.core import quant

    raw = random_ggml("q6_k", N, K, np.random.default_rng(1))
    whole = parts_from_ggml("q6_k", raw, N, K)
    monkeypatch.setattr(quant, "REPACK_ROWS", 16)  # 24 rows: a chunk and a ragged one
    chunked = parts_from_ggml("q6_k", raw, N, K)
    assert all(np.array_equal(whole[name], chunked[name]) for name in whole)


def _rms_error(wtype: str, w: np.ndarray) -> float:
    qtype = gguf.GGMLQuantizationType[wtype.upper()]
    raw = kquant_encode.quantize(wtype, w) if wtype in K_QUANTS else gguf.quants.quantize(w, qtype)
    return float(np.sqrt(np.mean((gguf.quants.dequantize(raw, qtype) - w) ** 2)))


def test_k_quant_encoder_is_as_good_as_gguf_at_the_same_bits():
    """Its blocks, read by gguf, err like gguf's own 32-block quantizers of the same width (Q4_K like
    Q4_1, Q5_K like Q5_1; Q6_K between Q8_0 and Q5_1)."""
    w = np.random.default_rng(2).standard_normal((64, 1024)).astype(np.float32)
    assert _rms_error("q4_k", w) < 1.05 * _rms_error("q4_1", w)
    assert _rms_error("q5_k", w) < 1.05 * _rms_error("q5_1", w)
    assert _rms_error("q8_0", w) < _rms_error("q6_k", w) < _rms_error("q5_1", w) / 1.5


@pytest.mark.parametrize("wtype", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_encoder_keeps_zero_blocks_and_constant_rows_finite(wtype):
    w = np.zeros((8, 512), np.float32)
    w[1] = 3.0
    w[2, :256] = -1.5
    got = dequantize(wtype, parts_from_float(wtype, w))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[0], 0)
    np.testing.assert_allclose(got[1:3], w[1:3], atol=0.03)
