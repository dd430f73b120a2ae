"""RoPE's inverse frequencies and cos/sin tables for every scaling variant (ModelConfig.rope_scaling), as
transformers' ROPE_INIT_FUNCTIONS and rotary embedding compute them, in float64.

The blocks take the tables as inputs (jitllm.ir.llama), so a variant changes what the host feeds them,
never a graph: no recompile."""

from __future__ import annotations

import math

import numpy as np

from jitllm.core.errors import JitllmError

from jitllm.ir.config import ModelConfig, RopeScaling


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim / 2] float64: the angle each rotated pair turns by per position."""
    s, dim = cfg.rope_scaling, cfg.head_dim
    inv = cfg.rope_theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if s.type == "linear":
        return inv / s.factor
    if s.type == "llama3":
        return inv / np.asarray(s.freq_factors) if s.freq_factors else _llama3(inv, s)
    if s.type == "yarn":
        return _yarn(inv, s, dim, cfg.rope_theta)
    return inv


def rope_tables(cfg: ModelConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, head_dim / 2] float32 of every position's angles, times the attention factor."""
    angles = np.arange(positions, dtype=np.float64)[:, None] * inverse_frequencies(cfg)
    scale = cfg.rope_scaling.attention_factor
    return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's scaling of cos/sin where a config gives no attention_factor (0.1 ln(factor) + 1, or the ratio
    of two such terms where `mscale` and `mscale_all_dim` are both set, as DeepSeek's configs do)."""

    def get(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if not (mscale and mscale_all_dim):
        return get(1.0)
    if get(mscale_all_dim) == 0:
        raise JitllmError(f"rope scaling mscale_all_dim {mscale_all_dim} with factor {factor} makes YaRN's "
                          "attention factor divide by zero")
    return get(mscale) / get(mscale_all_dim)


def _llama3(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Wavelengths beyond original_context / low_freq_factor slowed by the factor, those below
    original_context / high_freq_factor kept, a smooth mix between."""
    wavelen = 2 * math.pi / inv
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mixed = (1 - smooth) * inv / s.factor + smooth * inv
    slowed = np.where(wavelen > s.original_context / s.low_freq_factor, inv / s.factor, mixed)
    return np.where(wavelen < s.original_context / s.high_freq_factor, inv, slowed)


def _yarn(inv: np.ndarray, s: RopeScaling, dim: int, theta: float) -> np.ndarray:
    """Pairs that turn more than beta_fast times over the original context keep their frequency, those
    turning fewer than beta_slow times are interpolated (/ factor), a linear ramp between."""

    def dim_of(rotations: float) -> float:
        return dim * math.log(s.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low if high != low else 0.001), 0, 1)
    return inv / s.factor * ramp + inv * (1 - ramp)
