"""Builders every block type shares: linears over their stored parts (plain or with a norm / residual
add folded in), RMS norm, interleaved-pair rotary embedding and the SwiGLU feed-forward."""

from __future__ import annotations

from jitllm.core.layouts import weight_parts
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.graph import DOMAIN, GraphBuilder
from jitllm.ir.ops import LINEAR_ADD, NORM_LINEAR, SWIGLU_LINEAR_ADD, linear_op, rms_norm


def ffn_linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of the SwiGLU feed-forward's linears, which every decoder block type shares."""
    return {"ffn_gate": (cfg.ffn, cfg.hidden), "ffn_up": (cfg.ffn, cfg.hidden), "ffn_down": (cfg.hidden, cfg.ffn)}


def linear_inputs(spec: LinearSpec) -> list[tuple[str, tuple[int, ...], str]]:
    """(graph input name, shape, dtype) of each stored part of a linear's weight."""
    return [(f"{spec.name}_{part}", shape, dtype) for part, shape, dtype in
            weight_parts(spec.wtype, spec.out_features, spec.in_features)]


def decoder_weight_inputs(kind: BlockKind) -> list[tuple[str, tuple[int, ...], str]]:
    """A decoder block's weight inputs in call order: the token mixer's norm and linears, then the
    feed-forward's."""
    c = kind.config
    mixer = sum(spec.name.startswith("attn_") for spec in kind.linears)  # token-mixer linears come first
    out: list[tuple[str, tuple[int, ...], str]] = [("attn_norm", (c.hidden,), "float32")]
    if c.qk_norm:
        out += [("attn_q_norm", (c.head_dim,), "float32"), ("attn_k_norm", (c.head_dim,), "float32")]
    for spec in kind.linears[:mixer]:
        out += linear_inputs(spec)
    out.append(("ffn_norm", (c.hidden,), "float32"))
    for spec in kind.linears[mixer:]:
        out += linear_inputs(spec)
    return out


def norm(g: GraphBuilder, x: str, weight: str, eps: float) -> str:
    return rms_norm(g, x, weight, g.const(eps, "float32"))


def head_norm(g: GraphBuilder, x: str, heads: int, head_dim: int, weight: str, eps: float) -> str:
    """RMSNorm of each head of x [B, S, heads * head_dim] over its head_dim values (Qwen3's q/k norms);
    the same shape out."""
    per_head = g.op("Reshape", x, g.const([0, 0, heads, head_dim]))
    return g.op("Reshape", norm(g, per_head, weight, eps), g.const([0, 0, heads * head_dim]))


def parts(spec: LinearSpec) -> list[str]:
    return [name for name, _, _ in linear_inputs(spec)]


def linear(g: GraphBuilder, x: str, spec: LinearSpec) -> str:
    return g.op(linear_op(spec.wtype), x, *parts(spec), domain=DOMAIN)


def norm_linear(g: GraphBuilder, x: str, weight: str, eps: float, spec: LinearSpec, fold: bool) -> str:
    """Linear(RMSNorm(x) * weight): one op when `fold` (decode variants), else the norm's ops and a Linear."""
    if not fold:
        return linear(g, norm(g, x, weight, eps), spec)
    return g.op(linear_op(spec.wtype, NORM_LINEAR), x, weight, g.const(eps, "float32"), *parts(spec), domain=DOMAIN)


def linear_add(g: GraphBuilder, x: str, spec: LinearSpec, residual: str, fold: bool) -> str:
    if not fold:
        return g.op("Add", residual, linear(g, x, spec))
    return g.op(linear_op(spec.wtype, LINEAR_ADD), x, residual, *parts(spec), domain=DOMAIN)


def rope(g: GraphBuilder, x: str, heads: int, head_dim: int, cos: str, sin: str) -> str:
    """Interleaved-pair rotary embedding (GGUF llama layout): pairs (x[2i], x[2i+1])."""
    pairs = g.op("Reshape", x, g.const([0, 0, heads, head_dim // 2, 2]))
    x0, x1 = g.op("Split", pairs, g.const([1, 1]), axis=-1, outputs=2)
    out0 = g.op("Sub", g.op("Mul", x0, cos), g.op("Mul", x1, sin))
    out1 = g.op("Add", g.op("Mul", x0, sin), g.op("Mul", x1, cos))
    return g.op("Reshape", g.op("Concat", out0, out1, axis=-1), g.const([0, 0, heads, head_dim]))


def ffn(g: GraphBuilder, x2: str, c: ModelConfig, gate_spec: LinearSpec, up_spec: LinearSpec | None,
        down_spec: LinearSpec, fold: bool = False) -> str:
    """x2 + SwiGLU(RMSNorm(x2)): the feed-forward half every decoder block type shares. Without
    `up_spec`, `gate_spec` is the fused gate/up matrix. `fold` (fused matrices only): as folded ops."""
    if up_spec is None:
        gate_up = norm_linear(g, x2, "ffn_norm", c.rms_eps, gate_spec, fold)
        if fold:
            return g.op(linear_op(down_spec.wtype, SWIGLU_LINEAR_ADD), gate_up, x2, *parts(down_spec), domain=DOMAIN)
        gate, up = g.op("Split", gate_up, g.const([c.ffn, c.ffn]), axis=-1, outputs=2)
    else:
        h2 = norm(g, x2, "ffn_norm", c.rms_eps)
        gate, up = linear(g, h2, gate_spec), linear(g, h2, up_spec)
    act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    return g.op("Add", x2, linear(g, act, down_spec))
