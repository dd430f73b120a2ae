"""RoPE scaling variants end to end: tiny random Hugging Face Llamas (one set of weights, each RoPE config)
converted and run on the CPU against transformers, and GGUF files declaring the same variants the way
llama.cpp writes them, against transformers' tables.

The variants differ only in the host's cos/sin tables, so every model here shares one compiled artifact per
kind. Their original context (64) is shorter than the prompt plus continuation (80 positions), so both sides
of it are checked. Weights are drawn wide (initializer_range 0.6) so attention, and with it RoPE, decides the
logits; the prompt's seed is one where no variant's 32 greedy tokens hit a stop token (ours would end there).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from reference import hf_greedy
from test_convert import BLOCKS, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, float_weights, write_gguf, write_hf_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from jitllm.convert import convert
from jitllm.core.jlm import JlmFile
from jitllm.ir.config import ModelConfig, RopeScaling
from jitllm.ir.rope import rope_tables

LOGIT_TOL = 1e-3
THETA, CONTEXT, VOCAB, FFN = 10000.0, 256, 264, 128
GGUF_THETA = 100000.0  # test_convert.write_gguf's rope.freq_base
VARIANTS = {
    "plain": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}
PROMPT = np.random.default_rng(19).integers(3, VOCAB, 48).tolist()
NEW_TOKENS = 32


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


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[LlamaForCausalLM, Path]]:
    """Variant -> (transformers model, the .jlm converted from its save_pretrained directory)."""
    root = tmp_path_factory.mktemp("rope")
    torch.manual_seed(0)
    weights, out = None, {}
    for name, rope in VARIANTS.items():
        hf = LlamaForCausalLM(hf_config(rope)).eval()
        weights = weights or hf.state_dict()
        hf.load_state_dict(weights)
        hf.save_pretrained(root / name)
        write_hf_tokenizer(root / name)
        convert(str(root / name), str(root / f"{name}.jlm"), progress=False)
        out[name] = hf, root / f"{name}.jlm"
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_transformers(variant, hf_models, cache_dir):
    from jitllm.model import load

    hf, path = hf_models[variant]
    # f32 KV: decode-step logits at 1e-3 (f16 KV's rounding is ~1e-2, test_real_model.py)
    model = load(path, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir, kv_type="f32")
    theirs_tokens = hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert model.generate_ids(PROMPT, NEW_TOKENS) == theirs_tokens
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT + theirs_tokens])).logits[0].numpy()
    session = model.new_session()
    ours = {19: model.executor.forward(session, PROMPT[:20]), 47: model.executor.forward(session, PROMPT[20:])}
    for at, token in enumerate(theirs_tokens[:-1], start=len(PROMPT)):
        ours[at] = model.executor.forward(session, [token])
    for at, logits in ours.items():
        assert np.abs(logits - theirs[at]).max() < LOGIT_TOL, f"position {at}"
    if variant != "plain":  # the variant matters: plain RoPE's logits for the same tokens are far off
        plain, _ = hf_models["plain"]
        with torch.no_grad():
            plain_logits = plain(torch.tensor([PROMPT + theirs_tokens])).logits[0].numpy()
        assert np.abs(plain_logits - theirs).max() > 100 * LOGIT_TOL


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
