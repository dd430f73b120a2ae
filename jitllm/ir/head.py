"""The head block type: final RMS norm and the projection to the vocabulary's logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jitllm.ir.block_type import NO_STATE, Inputs
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.graph import GraphBuilder, tensor_info
from jitllm.ir.layers import linear_inputs, norm_linear

if TYPE_CHECKING:
    import onnx


def head_kind(cfg: ModelConfig, wtype: str) -> BlockKind:
    return BlockKind("head", cfg, (LinearSpec("output", cfg.vocab, cfg.hidden, wtype),))


class HeadBlock:
    name = "head"
    state = NO_STATE
    head = True
    linear_names = ("output",)

    def linear_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        return {"output": (cfg.vocab, cfg.hidden)}

    def kind(self, cfg: ModelConfig, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
        return head_kind(cfg, wtypes["output"])

    def stacked_parts(self, kind: BlockKind) -> dict[str, tuple[str, ...]]:
        return {}

    def fused(self, kind: BlockKind) -> BlockKind:
        return kind

    def state_shape(self, kind: BlockKind) -> None:
        return None

    def weight_inputs(self, kind: BlockKind) -> Inputs:
        return [("output_norm", (kind.config.hidden,), "float32"), *linear_inputs(kind.linears[0])]

    def activation_inputs(self, kind: BlockKind) -> Inputs:
        """A ragged kind also takes `last_rows` [seqs]: the row whose logits each session wants."""
        x = ("x", (*kind.lead, kind.config.hidden), "float32")
        return [x, ("last_rows", ("seqs",), "int32")] if kind.ragged else [x]

    def body(self, g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
        """Decode variants (and folded kinds) take the norm folded into the projection's op; a ragged kind
        projects only the rows `last_rows` names, [1, seqs, vocab]."""
        (spec,) = kind.linears
        x = g.op("Gather", "x", "last_rows", axis=1) if kind.ragged else "x"
        g.rename(norm_linear(g, x, "output_norm", kind.config.rms_eps, spec, kind.decode or kind.folded), "logits")
        out_lead = (1, "seqs") if kind.ragged else lead
        return [tensor_info("logits", "float32", (*out_lead, spec.out_features))]


HEAD = HeadBlock()
