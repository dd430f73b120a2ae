"""The head block type: final RMS norm and the projection to the vocabulary's logits."""

from __future__ import annotations

import onnx

from jitllm.ir.block_type import NO_STATE, Inputs
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.graph import GraphBuilder, tensor_info
from jitllm.ir.layers import linear_inputs, norm_linear


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
        batch, seq = (1, 1) if kind.decode else ("batch", "seq")
        return [("x", (batch, seq, kind.config.hidden), "float32")]

    def body(self, g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
        """Decode variants (and folded kinds) take the norm folded into the projection's op."""
        (spec,) = kind.linears
        g.rename(norm_linear(g, "x", "output_norm", kind.config.rms_eps, spec, kind.decode or kind.folded), "logits")
        return [tensor_info("logits", "float32", (*lead, spec.out_features))]


HEAD = HeadBlock()
