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

Expert streaming (JITLLM_GPU_STREAM=1) runs a block in two programs: its kind with `experts_apart` (the graph
ends at the router, returning y = x2, k, v, then h, the picked ids and their weights, and the shared
expert's output where it has one), then a `moe_experts` kind (MoeExperts below) over the device's expert
cache, whose slots hold the experts the host uploaded for those picks: y = x2 + the routed experts' sum
(+ the shared expert's output), the resident block's sum in its order, so both give the same bits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from jitllm.core.errors import JitllmError
from jitllm.ir.block_type import KV_PAGES, NO_STATE, Inputs
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.graph import DOMAIN, GraphBuilder, tensor_info
from jitllm.ir.layers import decoder_weight_inputs, linear, linear_inputs, norm, parts
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
    shared = _shared_expert(g, h, specs) if c.shared_ffn else None
    if kind.experts_apart:
        return _router_outputs(g, kind, lead, x2, k, v, h, ids, weights, shared)
    experts = [specs[name] for name in EXPERT_LINEARS]
    routed = g.op(moe_op(tuple(spec.wtype for spec in experts)), h, ids, weights,
                  *[p for spec in experts for p in parts(spec)], domain=DOMAIN)
    y = g.op("Add", x2, routed)
    if shared is not None:
        y = g.op("Add", y, shared)
    return attention_outputs(g, kind, lead, y, k, v)


def _shared_expert(g: GraphBuilder, h: str, specs: dict[str, LinearSpec]) -> str:
    gate, up, down = (specs[name] for name in SHARED_LINEARS)
    gated = linear(g, h, gate)
    return linear(g, g.op("Mul", g.op("Mul", gated, g.op("Sigmoid", gated)), linear(g, h, up)), down)


ROUTED_OUTPUTS = ("ffn_h", "expert_ids", "expert_weights", "shared_out")
"""What an experts-apart kind returns after y (= x2), k_new and v_new: the moe_experts kind's inputs
after x (shared_out only where the model has a shared expert)."""


def _router_outputs(g: GraphBuilder, kind: BlockKind, lead: tuple, x2: str, k: str, v: str, h: str, ids: str,
                    weights: str, shared: str | None) -> list[onnx.ValueInfoProto]:
    c = kind.config
    out = attention_outputs(g, kind, lead, x2, k, v)
    values = (h, ids, weights, shared)
    shapes = ((c.hidden, "float32"), (c.experts_used, "int64"), (c.experts_used, "float32"), (c.hidden, "float32"))
    for name, value, (width, dtype) in zip(ROUTED_OUTPUTS, values, shapes):
        if value is not None:
            g.rename(value, name)
            out.append(tensor_info(name, dtype, (*lead, width)))
    return out


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
        """decoder_weight_inputs with the router after the feed-forward's norm (an experts-apart kind's
        without the routed experts: they are the moe_experts kind's)."""
        out = decoder_weight_inputs(kind)
        at = next(i for i, (name, _, _) in enumerate(out) if name == "ffn_norm") + 1
        out = [*out[:at], (ROUTER, (kind.config.experts, kind.config.hidden), "float32"), *out[at:]]
        if kind.experts_apart:
            banked = {name for spec in kind.linears if spec.name in EXPERT_LINEARS for name, _, _ in linear_inputs(spec)}
            out = [entry for entry in out if entry[0] not in banked]
        return out

    def activation_inputs(self, kind: BlockKind) -> Inputs:
        return activation_inputs(kind)

    def body(self, g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
        return _body(g, kind, lead)


MOE = MoeBlock()


class MoeExperts:
    """The routed experts of an MoE block over a device's expert cache (expert streaming; see the module
    docstring): its linears are the experts' three, stacked over the cache's slots ([slots * F, K], ...),
    which hold whichever experts the host uploaded; `slot_map` says which slot holds each expert."""

    name = "moe_experts"
    state = NO_STATE
    head = False
    linear_names = EXPERT_LINEARS

    def linear_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """A cache with a slot for every expert (cache_kind sizes it for fewer)."""
        return {n: moe_linear_shapes(cfg)[n] for n in EXPERT_LINEARS}

    def kind(self, cfg: ModelConfig, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
        shapes = self.linear_shapes(cfg)
        return BlockKind(self.name, cfg, tuple(LinearSpec(n, *shapes[n], wtypes[n]) for n in EXPERT_LINEARS), page_size)

    def stacked_parts(self, kind: BlockKind) -> dict[str, tuple[str, ...]]:
        return {}  # (its slots' experts are laid out by the cache, not read from one block's file tensors)

    def fused(self, kind: BlockKind) -> BlockKind:
        return kind

    def state_shape(self, kind: BlockKind) -> None:
        return None

    def weight_inputs(self, kind: BlockKind) -> Inputs:
        return [entry for spec in kind.linears for entry in linear_inputs(spec)]

    def activation_inputs(self, kind: BlockKind) -> Inputs:
        c, lead = kind.config, kind.lead
        shared = [("shared_out", (*lead, c.hidden), "float32")] if c.shared_ffn else []
        return [("x", (*lead, c.hidden), "float32"), ("ffn_h", (*lead, c.hidden), "float32"),
                ("expert_ids", (*lead, c.experts_used), "int64"), ("expert_weights", (*lead, c.experts_used), "float32"),
                ("slot_map", (c.experts,), "int64"), *shared]

    def body(self, g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
        c = kind.config
        routed = g.op(moe_op(tuple(spec.wtype for spec in kind.linears), slots=True), "ffn_h", "expert_ids",
                      "expert_weights", "slot_map", *[p for spec in kind.linears for p in parts(spec)], domain=DOMAIN)
        y = g.op("Add", "x", routed)
        if c.shared_ffn:
            y = g.op("Add", y, "shared_out")
        g.rename(y, "y")
        return [tensor_info("y", "float32", (*lead, c.hidden))]


def cache_kind(kind: BlockKind, slots: int) -> BlockKind:
    """The moe_experts kind running MoE kind `kind`'s routed experts over an expert cache of `slots` experts."""
    c = kind.config
    specs = tuple(replace(spec, out_features=spec.out_features // c.experts * slots)
                  for spec in kind.linears if spec.name in EXPERT_LINEARS)
    return BlockKind(MoeExperts.name, c, specs, kind.page_size)


MOE_EXPERTS = MoeExperts()
