"""The mixture-of-experts decoder block type: the llama block's attention half (q/k norms where the config
has them), then a feed-forward of routed SwiGLU experts (Mixtral, Qwen3-MoE, OLMoE's layout):

h = RMSNorm(x2); p = softmax(h @ ffn_gate_inp.T) over the experts; the top `experts_used` of p (renormalised
to sum 1 where `norm_topk`) weigh those experts' SwiGLU(h); y = x2 + their sum (+ a shared expert's
SwiGLU(h) where `shared_ffn`).

The router is a float32 [experts, hidden] weight multiplied in the graph (it has as many rows as experts,
rarely a multiple of the layouts' row group). Each projection's experts are one linear of the kind, their
matrices stacked along the rows ([experts * rows, cols]), so the weights stay in the layouts of dense
linears (every weight type) and a kernel finds expert e's rows at e * rows. In the file each expert is
its own tensors, `blk.N.ffn_gate_exps.E.qs` ..., together in one aligned page of the block's region
(stacked_parts; docs/model-format.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from jitllm.core.errors import JitllmError
from jitllm.ir.block_type import KV_PAGES, Inputs
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.graph import DOMAIN, GraphBuilder
from jitllm.ir.layers import decoder_weight_inputs, linear, norm, parts
from jitllm.ir.llama import FUSED_LINEARS, activation_inputs, attention, attention_outputs
from jitllm.ir.ops import moe_op

if TYPE_CHECKING:
    import onnx

EXPERT_LINEARS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED_LINEARS = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
MOE_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", *EXPERT_LINEARS, *SHARED_LINEARS)
ROUTER = "ffn_gate_inp"


def moe_linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear of an MoE block (the experts' stacked; the shared expert's where it has one)."""
    q, kv, h = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden
    e, f, s = cfg.experts, cfg.expert_ffn, cfg.shared_ffn
    shapes = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
              "ffn_gate_exps": (e * f, h), "ffn_up_exps": (e * f, h), "ffn_down_exps": (e * h, f)}
    if s:
        shapes |= {"ffn_gate_shexp": (s, h), "ffn_up_shexp": (s, h), "ffn_down_shexp": (h, s)}
    return shapes


def _attention_count(kind: BlockKind) -> int:
    return 2 if kind.fused else 4


def _body(g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
    c = kind.config
    fold = (kind.decode and kind.fused) or kind.folded
    mixer = _attention_count(kind)
    x2, k, v = attention(g, kind, kind.linears[:mixer], fold)
    specs = {spec.name: spec for spec in kind.linears[mixer:]}
    h = norm(g, x2, "ffn_norm", c.rms_eps)
    probs = g.op("Softmax", g.op("MatMul", h, g.op("Transpose", ROUTER, perm=[1, 0])), axis=-1)
    weights, ids = g.op("TopK", probs, g.const([c.experts_used]), axis=-1, outputs=2)
    if c.norm_topk:
        weights = g.op("Div", weights, g.op("ReduceSum", weights, g.const([-1]), keepdims=1))
    experts = [specs[name] for name in EXPERT_LINEARS]
    routed = g.op(moe_op(tuple(spec.wtype for spec in experts)), h, ids, weights,
                  *[p for spec in experts for p in parts(spec)], domain=DOMAIN)
    y = g.op("Add", x2, routed)
    if c.shared_ffn:
        gate, up, down = (specs[name] for name in SHARED_LINEARS)
        gated = linear(g, h, gate)
        y = g.op("Add", y, linear(g, g.op("Mul", g.op("Mul", gated, g.op("Sigmoid", gated)), linear(g, h, up)), down))
    return attention_outputs(g, kind, lead, y, k, v)


class MoeBlock:
    name = "moe"
    state = KV_PAGES
    head = False
    linear_names = MOE_LINEARS

    def linear_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        return moe_linear_shapes(cfg)

    def kind(self, cfg: ModelConfig, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
        if cfg.experts < 1:
            raise JitllmError("moe blocks need config.experts (the model has no experts)")
        shapes = moe_linear_shapes(cfg)
        return BlockKind("moe", cfg, tuple(LinearSpec(n, *shapes[n], wtypes[n]) for n in MOE_LINEARS if n in shapes),
                         page_size)

    def stacked_parts(self, kind: BlockKind) -> dict[str, tuple[str, ...]]:
        experts = range(kind.config.experts)
        return {"attn_qkv": FUSED_LINEARS["attn_qkv"], **{n: tuple(f"{n}.{e}" for e in experts) for n in EXPERT_LINEARS}}

    def fused(self, kind: BlockKind) -> BlockKind:
        """Q/K/V stacked into one linear where their weight types match (the experts stay as they are)."""
        if kind.fused:
            return kind
        q, k, v, *rest = kind.linears
        if len({q.wtype, k.wtype, v.wtype}) != 1:
            return kind
        qkv = LinearSpec("attn_qkv", q.out_features + k.out_features + v.out_features, q.in_features, q.wtype)
        return replace(kind, linears=(qkv, *rest))

    def state_shape(self, kind: BlockKind) -> None:
        return None

    def weight_inputs(self, kind: BlockKind) -> Inputs:
        """decoder_weight_inputs with the router after the feed-forward's norm."""
        out = decoder_weight_inputs(kind)
        at = next(i for i, (name, _, _) in enumerate(out) if name == "ffn_norm") + 1
        return [*out[:at], (ROUTER, (kind.config.experts, kind.config.hidden), "float32"), *out[at:]]

    def activation_inputs(self, kind: BlockKind) -> Inputs:
        return activation_inputs(kind)

    def body(self, g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
        return _body(g, kind, lead)


MOE = MoeBlock()
