"""The registry of decoder block types a model may mix (ModelConfig.block_types names them per block)."""

from __future__ import annotations

from jitllm.core.errors import JitllmError
from jitllm.ir.config import BlockKind, ModelConfig
from jitllm.ir.gla import GLA_LINEARS, gla_block_kind, gla_linear_shapes
from jitllm.ir.llama import BLOCK_LINEARS, block_linear_shapes, llama_block_kind

BLOCK_TYPES = {
    "llama": (BLOCK_LINEARS, block_linear_shapes, llama_block_kind),
    "gla": (GLA_LINEARS, gla_linear_shapes, gla_block_kind),
}


def check_block_types(cfg: ModelConfig) -> None:
    """Raise a one-line error when the config's per-block types are unknown or miscounted."""
    if cfg.block_types and len(cfg.block_types) != cfg.num_blocks:
        raise JitllmError(f"config lists {len(cfg.block_types)} block types for {cfg.num_blocks} blocks")
    for i, name in enumerate(cfg.block_types):
        if name not in BLOCK_TYPES:
            raise JitllmError(f"block {i} has unknown type {name!r} (known: {', '.join(BLOCK_TYPES)})")


def block_linear_specs(cfg: ModelConfig, index: int) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear of block `index`, in the block type's order."""
    check_block_types(cfg)
    names, shapes, _ = BLOCK_TYPES[cfg.block_type(index)]
    all_shapes = shapes(cfg)
    return {n: all_shapes[n] for n in names}


def block_kind(cfg: ModelConfig, index: int, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
    """The BlockKind of block `index` given its linears' weight types."""
    check_block_types(cfg)
    return BLOCK_TYPES[cfg.block_type(index)][2](cfg, wtypes, page_size)
