"""Model and block configuration: plain data, shared by the converter, the IR builder and the runtime."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


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

    def to_json(self) -> dict:
        data = asdict(self)
        if not self.block_types:
            del data["block_types"]  # pure llama headers stay as they were
        else:
            data["block_types"] = list(self.block_types)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ModelConfig":
        data = dict(data)
        if "block_types" in data:
            data["block_types"] = tuple(data["block_types"])
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
