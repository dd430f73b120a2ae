"""Model and block configuration: plain data, shared by the converter, the IR builder and the runtime.

`ModelConfig.from_json` is the one gate for configs from outside (a .jlm header, a Hugging Face config.json,
a GGUF's metadata): every field typed (a string or a float is no integer, an integer no bool), unknown and
missing fields named, and the values in range; construction checks the ranges again for configs built in code.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from jitllm.core.errors import JitllmError, shown
from jitllm.ir.kv_quant import check_head_dim, row_width

ROPE_TYPES = ("none", "linear", "llama3", "yarn")
KV_DTYPES = {"f32": "float32", "f16": "float16", "q8_0": "int8"}
"""KV cache types (`-ctk/-ctv`, LoadOptions.kv_type) -> the pool tensor's dtype (q8_0: bytes, laid out as
jitllm.ir.kv_quant says). Kernels compute in f32 whatever the pool stores (jitllm.lowering.kernels.kv_store
converts on store and load)."""
DEFAULT_KV_TYPE = "f16"
"""llama.cpp's default: half of f32's bytes to keep, move and spill, at ~1e-2 in the logits."""


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
    def from_json(cls, data: object, label: str = "rope_scaling") -> RopeScaling:
        """A scaling from JSON-like data, typed field by field (`label` names the object in messages)."""
        return cls(**typed_fields(cls, data, lambda name: f"{label}.{name}", "rope_scaling"))


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
    qk_norm: bool = False
    """Attention blocks RMS-normalise each head of q and of k (weights attn_q_norm, attn_k_norm [head_dim])
    before RoPE (Qwen3)."""
    experts: int = 0
    """Routed experts of each "moe" block (jitllm.ir.moe); 0 where the model has none."""
    experts_used: int = 0
    """Experts each token is routed to (top-k of the router's softmax)."""
    expert_ffn: int = 0
    """Each expert's SwiGLU intermediate size."""
    norm_topk: bool = True
    """The top-k routing weights are renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob), else
    they stay the softmax's probabilities over every expert (OLMoE)."""
    shared_ffn: int = 0
    """Intermediate size of a shared expert every token also goes through (0: none)."""

    def to_json(self) -> dict:
        data = asdict(self)
        if not self.block_types:
            del data["block_types"]  # pure llama headers stay as they were
        else:
            data["block_types"] = list(self.block_types)
        if not self.qk_norm:
            del data["qk_norm"]  # (as do headers without q/k norms)
        if not self.experts:
            for name in MOE_FIELDS:  # (and those without experts)
                del data[name]
        del data["rope_scaling"]
        if self.rope_scaling != RopeScaling():  # (plain-RoPE headers stay as they were too)
            data["rope_scaling"] = self.rope_scaling.to_json()
        return data

    def __post_init__(self) -> None:
        check_config_values(self.__dict__, lambda name: name)

    @classmethod
    def from_json(cls, data: object, names: Mapping[str, str] | None = None) -> "ModelConfig":
        """A config from JSON-like data (a .jlm header's "config", or the values a converter read), typed and
        range-checked. `names` maps fields to the source's own names for messages (config.json's
        "num_attention_heads" for heads); the others read "config.<field>"."""
        names = names or {}

        def label(name: str) -> str:
            return names.get(name, f"config.{name}")

        values = typed_fields(cls, data, label, "config")
        check_config_values(values, label)
        return cls(**values)

    def block_type(self, index: int) -> str:
        return self.block_types[index] if self.block_types else "llama"


MOE_FIELDS = ("experts", "experts_used", "expert_ffn", "norm_topk", "shared_ffn")
POSITIVE_FIELDS = ("num_blocks", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "context")


def check_config_values(values: Mapping[str, Any], label: Callable[[str], str]) -> None:
    """Raise a one-line error where a (typed) model config's values describe no model that can run."""
    for name in POSITIVE_FIELDS:
        if values[name] < 1:
            raise JitllmError(f"{label(name)} must be a positive integer (got {values[name]})")
    if values["heads"] % values["kv_heads"]:
        raise JitllmError(f"{label('heads')} ({values['heads']}) is not a multiple of {label('kv_heads')} "
                          f"({values['kv_heads']})")
    if values["head_dim"] % 2:
        raise JitllmError(f"{label('head_dim')} must be even: rotary embedding turns pairs (got {values['head_dim']})")
    if not (math.isfinite(values["rope_theta"]) and values["rope_theta"] > 0):
        raise JitllmError(f"{label('rope_theta')} must be a positive number (got {values['rope_theta']})")
    if not (math.isfinite(values["rms_eps"]) and values["rms_eps"] >= 0):
        raise JitllmError(f"{label('rms_eps')} must be a non-negative number (got {values['rms_eps']})")
    if values["experts"]:
        for name in ("experts", "experts_used", "expert_ffn"):
            if values[name] < 1:
                raise JitllmError(f"{label(name)} must be a positive integer in a model with experts (got {values[name]})")
        if values["experts_used"] > values["experts"]:
            raise JitllmError(f"{label('experts_used')} ({values['experts_used']}) is more than "
                              f"{label('experts')} ({values['experts']}): top-k routing needs k <= experts")
    if values["shared_ffn"] < 0:
        raise JitllmError(f"{label('shared_ffn')} must be a non-negative integer (got {values['shared_ffn']})")
    pairs, factors = values["head_dim"] // 2, values["rope_scaling"].freq_factors
    if factors and len(factors) != pairs:
        raise JitllmError(f"{label('rope_scaling')} has {len(factors)} frequency factors for {pairs} "
                          f"rotated pairs (head_dim {values['head_dim']})")


def typed_fields(cls: type, data: object, label: Callable[[str], str], what: str) -> dict[str, Any]:
    """The fields of dataclass `cls` from `data` (an object of JSON values), each of its declared type: int
    (not bool), float (an int widens), bool, str, tuple[T, ...] (from a list) or RopeScaling (from an
    object), defaults filled in. Unknown and missing fields are one-line errors, as are values of another type."""
    if not isinstance(data, Mapping):
        raise JitllmError(f"{what} must be an object (got {shown(data)})")
    declared = {f.name: f for f in fields(cls)}
    unknown = sorted(str(k) for k in data if k not in declared)
    if unknown:
        raise JitllmError(f"unknown {what} fields {', '.join(unknown)}")
    hints = _type_hints(cls)
    values: dict[str, Any] = {}
    for name, f in declared.items():
        if name in data:
            values[name] = _typed(data[name], hints[name], label(name))
        elif f.default is MISSING:
            raise JitllmError(f"{label(name)} is missing")
        else:
            values[name] = f.default
    return values


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _typed(value: Any, hint: Any, label: str) -> Any:
    if hint is RopeScaling:
        return RopeScaling.from_json(value, label)
    if typing.get_origin(hint) is tuple:
        (item, _) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise JitllmError(f"{label} must be a list (got {shown(value)})")
        return tuple(_typed(v, item, f"{label}[{i}]") for i, v in enumerate(value))
    if hint is float and type(value) in (int, float):
        try:
            return float(value)
        except OverflowError:  # (an integer beyond any float)
            raise JitllmError(f"{label} must be a finite number (got {shown(value)})") from None
    if type(value) is not hint:
        kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[hint]
        raise JitllmError(f"{label} must be {kind} (got {shown(value)})")
    return value


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

    kind: str  # "llama" (decoder block), "moe" (its feed-forward routed experts), "gla" (gated linear-attention
    # block) or "head" (norm + projection)
    config: ModelConfig
    linears: tuple[LinearSpec, ...] = field(default_factory=tuple)
    page_size: int = 16
    decode: bool = False
    """A variant with batch and seq fixed to 1: GPU targets compile it beside the general kind so
    decode steps get matrix-vector schedules (the general kind serves prefill)."""
    folded: bool = False
    """The graph's norms, SwiGLU, residual adds and rotary embedding are folded ops (jitllm.ir.ops) at
    every row count, not only in decode variants: for targets with folded prefill kernels."""
    kv_type: str = "f32"
    """What the KV pool stores (a KV_DTYPES key); part of the kind since the pages input's dtype is part
    of the graph. Kinds built in code default to f32; a model's layout carries the loaded kv type."""
    ragged: bool = False
    """A variant over a ragged batch: the new rows of several sessions in one [1, rows] step (each
    session's rows consecutive, listed by row offsets), each session with its own page table and history
    length; the head's variant takes each session's last row. Batched steps run it (engine/batched.py)."""
    experts_apart: bool = False
    """An MoE kind whose routed experts run apart (expert streaming, JITLLM_GPU_STREAM=1): its graph ends at
    the router and returns what the experts need; a `moe_experts` kind over a device's expert cache runs them
    (jitllm.ir.moe, runtime/engine/streaming.py)."""

    def __post_init__(self) -> None:
        if self.kv_type not in KV_DTYPES:
            raise JitllmError(f"unknown KV cache type {self.kv_type!r} (known: {', '.join(KV_DTYPES)})")
        check_head_dim(self.kv_type, self.config.head_dim)

    @property
    def kv_dtype(self) -> str:
        """The pool tensor's dtype."""
        return KV_DTYPES[self.kv_type]

    @property
    def kv_row(self) -> int:
        """The pool's last dimension: elements of kv_dtype per position and KV head (head_dim but for q8_0)."""
        return row_width(self.kv_type, self.config.head_dim)

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

    def ragged_variant(self) -> "BlockKind":
        return replace(self, ragged=True)

    @property
    def lead(self) -> tuple:
        """The leading dims of its activations: one row (decode), rows of a ragged batch, or batch x seq."""
        return (1, 1) if self.decode else (1, "rows") if self.ragged else ("batch", "seq")
