"""The gated linear-attention (GLA) block kind: a recurrent token mixer in place of attention.

x -> RMSNorm -> q, k, v, gate projections -> per head a D x D state S (the GatedRecurrence op)
S_t = diag(sigmoid(gate_t)) S_{t-1} + k_t^T v_t,  o_t = (q_t / sqrt(D)) S_t -> output projection,
residual, then the llama block's SwiGLU feed-forward. The state is the block's only memory of the
past: [batch, heads, D, D] float32, a fixed size whatever the history length (no KV pages).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jitllm.ir.block_type import RECURRENT, Inputs
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.graph import DOMAIN, GraphBuilder, tensor_info
from jitllm.ir.layers import decoder_weight_inputs, ffn, ffn_linear_shapes, linear, norm
from jitllm.ir.ops import GATED_RECURRENCE

if TYPE_CHECKING:
    import onnx

GLA_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_gate", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gla_linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear of a GLA block (every head has its own q, k, v and gate rows)."""
    inner = cfg.heads * cfg.head_dim
    return {
        "attn_q": (inner, cfg.hidden),
        "attn_k": (inner, cfg.hidden),
        "attn_v": (inner, cfg.hidden),
        "attn_gate": (inner, cfg.hidden),
        "attn_output": (cfg.hidden, inner),
        **ffn_linear_shapes(cfg),
    }


def gla_block_kind(cfg: ModelConfig, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
    shapes = gla_linear_shapes(cfg)
    linears = tuple(LinearSpec(n, *shapes[n], wtypes[n]) for n in GLA_LINEARS)
    return BlockKind("gla", cfg, linears, page_size)


def state_shape(cfg: ModelConfig, batch: int = 1) -> tuple[int, int, int, int]:
    return (batch, cfg.heads, cfg.head_dim, cfg.head_dim)


def _body(g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
    """Nodes of the GLA block into `g` (inputs x, state and the weights); its outputs y and state_out."""
    c = kind.config
    q_spec, k_spec, v_spec, gate_spec, o_spec, ffn_gate, ffn_up, ffn_down = kind.linears
    heads = g.const([0, 0, c.heads, c.head_dim])
    h = norm(g, "x", "attn_norm", c.rms_eps)
    q = g.op("Mul", g.op("Reshape", linear(g, h, q_spec), heads), g.const(c.head_dim ** -0.5, "float32"))
    k = g.op("Reshape", linear(g, h, k_spec), heads)
    v = g.op("Reshape", linear(g, h, v_spec), heads)
    decay = g.op("Sigmoid", g.op("Reshape", linear(g, h, gate_spec), heads))
    mixed, state = g.op(GATED_RECURRENCE, q, k, v, decay, "state", outputs=2, domain=DOMAIN)
    mixed = g.op("Reshape", mixed, g.const([0, 0, c.heads * c.head_dim]))
    x2 = g.op("Add", "x", linear(g, mixed, o_spec))
    g.rename(ffn(g, x2, c, ffn_gate, ffn_up, ffn_down), "y")
    g.rename(state, "state_out")
    outputs = [
        tensor_info("y", "float32", (*lead, c.hidden)),
        tensor_info("state_out", "float32", (lead[0], c.heads, c.head_dim, c.head_dim)),
    ]
    return outputs


class GlaBlock:
    name = "gla"
    state = RECURRENT
    head = False
    linear_names = GLA_LINEARS

    def linear_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        return gla_linear_shapes(cfg)

    def kind(self, cfg: ModelConfig, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
        return gla_block_kind(cfg, wtypes, page_size)

    def stacked_parts(self, kind: BlockKind) -> dict[str, tuple[str, ...]]:
        return {}

    def fused(self, kind: BlockKind) -> BlockKind:
        return kind

    def state_shape(self, kind: BlockKind) -> tuple[int, int, int, int]:
        return state_shape(kind.config)

    def weight_inputs(self, kind: BlockKind) -> Inputs:
        return decoder_weight_inputs(kind)

    def activation_inputs(self, kind: BlockKind) -> Inputs:
        c = kind.config
        batch, seq = (1, 1) if kind.decode else ("batch", "seq")
        return [("x", (batch, seq, c.hidden), "float32"),
                ("state", (batch, c.heads, c.head_dim, c.head_dim), "float32")]

    def body(self, g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
        return _body(g, kind, lead)


GLA = GlaBlock()
