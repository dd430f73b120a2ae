"""ONNX graphs of the llama-family block kinds: the decoder block and the head (final norm + projection).

Weights are graph *inputs*, so one compiled artifact serves every block of the same kind. Positions
arrive as cos/sin tables (computed on the host), so every dim is an input dim (DESIGN.md §3).
"""

from __future__ import annotations

from dataclasses import replace

import onnx
from onnx import helper

from jitllm.core.layouts import weight_parts
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.graph import DOMAIN, OPSET, GraphBuilder, tensor_info
from jitllm.ir.ops import (
    LINEAR_ADD,
    NORM_LINEAR,
    PAGED_ATTENTION,
    ROTARY_ATTENTION,
    ROTARY_QKV,
    SWIGLU_LINEAR_ADD,
    functions_for,
    linear_op,
    rms_norm,
)

BLOCK_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
FUSED_LINEARS = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}
"""Linears that share their input, stacked along the output rows into one matrix (one matvec each)."""


def ffn_linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of the SwiGLU feed-forward's linears, which every decoder block kind shares."""
    return {"ffn_gate": (cfg.ffn, cfg.hidden), "ffn_up": (cfg.ffn, cfg.hidden), "ffn_down": (cfg.hidden, cfg.ffn)}


def block_linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear of a decoder block."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {
        "attn_q": (q, cfg.hidden),
        "attn_k": (kv, cfg.hidden),
        "attn_v": (kv, cfg.hidden),
        "attn_output": (cfg.hidden, q),
        **ffn_linear_shapes(cfg),
    }


def weight_inputs(kind: BlockKind) -> list[tuple[str, tuple[int, ...], str]]:
    """(graph input name, shape, dtype) of every weight of a block kind, in call order."""
    c = kind.config
    out: list[tuple[str, tuple[int, ...], str]] = []
    if kind.kind in ("llama", "gla"):
        mixer = sum(spec.name.startswith("attn_") for spec in kind.linears)  # token-mixer linears come first
        out.append(("attn_norm", (c.hidden,), "float32"))
        for spec in kind.linears[:mixer]:
            out += _linear_inputs(spec)
        out.append(("ffn_norm", (c.hidden,), "float32"))
        for spec in kind.linears[mixer:]:
            out += _linear_inputs(spec)
    else:
        out.append(("output_norm", (c.hidden,), "float32"))
        out += _linear_inputs(kind.linears[0])
    return out


def _linear_inputs(spec: LinearSpec) -> list[tuple[str, tuple[int, ...], str]]:
    return [(f"{spec.name}_{part}", shape, dtype) for part, shape, dtype in
            weight_parts(spec.wtype, spec.out_features, spec.in_features)]


def activation_inputs(kind: BlockKind) -> list[tuple[str, tuple, str]]:
    """The non-weight inputs (symbolic dims by name)."""
    c = kind.config
    batch, seq = (1, 1) if kind.decode else ("batch", "seq")
    x = ("x", (batch, seq, c.hidden), "float32")
    if kind.kind == "head":
        return [x]
    if kind.kind == "gla":
        return [x, ("state", (batch, c.heads, c.head_dim, c.head_dim), "float32")]
    half = c.head_dim // 2
    return [
        x,
        ("cos", (batch, seq, half), "float32"),
        ("sin", (batch, seq, half), "float32"),
        ("pages", ("num_pages", 2, c.kv_heads, kind.page_size, c.head_dim), "float32"),
        ("page_table", (batch, "max_pages"), "int32"),
        ("past", (batch,), "int32"),
    ]


def _rms_norm(g: GraphBuilder, x: str, weight: str, eps: float) -> str:
    return rms_norm(g, x, weight, g.const(eps, "float32"))


def _parts(spec: LinearSpec) -> list[str]:
    return [name for name, _, _ in _linear_inputs(spec)]


def _linear(g: GraphBuilder, x: str, spec: LinearSpec) -> str:
    return g.op(linear_op(spec.wtype), x, *_parts(spec), domain=DOMAIN)


