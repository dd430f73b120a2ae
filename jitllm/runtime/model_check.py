"""What a .jlm's config asks of the rest of its header, checked when the file is opened (before any
compile): the "weights" entry typed and naming each block type's linears, every matrix storable in its
layout, and the file holding exactly the tensors the model reads, each of the shape and dtype its layout
gives. (jitllm.core.jlm_validate has already checked that every tensor lies inside the file.)"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from jitllm.core.errors import JitllmError, shown
from jitllm.core.jlm import TensorEntry
from jitllm.core.layouts import WEIGHT_TYPES, check_linear_shape
from jitllm.ir.blocks import block_linear_specs
from jitllm.ir.config import LinearSpec, ModelConfig

WeightTypes = tuple[str, str, list[dict[str, str]]]
"""(embedding type, head type, each block's linear -> type)."""


def weight_types(weights: object, cfg: ModelConfig) -> WeightTypes:
    """The header's "weights" entry, typed: a known type for the embedding, the head (the embedding's when
    the head is tied) and exactly the linears of each block's type."""
    if not isinstance(weights, dict):
        raise JitllmError(f"weights must be an object (got {shown(weights)})")
    embedding, head = _wtype(weights.get("token_embd"), "weights.token_embd"), _wtype(weights.get("output"), "weights.output")
    if cfg.tied_head and head != embedding:
        raise JitllmError(f"weights.output is {head!r} but the head is tied to the {embedding!r} embedding")
    blocks = weights.get("blocks")
    if not isinstance(blocks, list):
        raise JitllmError(f"weights.blocks must be a list (got {shown(blocks)})")
    if len(blocks) != cfg.num_blocks:
        raise JitllmError(f"header lists {len(blocks)} blocks, config says {cfg.num_blocks}")
    for i, block in enumerate(blocks):
        linears = list(block_linear_specs(cfg, i))
        if not isinstance(block, dict) or sorted(block) != sorted(linears):
            raise JitllmError(f"weights.blocks[{i}] must give the type of {', '.join(linears)} "
                              f"(got {shown(block)})")
        for name in linears:
            _wtype(block[name], f"weights.blocks[{i}].{name}")
    return embedding, head, blocks


def check_linears(linears: Iterable[tuple[str, LinearSpec]]) -> None:
    """Every (tensor name, linear) storable in its weight type's layout (rows in groups of 8, inputs in
    whole quantization blocks)."""
    for name, spec in linears:
        if reason := check_linear_shape(name, spec.wtype, spec.out_features, spec.in_features):
            raise JitllmError(reason)


def check_tensors(tensors: Mapping[str, TensorEntry], expected: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """The file's tensors are exactly `expected` (name -> shape, dtype)."""
    for name, (shape, dtype) in expected.items():
        entry = tensors.get(name)
        if entry is None:
            raise JitllmError(f"tensor {name} is missing")
        if entry.shape != tuple(shape) or entry.dtype != dtype:
            raise JitllmError(f"tensor {name} is {list(entry.shape)} {entry.dtype}, the config needs "
                              f"{list(shape)} {dtype}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise JitllmError(f"tensor {shown(extra[0])} is no weight of this model"
                          + (f" (nor are {len(extra) - 1} more)" if len(extra) > 1 else ""))


def _wtype(value: object, label: str) -> str:
    if value not in WEIGHT_TYPES:
        raise JitllmError(f"{label} is {shown(value)}, not a weight type ({', '.join(WEIGHT_TYPES)})")
    return value
