"""The q8_0 KV cache (llama.cpp's block_q8_0 over the head dim): its quantization against gguf's reference
quantizer, decode against f32 KV, and its pages through moves and spill/resume (converted on the host where
a device's target stores another type)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from kv_contents import f32_kv_device

from jitllm.ir.kv_quant import convert_pages, dequantize_q8_0, quantize_q8_0, row_width
from jitllm.model import load
from jitllm.runtime.backends.fake import simulated_device

PROMPT = list(range(4, 30))
LOGIT_TOL = 0.25
"""q8_0 against f32 KV, tiny_d32 (random weights, logits' std ~8), max |dlogit| over 8 decode steps:
measured 0.117 (0.05-0.06 on most steps; f16 KV 0.0043 on the same steps)."""


def _gguf_rows(values: np.ndarray) -> np.ndarray:
    """gguf's Q8_0 blocks (2 scale bytes, 32 quants) of f32 rows [n, D], as our rows (quants, then scales)."""
    n, d = values.shape
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0).reshape(n, d // 32, 34)
    return np.concatenate([blocks[..., 2:].reshape(n, d), blocks[..., :2].reshape(n, d // 16)], axis=1).view(np.int8)


def test_q8_0_rows_match_gguf_quantize_and_dequantize():
    """Ties at .5 (rounded away from zero), all-zero blocks, large and tiny magnitudes: bit for bit."""
    rng = np.random.default_rng(2)
    values = (rng.standard_normal((64, 64)) * rng.uniform(1e-3, 1e3, (64, 1))).astype(np.float32)
    values[::5] = np.round(values[::5] * 2) / 2
    values[3, :32] = 0
    rows = quantize_q8_0(values)
    assert rows.shape == (64, row_width("q8_0", 64)) == (64, 68)
    assert np.array_equal(rows, _gguf_rows(values))
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequantize_q8_0(rows), gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))


def test_pages_convert_between_q8_0_and_f16_or_f32():
    """f16 -> q8_0 quantizes the f16 values as gguf does; q8_0 -> f32 -> q8_0 gives the same rows back
    (d * q is exact in f32, and requantizing it finds d and q again)."""
    rng = np.random.default_rng(4)
    f16 = rng.standard_normal((3, 2, 1, 4, 64)).astype(np.float16)
    q8 = convert_pages(f16, "f16", "q8_0", "int8")
    assert q8.shape == (3, 2, 1, 4, 68)
    assert np.array_equal(q8.reshape(-1, 68), _gguf_rows(f16.reshape(-1, 64).astype(np.float32)))
    back = convert_pages(q8, "q8_0", "f16", "float16")
    assert back.dtype == np.float16 and np.abs(back.astype(np.float32) - f16).max() < 0.02
    wide = convert_pages(q8, "q8_0", "f32", "float32")
    assert np.array_equal(convert_pages(wide, "f32", "q8_0", "int8"), q8)


def test_q8_0_decode_stays_close_to_f32_kv(tiny_d32, cache_dir):
    """The same 8 decode steps after a prompt: q8_0 pages (quantized as appended, the prompt's own keys
    attended at f32 in its step) against f32 pages."""
    f32 = load(tiny_d32, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type="f32")
    q8 = load(tiny_d32, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type="q8_0")
    assert q8.executor.pools["host"].dtype == "int8" and q8.executor.blocks[0].kind.kv_type == "q8_0"
    a, b = f32.executor.new_session(), q8.executor.new_session()
    assert np.abs(f32.executor.forward(a, PROMPT) - q8.executor.forward(b, PROMPT)).max() < 1e-4  # (prefill)
    worst = 0.0
    for token in range(40, 48):
        worst = max(worst, float(np.abs(f32.executor.forward(a, [token]) - q8.executor.forward(b, [token])).max()))
    assert 0 < worst < LOGIT_TOL



def _load_q8(path, cache_dir):
    return load(path, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type="q8_0",
                extra_devices=[simulated_device("sim:0"), f32_kv_device()])


@pytest.mark.parametrize("direct_runs", [32, 0], ids=["page-runs-copied", "pages-gathered-and-scattered"])
def test_moves_carry_q8_0_pages(tiny_d32, cache_dir, direct_runs, monkeypatch):
    """To a device of the same type (the bytes copied, or exported and imported by the page kernels) and to an
    f32-only one and back (dequantized there, quantized again on the way back, which gives the same rows):
    every step equals the same session's on the host alone."""
    monkeypatch.setattr("jitllm.runtime.engine.migration.DIRECT_RUNS", direct_runs)
    model = _load_q8(tiny_d32, cache_dir)
    ex = model.executor
    moved, alone = ex.new_session(), ex.new_session()
    ex.forward(moved, PROMPT)
    ex.forward(alone, PROMPT)
    host_pool = ex.pools["host"]
    (report,) = model.move("0", "sim:0")
    assert ex.pools["sim:0"].dtype == "int8" and report.kv_bytes == 4 * host_pool.page_bytes
    assert host_pool.page_bytes == 2 * 1 * 16 * 34  # K and V, 1 KV head, 16 positions, 34 bytes a row
    for token, where in ((7, "sim:f32"), (8, "host"), (9, "sim:f32"), (10, "host")):
        assert np.array_equal(ex.forward(moved, [token]), ex.forward(alone, [token]))
        model.move("0", where)
        assert ex.blocks[0].kind.kv_type == ("f32" if where == "sim:f32" else "q8_0")
    assert ex.pools["sim:f32"].dtype == "float32"
    assert np.array_equal(ex.forward(moved, [11]), ex.forward(alone, [11]))


def test_a_spilled_q8_0_session_resumes(tiny_d32, cache_dir):
    """Spilled q8_0 pages resume into the host's q8_0 pool, and into an f32 pool where the block moved
    meanwhile (dequantized on the way); the next steps equal an unspilled session's."""
    from jitllm.runtime.engine.spill import resume, spill

    model = _load_q8(tiny_d32, cache_dir)
    ex = model.executor
    spilled, alone = ex.new_session(), ex.new_session()
    ex.forward(spilled, PROMPT)
    ex.forward(alone, PROMPT)
    kept = spill(ex, spilled)
    assert kept.pages[0].dtype == np.int8 and kept.kv_types == {0: "q8_0", 1: "q8_0"}
    assert resume(ex, spilled, kept)
    assert np.array_equal(ex.forward(spilled, [7]), ex.forward(alone, [7]))
    kept = spill(ex, spilled)
    model.move("0", "sim:f32")
    assert resume(ex, spilled, kept)
    assert np.array_equal(ex.forward(spilled, [8]), ex.forward(alone, [8]))
