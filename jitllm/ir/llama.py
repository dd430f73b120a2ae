"""The llama decoder block type: RMS norm, Q/K/V (each head of q and k RMS-normalised where the config
has `qk_norm`, as Qwen3's are), rotary embedding, paged attention over the session's
KV pages, output projection and SwiGLU feed-forward.

Weights are graph *inputs*, so one compiled artifact serves every block of the same kind. Positions
arrive as cos/sin tables (computed on the host), so every dim is an input dim (DESIGN.md §3).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from jitllm.ir.block_type import KV_PAGES, Inputs
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.graph import DOMAIN, GraphBuilder, tensor_info
from jitllm.ir.layers import (
    decoder_weight_inputs,
    ffn,
    ffn_linear_shapes,
    head_norm,
    linear,
    linear_add,
    norm,
    norm_linear,
    rope,
)
from jitllm.ir.ops import PAGED_ATTENTION, RAGGED_ATTENTION, ROTARY_ATTENTION, ROTARY_QKV

if TYPE_CHECKING:
    import onnx

BLOCK_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
FUSED_LINEARS = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}
"""Linears that share their input, stacked along the output rows into one matrix (one matvec each)."""


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


def llama_block_kind(cfg: ModelConfig, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
    shapes = block_linear_shapes(cfg)
    linears = tuple(LinearSpec(n, *shapes[n], wtypes[n]) for n in BLOCK_LINEARS)
    return BlockKind("llama", cfg, linears, page_size)


def fused_kind(kind: BlockKind) -> BlockKind:
    """The kind with Q/K/V and gate/up stacked into one linear each, where their weight types match
    (else the kind itself). Weights are stacked when loaded (see ModelLayout.weight_sources)."""
    specs = {spec.name: spec for spec in kind.linears}
    if kind.fused:
        return kind
    fused = []
    for name, parts in FUSED_LINEARS.items():
        if len({specs[p].wtype for p in parts}) != 1:
            return kind
        first = specs[parts[0]]
        fused.append(LinearSpec(name, sum(specs[p].out_features for p in parts), first.in_features, first.wtype))
    return replace(kind, linears=(fused[0], specs["attn_output"], fused[1], specs["ffn_down"]))


def qk_norms(g: GraphBuilder, c: ModelConfig, q: str, k: str) -> tuple[str, str]:
    """q and k with each head RMS-normalised (ModelConfig.qk_norm: weights attn_q_norm, attn_k_norm)."""
    return (head_norm(g, q, c.heads, c.head_dim, "attn_q_norm", c.rms_eps),
            head_norm(g, k, c.kv_heads, c.head_dim, "attn_k_norm", c.rms_eps))


def attention(g: GraphBuilder, kind: BlockKind, specs: tuple[LinearSpec, ...], fold: bool) -> tuple[str, str, str]:
    """The attention half every attention block type shares: x + Attention(RMSNorm(x)) over the session's
    pages, from `specs` (q, k, v, output; or a fused kind's qkv, output). Returns (x2, k_new, v_new).
    `fold`: the norm, residual add and rotary embedding as folded ops (jitllm.ir.ops)."""
    c = kind.config
    q_dim, kv_dim = c.heads * c.head_dim, c.kv_heads * c.head_dim
    attn = None  # set here where one op does rotary embedding and attention (fused decode variants)
    if kind.fused:
        qkv_spec, o_spec = specs
        qkv = norm_linear(g, "x", "attn_norm", c.rms_eps, qkv_spec, fold)
        split = g.const([q_dim, kv_dim, kv_dim])
        if c.qk_norm:  # q and k normalised before the rotary op, stacked again where one op rotates them
            q, k, v = g.op("Split", qkv, split, axis=-1, outputs=3)
            q, k = qk_norms(g, c, q, k)
            if fold:
                qkv = g.op("Concat", q, k, v, axis=-1)
        if fold and kind.decode:
            attn, k, v = g.op(ROTARY_ATTENTION, qkv, "cos", "sin", split, "pages", "page_table", "past",
                              outputs=3, domain=DOMAIN)
        elif fold:
            q, k, v = g.op(ROTARY_QKV, qkv, "cos", "sin", split, outputs=3, domain=DOMAIN)
        elif not c.qk_norm:
            q, k, v = g.op("Split", qkv, split, axis=-1, outputs=3)
    else:
        q_spec, k_spec, v_spec, o_spec = specs
        h = norm(g, "x", "attn_norm", c.rms_eps)
        q, k, v = linear(g, h, q_spec), linear(g, h, k_spec), linear(g, h, v_spec)
        if c.qk_norm:
            q, k = qk_norms(g, c, q, k)
    if not fold:
        cos = g.op("Unsqueeze", "cos", g.const([2, 4]))  # [B, S, 1, D/2, 1]
        sin = g.op("Unsqueeze", "sin", g.const([2, 4]))
        q = rope(g, q, c.heads, c.head_dim, cos, sin)
        k = rope(g, k, c.kv_heads, c.head_dim, cos, sin)
        v = g.op("Reshape", v, g.const([0, 0, c.kv_heads, c.head_dim]))
    if kind.ragged:
        attn = g.op(RAGGED_ATTENTION, q, k, v, "pages", "page_table", "past", "seq_starts", domain=DOMAIN)
    elif attn is None:
        attn = g.op(PAGED_ATTENTION, q, k, v, "pages", "page_table", "past", domain=DOMAIN)
    attn = g.op("Reshape", attn, g.const([0, 0, q_dim]))
    return linear_add(g, attn, o_spec, "x", fold), k, v


def attention_outputs(g: GraphBuilder, kind: BlockKind, lead: tuple, y: str, k: str, v: str
                      ) -> list[onnx.ValueInfoProto]:
    """An attention block's outputs y, k_new and v_new (named so from `y`, `k`, `v`)."""
    c = kind.config
    g.rename(y, "y")
    g.rename(k, "k_new")
    g.rename(v, "v_new")
    return [
        tensor_info("y", "float32", (*lead, c.hidden)),
        tensor_info("k_new", "float32", (*lead, c.kv_heads, c.head_dim)),
        tensor_info("v_new", "float32", (*lead, c.kv_heads, c.head_dim)),
    ]


def _body(g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
    """Decode variants of fused kinds (and kinds for targets with folded prefill kernels) fold norms,
    residual adds, SwiGLU and rotary embedding into the linears' ops (jitllm.ir.ops); the others keep
    them as standard ops."""
    fold = (kind.decode and kind.fused) or kind.folded
    mixer = 2 if kind.fused else 4
    x2, k, v = attention(g, kind, kind.linears[:mixer], fold)
    if kind.fused:
        gate_spec, down_spec = kind.linears[mixer:]
        up_spec = None
    else:
        gate_spec, up_spec, down_spec = kind.linears[mixer:]
    return attention_outputs(g, kind, lead, ffn(g, x2, kind.config, gate_spec, up_spec, down_spec, fold), k, v)


def activation_inputs(kind: BlockKind) -> Inputs:
    """An attention block's activation inputs: x, the positions' cos/sin, the pool and the page table. A
    ragged kind's rows belong to `seqs` sessions: page table and history length per session, and
    `seq_starts` [seqs + 1], the first row of each session (and the row count last)."""
    c = kind.config
    lead = kind.lead
    seqs = "seqs" if kind.ragged else lead[0]
    half = c.head_dim // 2
    return [
        ("x", (*lead, c.hidden), "float32"),
        ("cos", (*lead, half), "float32"),
        ("sin", (*lead, half), "float32"),
        ("pages", ("num_pages", 2, c.kv_heads, kind.page_size, kind.kv_row), kind.kv_dtype),
        ("page_table", (seqs, "max_pages"), "int32"),
        ("past", (seqs,), "int32"),
        *([("seq_starts", ("seq_bounds",), "int32")] if kind.ragged else []),
    ]


class LlamaBlock:
    name = "llama"
    state = KV_PAGES
    head = False
    linear_names = BLOCK_LINEARS

    def linear_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        return block_linear_shapes(cfg)

    def kind(self, cfg: ModelConfig, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
        return llama_block_kind(cfg, wtypes, page_size)

    def stacked_parts(self, kind: BlockKind) -> dict[str, tuple[str, ...]]:
        return FUSED_LINEARS

    def fused(self, kind: BlockKind) -> BlockKind:
        return fused_kind(kind)

    def state_shape(self, kind: BlockKind) -> None:
        return None

    def weight_inputs(self, kind: BlockKind) -> Inputs:
        return decoder_weight_inputs(kind)

    def activation_inputs(self, kind: BlockKind) -> Inputs:
        return activation_inputs(kind)

    def body(self, g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
        return _body(g, kind, lead)


LLAMA = LlamaBlock()
