"""Model and block configuration: plain data, shared by the converter, the IR builder and the runtime."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from jitllm.core.errors import JitllmError

ROPE_TYPES = ("none", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How a model scales RoPE's frequencies (jitllm.ir.rope computes the cos/sin tables from it). Only the
    host's tables depend on it, never a block graph, so every variant shares the plain model's artifacts."""

    type: str = "none"
    """none; linear (every frequency / factor); llama3 (low frequencies / factor, high ones kept, a smooth
    ramp between); yarn (a ramp between interpolated and original frequencies, cos/sin scaled)."""
    factor: float = 1.0
    original_context: int = 0
    """llama3 and yarn: the context the model was pretrained with."""
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    """yarn: the ramp's ends rounded out to whole dims (transformers' default; llama.cpp always does)."""
    attention_factor: float = 1.0
    """Multiplies cos and sin (YaRN's attention scaling; GGUF's rope.scaling.attn_factor)."""
    freq_factors: tuple[float, ...] = ()
    """llama3 from a GGUF: its rope_freqs.weight, the divisor of each pair's frequency, which stands in for
    the formula's parameters (a GGUF does not keep them)."""

    def __post_init__(self) -> None:
        """One-line errors for a type or parameters no table can be computed from."""
        if self.type not in ROPE_TYPES:
            raise JitllmError(f"unknown rope scaling type {self.type!r} (known: {', '.join(ROPE_TYPES)})")
        formula = self.type in ("llama3", "yarn") and not self.freq_factors
        positive = {"factor": self.factor, "attention_factor": self.attention_factor}
        if formula and self.type == "llama3":
            positive["low_freq_factor"] = self.low_freq_factor
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise JitllmError(f"rope scaling {name} must be a positive number (got {value})")
        if self.freq_factors and self.type != "llama3":
            raise JitllmError(f"rope scaling {self.type!r} takes no frequency factors")
        if not all(math.isfinite(f) and f > 0 for f in self.freq_factors):
            raise JitllmError("rope scaling frequency factors must be positive numbers")
        if formula and self.original_context < 1:
            raise JitllmError(f"{self.type} rope scaling needs the original context length")
        if formula and self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise JitllmError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor (got "
                              f"{self.high_freq_factor} and {self.low_freq_factor})")

    def to_json(self) -> dict:
        """The fields that differ from plain RoPE's."""
        default = RopeScaling()
        return {f.name: list(v) if isinstance(v, tuple) else v for f in fields(self)
                if (v := getattr(self, f.name)) != getattr(default, f.name)}

    @classmethod
    def from_json(cls, data: dict) -> RopeScaling:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise JitllmError(f"unknown rope_scaling fields {', '.join(sorted(unknown))}")
        data = dict(data)
        if "freq_factors" in data:
            data["freq_factors"] = tuple(data["freq_factors"])
        return cls(**data)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a llama-family decoder."""

    arch: str
    num_blocks: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    tied_head: bool = False
    block_types: tuple[str, ...] = ()
    """Kind of each block ("llama" or "gla"); empty means every block is "llama" (all files before hybrids)."""
    rope_scaling: RopeScaling = RopeScaling()
    """Plain RoPE unless the source declares a scaling (files before it have plain RoPE)."""

    def to_json(self) -> dict:
        data = asdict(self)
        if not self.block_types:
            del data["block_types"]  # pure llama headers stay as they were
        else:
            data["block_types"] = list(self.block_types)
        del data["rope_scaling"]
        if self.rope_scaling != RopeScaling():  # (plain-RoPE headers stay as they were too)
            data["rope_scaling"] = self.rope_scaling.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ModelConfig":
        data = dict(data)
        if "block_types" in data:
            data["block_types"] = tuple(data["block_types"])
        if "rope_scaling" in data:
            data["rope_scaling"] = RopeScaling.from_json(data["rope_scaling"])
        return cls(**data)

    def block_type(self, index: int) -> str:
        return self.block_types[index] if self.block_types else "llama"


@dataclass(frozen=True)
class LinearSpec:
    """One linear layer y = x @ W.T with W of shape [out_features, in_features] stored as `wtype`."""

    name: str
    out_features: int
    in_features: int
    wtype: str


@dataclass(frozen=True)
class BlockKind:
    """Everything that decides a block's compiled artifact: shapes and weight types, never weight values."""

    kind: str  # "llama" (decoder block), "gla" (gated linear-attention block) or "head" (norm + projection)
    config: ModelConfig
    linears: tuple[LinearSpec, ...] = field(default_factory=tuple)
    page_size: int = 16
    decode: bool = False
    """A variant with batch and seq fixed to 1: GPU targets compile it beside the general kind so
    decode steps get matrix-vector schedules (the general kind serves prefill)."""
    folded: bool = False
    """The graph's norms, SwiGLU, residual adds and rotary embedding are folded ops (jitllm.ir.ops) at
    every row count, not only in decode variants: for targets with folded prefill kernels."""

    @property
    def fused(self) -> bool:
        """Q/K/V (and gate/up) stacked into one linear each (jitllm.ir.llama.fused_kind)."""
        return any(spec.name == "attn_qkv" for spec in self.linears)

    def linear(self, name: str) -> LinearSpec:
        for spec in self.linears:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def decode_variant(self) -> "BlockKind":
        return replace(self, decode=True)