def _norm_linear(g: GraphBuilder, x: str, norm: str, eps: float, spec: LinearSpec, fold: bool) -> str:
    """Linear(RMSNorm(x) * norm): one op when `fold` (decode variants), else the norm's ops and a Linear."""
    if not fold:
        return _linear(g, _rms_norm(g, x, norm, eps), spec)
    return g.op(linear_op(spec.wtype, NORM_LINEAR), x, norm, g.const(eps, "float32"), *_parts(spec), domain=DOMAIN)


def _linear_add(g: GraphBuilder, x: str, spec: LinearSpec, residual: str, fold: bool) -> str:
    if not fold:
        return g.op("Add", residual, _linear(g, x, spec))
    return g.op(linear_op(spec.wtype, LINEAR_ADD), x, residual, *_parts(spec), domain=DOMAIN)


def _rope(g: GraphBuilder, x: str, heads: int, head_dim: int, cos: str, sin: str) -> str:
    """Interleaved-pair rotary embedding (GGUF llama layout): pairs (x[2i], x[2i+1])."""
    pairs = g.op("Reshape", x, g.const([0, 0, heads, head_dim // 2, 2]))
    x0, x1 = g.op("Split", pairs, g.const([1, 1]), axis=-1, outputs=2)
    out0 = g.op("Sub", g.op("Mul", x0, cos), g.op("Mul", x1, sin))
    out1 = g.op("Add", g.op("Mul", x0, sin), g.op("Mul", x1, cos))
    return g.op("Reshape", g.op("Concat", out0, out1, axis=-1), g.const([0, 0, heads, head_dim]))


def _ffn(g: GraphBuilder, x2: str, c: ModelConfig, gate_spec: LinearSpec, up_spec: LinearSpec | None,
         down_spec: LinearSpec, fold: bool = False) -> str:
    """x2 + SwiGLU(RMSNorm(x2)): the feed-forward half every decoder block kind shares. Without
    `up_spec`, `gate_spec` is the fused gate/up matrix. `fold` (fused matrices only): as folded ops."""
    if up_spec is None:
        gate_up = _norm_linear(g, x2, "ffn_norm", c.rms_eps, gate_spec, fold)
        if fold:
            return g.op(linear_op(down_spec.wtype, SWIGLU_LINEAR_ADD), gate_up, x2, *_parts(down_spec), domain=DOMAIN)
        gate, up = g.op("Split", gate_up, g.const([c.ffn, c.ffn]), axis=-1, outputs=2)
    else:
        h2 = _rms_norm(g, x2, "ffn_norm", c.rms_eps)
        gate, up = _linear(g, h2, gate_spec), _linear(g, h2, up_spec)
    act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    return g.op("Add", x2, _linear(g, act, down_spec))


def fused_kind(kind: BlockKind) -> BlockKind:
    """The llama kind with Q/K/V and gate/up stacked into one linear each, where their weight types
    match (else the kind itself). Weights are stacked when loaded (see ModelLayout.weight_sources)."""
    specs = {spec.name: spec for spec in kind.linears}
    if kind.kind != "llama" or "attn_qkv" in specs:
        return kind
    fused = []
    for name, parts in FUSED_LINEARS.items():
        if len({specs[p].wtype for p in parts}) != 1:
            return kind
        first = specs[parts[0]]
        fused.append(LinearSpec(name, sum(specs[p].out_features for p in parts), first.in_features, first.wtype))
    return replace(kind, linears=(fused[0], specs["attn_output"], fused[1], specs["ffn_down"]))


def build_block_graph(kind: BlockKind) -> onnx.ModelProto:
    """The ONNX model of one block kind. Decode variants fold norms, residual adds, SwiGLU and rotary
    embedding into the linears' ops (jitllm.ir.ops); the general kind keeps them as standard ops."""
    c = kind.config
    g = GraphBuilder()
    lead = (1, 1) if kind.decode else ("batch", "seq")
    # decode variant of a fused kind, or a fused kind compiled for a target with folded prefill kernels
    fold = (kind.decode and (kind.kind == "head" or len(kind.linears) == 4)) or kind.folded
    outputs: list[onnx.ValueInfoProto]
    if kind.kind == "llama":
        q_dim, kv_dim = c.heads * c.head_dim, c.kv_heads * c.head_dim
        attn = None  # set here where one op does rotary embedding and attention (fused decode variants)
        if len(kind.linears) == 4:  # fused_kind
            qkv_spec, o_spec, gate_spec, down_spec = kind.linears
            up_spec = None
            qkv = _norm_linear(g, "x", "attn_norm", c.rms_eps, qkv_spec, fold)
            split = g.const([q_dim, kv_dim, kv_dim])
            if fold and kind.decode:
                attn, k, v = g.op(ROTARY_ATTENTION, qkv, "cos", "sin", split, "pages", "page_table", "past",
                                  outputs=3, domain=DOMAIN)
            elif fold:
                q, k, v = g.op(ROTARY_QKV, qkv, "cos", "sin", split, outputs=3, domain=DOMAIN)
            else:
                q, k, v = g.op("Split", qkv, split, axis=-1, outputs=3)
        else:
            q_spec, k_spec, v_spec, o_spec, gate_spec, up_spec, down_spec = kind.linears
            h = _rms_norm(g, "x", "attn_norm", c.rms_eps)
            q, k, v = _linear(g, h, q_spec), _linear(g, h, k_spec), _linear(g, h, v_spec)
        if not fold:
            cos = g.op("Unsqueeze", "cos", g.const([2, 4]))  # [B, S, 1, D/2, 1]
            sin = g.op("Unsqueeze", "sin", g.const([2, 4]))
            q = _rope(g, q, c.heads, c.head_dim, cos, sin)
            k = _rope(g, k, c.kv_heads, c.head_dim, cos, sin)
            v = g.op("Reshape", v, g.const([0, 0, c.kv_heads, c.head_dim]))
        if attn is None:
            attn = g.op(PAGED_ATTENTION, q, k, v, "pages", "page_table", "past", domain=DOMAIN)
        attn = g.op("Reshape", attn, g.const([0, 0, q_dim]))
        x2 = _linear_add(g, attn, o_spec, "x", fold)
        g.rename(_ffn(g, x2, c, gate_spec, up_spec, down_spec, fold), "y")
        g.rename(k, "k_new")
        g.rename(v, "v_new")
        outputs = [
            tensor_info("y", "float32", (*lead, c.hidden)),
            tensor_info("k_new", "float32", (*lead, c.kv_heads, c.head_dim)),
            tensor_info("v_new", "float32", (*lead, c.kv_heads, c.head_dim)),
        ]
    elif kind.kind == "gla":
        from jitllm.ir.gla import gla_body  # gla.py builds on this module's helpers

        outputs = gla_body(g, kind, lead)
    else:
        (head_spec,) = kind.linears
        g.rename(_norm_linear(g, "x", "output_norm", c.rms_eps, head_spec, fold), "logits")
        outputs = [tensor_info("logits", "float32", (*lead, head_spec.out_features))]
    inputs = [tensor_info(n, d, s) for n, s, d in activation_inputs(kind) + weight_inputs(kind)]
    graph = helper.make_graph(g.nodes, f"jitllm_{kind.kind}", inputs, outputs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
        functions=functions_for(g.nodes),
        producer_name="jitllm",
        ir_version=9,
    )


def llama_block_kind(cfg: ModelConfig, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
    shapes = block_linear_shapes(cfg)
    linears = tuple(LinearSpec(n, *shapes[n], wtypes[n]) for n in BLOCK_LINEARS)
    return BlockKind("llama", cfg, linears, page_size)


def head_kind(cfg: ModelConfig, wtype: str) -> BlockKind:
    return BlockKind("head", cfg, (LinearSpec("output", cfg.vocab, cfg.hidden, wtype),))
