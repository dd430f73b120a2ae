"""RoPE scaling variants end to end: GGUF files declaring them the way llama.cpp writes them (Llama 3's
rope_freqs.weight included), converted, give transformers' tables for the config they came from.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from test_convert import BLOCKS, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, float_weights, write_gguf
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from jitllm.convert import convert
from jitllm.core.jlm import JlmFile
from jitllm.ir.config import ModelConfig, RopeScaling
from jitllm.ir.rope import rope_tables

THETA, CONTEXT, VOCAB, FFN = 10000.0, 256, 264, 128
GGUF_THETA = 100000.0  # test_convert.write_gguf's rope.freq_base
VARIANTS = {
    "plain": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def hf_config(rope: dict, theta: float = THETA) -> LlamaConfig:
    return LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=BLOCKS, num_attention_heads=HEADS,
                       num_key_value_heads=KV_HEADS, intermediate_size=FFN, vocab_size=VOCAB,
                       max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, initializer_range=0.6,
                       rope_parameters={**rope, "rope_theta": theta}, eos_token_id=2, bos_token_id=1)


def hf_tables(config: LlamaConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' cos and sin for positions 0.., first half of each (the halves repeat)."""
    with torch.no_grad():
        cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(positions)[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half].numpy(), sin[0, :, :half].numpy()


def llama_cpp_rope_freqs(rope: dict, theta: float) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's convert_hf_to_gguf.py writes for a llama3 config (LlamaModel.
    generate_extra_tensors): per pair, 1, the factor, or the inverse of the smooth mix between."""
    dim, factor = HEAD_DIM, rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def gguf_rope_metadata(rope: dict, attn_factor: float | None = None):
    """What convert_hf_to_gguf.py writes for `rope` (linear and yarn keys), plus llama.cpp's attn_factor."""
    def add(w: gguf.GGUFWriter) -> None:
        if rope["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            if "attention_factor" in rope:
                w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
            if "beta_fast" in rope:
                w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
                w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if attn_factor is not None:
            w.add_rope_scaling_attn_factors(attn_factor)
    return add


GGUF_CASES = {
    "llama3 rope_freqs": (VARIANTS["llama3"], None),
    "linear": (VARIANTS["linear"], None),
    "linear, attn_factor": (VARIANTS["linear"], 0.75),
    "yarn": (VARIANTS["yarn"], None),
    "yarn, every key": ({**VARIANTS["yarn"], "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25}, None),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_rope_scaling_gives_transformers_tables(case, tmp_path):
    """A GGUF's RoPE metadata (or Llama 3's rope_freqs.weight) as llama.cpp writes it from a config.json:
    the converted model's tables are transformers' tables for that config (times llama.cpp's attn_factor,
    which multiplies its cos/sin)."""
    rope, attn_factor = GGUF_CASES[case]
    weights = float_weights(tied=True)
    if rope["rope_type"] == "llama3":
        weights["rope_freqs"] = llama_cpp_rope_freqs(rope, GGUF_THETA)
    src = write_gguf(tmp_path / "m.gguf", weights, extra=gguf_rope_metadata(rope, attn_factor))
    convert(str(src), str(tmp_path / "m.jlm"), progress=False)
    cfg = ModelConfig.from_json(JlmFile(tmp_path / "m.jlm").header["config"])
    assert cfg.rope_scaling.type == rope["rope_type"]
    cos, sin = rope_tables(cfg, CONTEXT)
    want_cos, want_sin = hf_tables(hf_config(rope, GGUF_THETA), CONTEXT)
    scale = attn_factor or 1.0
    np.testing.assert_allclose(cos, want_cos * scale, atol=3e-5)
    np.testing.assert_allclose(sin, want_sin * scale, atol=3e-5)
    plain_cos, _ = rope_tables(dataclasses.replace(cfg, rope_scaling=RopeScaling()), CONTEXT)
    assert np.abs(plain_cos - cos).max() > 0.1  # the scaling changes the tables
