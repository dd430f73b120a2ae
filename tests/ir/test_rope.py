"""The header form of RoPE scaling: old headers load as plain RoPE, scalings round-trip, bad ones are
one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jitllm.core.errors import JitllmError
from jitllm.ir.config import ModelConfig, RopeScaling

PLAIN_HEADER = {"arch": "llama", "num_blocks": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64,
                "ffn": 1536, "vocab": 49152, "context": 8192, "rope_theta": 100000.0, "rms_eps": 1e-05,
                "tied_head": True}
"""SmolLM2's header config, as every .jlm before RoPE scaling has it (docs/model-format.md)."""


def test_headers_without_scaling_load_as_plain_rope_and_scalings_round_trip():
    plain = ModelConfig.from_json(PLAIN_HEADER)
    assert plain.rope_scaling == RopeScaling() and plain.to_json() == PLAIN_HEADER
    for scaling in (RopeScaling("llama3", 32.0, 8192, 1.0, 4.0),
                    RopeScaling("llama3", attention_factor=0.5, freq_factors=(1.0, 1.5, 8.0)),
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
