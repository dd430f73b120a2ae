"""The registry of block types (one module each) and what every caller asks of a block kind through
its type: its weight and activation inputs and its ONNX graph."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from jitllm.core.errors import JitllmError
from jitllm.core.layouts import weight_parts
from jitllm.ir.block_type import BlockType, Inputs
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.gla import GLA
from jitllm.ir.graph import DOMAIN, OPSET, GraphBuilder, tensor_info
from jitllm.ir.head import HEAD
from jitllm.ir.llama import LLAMA
from jitllm.ir.moe import MOE, MOE_EXPERTS
from jitllm.ir.ops import functions_for

if TYPE_CHECKING:
    import onnx

BLOCK_TYPES: dict[str, BlockType] = {
    "llama": LLAMA,
    "moe": MOE,
    "gla": GLA,
    "head": HEAD,
}

PART_TYPES: dict[str, BlockType] = {
    "moe_experts": MOE_EXPERTS,
}
"""Types that run part of a model's block, never named by a model (an MoE block's experts over an expert cache)."""


def block_type(kind: BlockKind) -> BlockType:
    return BLOCK_TYPES.get(kind.kind) or PART_TYPES[kind.kind]


def weight_inputs(kind: BlockKind) -> Inputs:
    """(graph input name, shape, dtype) of every weight of a block kind, in call order."""
    return block_type(kind).weight_inputs(kind)


def activation_inputs(kind: BlockKind) -> Inputs:
    """The non-weight inputs (symbolic dims by name)."""
    return block_type(kind).activation_inputs(kind)


def build_block_graph(kind: BlockKind) -> onnx.ModelProto:
    """The ONNX model of one block kind: its type's body over its inputs, with the model-local functions
    (jitllm.ir.ops) its custom ops call."""
    from onnx import helper

    g = GraphBuilder()
    outputs = block_type(kind).body(g, kind, kind.lead)
    inputs = [tensor_info(n, d, s) for n, s, d in activation_inputs(kind) + weight_inputs(kind)]
    graph = helper.make_graph(g.nodes, f"jitllm_{kind.kind}", inputs, outputs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
        functions=functions_for(g.nodes, kind.kv_type),
        producer_name="jitllm",
        ir_version=9,
    )


def _decoder_type(cfg: ModelConfig, index: int) -> BlockType:
    """The type of decoder block `index` (one-line errors for unknown or miscounted types)."""
    check_block_types(cfg)
    return BLOCK_TYPES[cfg.block_type(index)]


def check_block_types(cfg: ModelConfig) -> None:
    """Raise a one-line error when the config's per-block types are unknown or miscounted."""
    if cfg.block_types and len(cfg.block_types) != cfg.num_blocks:
        raise JitllmError(f"config lists {len(cfg.block_types)} block types for {cfg.num_blocks} blocks")
    decoders = [name for name, t in BLOCK_TYPES.items() if not t.head]
    for i, name in enumerate(cfg.block_types):
        if name not in decoders:
            raise JitllmError(f"block {i} has unknown type {name!r} (known: {', '.join(decoders)})")


def block_linear_specs(cfg: ModelConfig, index: int) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear of block `index`, in the block type's order."""
    t = _decoder_type(cfg, index)
    shapes = t.linear_shapes(cfg)
    return {n: shapes[n] for n in t.linear_names if n in shapes}  # (the config may leave some out: a shared expert)


def linear_of_input(kind: BlockKind) -> dict[str, tuple[str, str]]:
    """Weight input name -> (its linear's name, the part it is) for every input that is a linear's part."""
    return {f"{spec.name}_{part}": (spec.name, part) for spec in kind.linears
            for part, _, _ in weight_parts(spec.wtype, spec.out_features, spec.in_features)}


@dataclass(frozen=True)
class FileWeight:
    """One weight of a block as its file holds it: a linear (`spec`; an MoE block's stacked experts are
    one each) or another float32 tensor (`spec` None: a norm, the router)."""

    name: str
    shape: tuple[int, ...]
    spec: LinearSpec | None
    linear: str | None = None
    """The kind's linear it is (or is one expert of)."""
    expert: int | None = None
    """The expert it belongs to: in the file, each expert's tensors are one aligned page of the block's
    region (jitllm.core.jlm_writer); None for the block's own tensors."""


def block_file_weights(kind: BlockKind, index: int) -> list[FileWeight]:
    """What the file holds for block `index` of `kind` (an unfused kind), in call order."""
    parts, done = linear_of_input(kind), set()
    stacked = block_type(kind).stacked_parts(kind)
    out: list[FileWeight] = []
    for name, shape, _ in weight_inputs(kind):
        if name not in parts:
            out.append(FileWeight(f"blk.{index}.{name}", shape, None))
        elif (linear := parts[name][0]) not in done:
            done.add(linear)
            spec = kind.linear(linear)
            pieces = stacked.get(linear, (linear,))
            rows = spec.out_features // len(pieces)
            for e, piece in enumerate(pieces):
                one = replace(spec, name=piece, out_features=rows)
                out.append(FileWeight(f"blk.{index}.{piece}", (rows, spec.in_features), one, linear,
                                      e if len(pieces) > 1 else None))
    return out


def block_kind(cfg: ModelConfig, index: int, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
    """The BlockKind of block `index` given its linears' weight types."""
    return _decoder_type(cfg, index).kind(cfg, wtypes, page_size)
