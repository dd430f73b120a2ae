"""RoPE tables of every scaling variant against transformers' own functions (ROPE_INIT_FUNCTIONS and the
Llama rotary embedding), for config.json files in both the old (`rope_scaling`) and transformers 5
(`rope_parameters`) spelling; the header form of the scaling, old headers included."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from test_convert import float_weights, write_hf
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from jitllm.convert.hf_source import HfSource
from jitllm.core.errors import JitllmError
from jitllm.ir.config import ModelConfig, RopeScaling
from jitllm.ir.rope import inverse_frequencies, rope_tables

POSITIONS = 256
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
CONFIGS = {
    "default": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
    "linear, old keys": {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 500000.0},
    "llama3 (Llama 3.2's factors)": {"rope_parameters": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}},
    "llama3, old keys": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "yarn": {"rope_parameters": YARN},
    "yarn, betas and attention_factor": {"rope_parameters": {**YARN, "beta_fast": 16, "beta_slow": 2,
                                                             "attention_factor": 1.5}},
    "yarn, mscale and no truncation": {"rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.3,
                                                           "truncate": False}},
    "yarn, original context from the top level": {
        "rope_parameters": {k: v for k, v in YARN.items() if k != "original_max_position_embeddings"},
        "original_max_position_embeddings": 32},
    "yarn, original context defaulted": {
        "rope_parameters": {k: v for k, v in YARN.items() if k != "original_max_position_embeddings"}},
}


def both_configs(tmp_path, case: str) -> tuple[ModelConfig, LlamaConfig]:
    """One config.json (test_convert's tiny model with `case`'s RoPE keys), as jitllm's converter reads it
    and as transformers does."""
    path = write_hf(tmp_path / "hf", float_weights(tied=True))
    config = json.loads((path / "config.json").read_text())
    config.update(CONFIGS[case])
    (path / "config.json").write_text(json.dumps(config))
    return HfSource(path).config, LlamaConfig(**config)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_tables_match_transformers(tmp_path, case):
    ours, theirs = both_configs(tmp_path, case)
    rope_type = theirs.rope_parameters["rope_type"]
    init = ROPE_INIT_FUNCTIONS.get(rope_type, LlamaRotaryEmbedding.compute_default_rope_parameters)
    inv, attention = init(theirs)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rope_scaling.type == {"default": "none"}.get(rope_type, rope_type)
    np.testing.assert_allclose(inverse_frequencies(ours), inv.numpy(), rtol=2e-6)
    assert ours.rope_scaling.attention_factor == pytest.approx(attention, rel=1e-12)
    with torch.no_grad():
        cos, sin = LlamaRotaryEmbedding(theirs)(torch.zeros(1), torch.arange(POSITIONS)[None])
    half = ours.head_dim // 2
    got_cos, got_sin = rope_tables(ours, POSITIONS)
    np.testing.assert_allclose(got_cos, cos[0, :, :half].numpy(), atol=3e-5)  # (transformers' angles are f32)
    np.testing.assert_allclose(got_sin, sin[0, :, :half].numpy(), atol=3e-5)


PLAIN_HEADER = {"arch": "llama", "num_blocks": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64,
                "ffn": 1536, "vocab": 49152, "context": 8192, "rope_theta": 100000.0, "rms_eps": 1e-05,
                "tied_head": True}
"""SmolLM2's header config, as every .jlm before RoPE scaling has it (docs/model-format.md)."""


def test_headers_without_scaling_load_as_plain_rope_and_scalings_round_trip():
    plain = ModelConfig.from_json(PLAIN_HEADER)
    assert plain.rope_scaling == RopeScaling() and plain.to_json() == PLAIN_HEADER
    for scaling in (RopeScaling("llama3", 32.0, 8192, 1.0, 4.0),
                    RopeScaling("llama3", attention_factor=0.5, freq_factors=(1.0, 1.5, 8.0, 4.0) * 8),  # one per pair
                    RopeScaling("yarn", 4.0, 4096, beta_fast=16.0, truncate=False, attention_factor=1.1)):
        cfg = dataclasses.replace(plain, rope_scaling=scaling)
        assert ModelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


BAD_SCALINGS = {
    "unknown type": ({"type": "dynamic", "factor": 2.0}, "unknown rope scaling type 'dynamic' .known: none, linear"),
    "unknown field": ({"type": "linear", "factor": 2.0, "alpha": 1.0}, "unknown rope_scaling fields alpha"),
    "zero factor": ({"type": "linear", "factor": 0.0}, r"factor must be a positive number \(got 0.0\)"),
    "llama3 without its factors": ({"type": "llama3", "factor": 8.0, "original_context": 8192},
                                   "low_freq_factor must be a positive number"),
    "llama3 high <= low": ({"type": "llama3", "factor": 8.0, "original_context": 8192, "low_freq_factor": 4.0,
                            "high_freq_factor": 1.0}, "needs high_freq_factor > low_freq_factor"),
    "yarn without original context": ({"type": "yarn", "factor": 4.0}, "yarn rope scaling needs the original context"),
    "divisors on linear": ({"type": "linear", "factor": 2.0, "freq_factors": [1.0]}, "'linear' takes no frequency"),
    "negative divisor": ({"type": "llama3", "freq_factors": [1.0, -2.0]}, "frequency factors must be positive"),
}


@pytest.mark.parametrize("case", list(BAD_SCALINGS))
def test_bad_header_scaling_is_one_line(case):
    scaling, message = BAD_SCALINGS[case]
    with pytest.raises(JitllmError, match=message) as e:
        ModelConfig.from_json({**PLAIN_HEADER, "rope_scaling": scaling})
    assert "\n" not in str(e.value)
