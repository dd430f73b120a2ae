"""Independent numpy references for block kinds and shared fixtures of random inputs."""

from __future__ import annotations

import gguf
import numpy as np

from jitllm.core.layouts import weight_parts
from jitllm.core.quant import dequantize, parts_from_float
from jitllm.ir.blocks import weight_inputs
from jitllm.ir.config import BlockKind

F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2),
              "q5_k": (0, 2), "q6_k": (208,)}
"""Byte offsets of each block's f16 scales: random bytes elsewhere, finite halves there."""


def random_ggml(wtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGML bytes of an [n, k] `wtype` matrix: every quant, high-bit and scale pattern, finite scales."""
    qtype = gguf.GGMLQuantizationType[wtype.upper()]
    size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if wtype == "bf16":
        bits = rng.integers(0, 1 << 16, (n, k), dtype=np.uint16)
        bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF  # no inf or NaN exponent
        return bits.view(np.uint8)
    blocks = rng.integers(0, 256, (n, k // size, block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[wtype]:
        blocks[..., at:at + 2] = (rng.standard_normal((n, k // size, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def random_weights(kind: BlockKind, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Graph-input name -> array for every weight of a kind (quantized from random floats)."""
    out: dict[str, np.ndarray] = {}
    norms = [name for name, shape, _ in weight_inputs(kind) if len(shape) == 1]
    for name in norms:
        out[name] = (1.0 + 0.1 * rng.standard_normal(kind.config.hidden)).astype(np.float32)
    for spec in kind.linears:
        w = rng.standard_normal((spec.out_features, spec.in_features)).astype(np.float32) / np.sqrt(spec.in_features)
        for part, arr in parts_from_float(spec.wtype, w).items():
            out[f"{spec.name}_{part}"] = arr
    return out


def linear_weight(kind: BlockKind, weights: dict[str, np.ndarray], name: str) -> np.ndarray:
    spec = kind.linear(name)
    parts = {part: weights[f"{name}_{part}"] for part, _, _ in weight_parts(spec.wtype, spec.out_features, spec.in_features)}
    return dequantize(spec.wtype, parts)


def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = positions[..., None].astype(np.float64) * inv
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def block_forward(kind: BlockKind, weights, x, cos, sin, pages, page_table, past):
    """Numpy forward of a llama block over paged history; returns (y, k_new, v_new)."""
    c = kind.config
    b, s, _ = x.shape
    fused = {"attn_q": ("attn_qkv", 0), "attn_k": ("attn_qkv", 1), "attn_v": ("attn_qkv", 2),
             "ffn_gate": ("ffn_gate_up", 0), "ffn_up": ("ffn_gate_up", 1)}
    q_dim, kv_dim = c.heads * c.head_dim, c.kv_heads * c.head_dim
    bounds = {"attn_qkv": [0, q_dim, q_dim + kv_dim, q_dim + 2 * kv_dim], "ffn_gate_up": [0, c.ffn, 2 * c.ffn]}

    def lin(name: str, h: np.ndarray) -> np.ndarray:
        names = [spec.name for spec in kind.linears]
        if name in names:
            return h @ linear_weight(kind, weights, name).T
        stacked, i = fused[name]  # a fused kind: the rows of `name` within the stacked matrix
        rows = linear_weight(kind, weights, stacked)[bounds[stacked][i]:bounds[stacked][i + 1]]
        return h @ rows.T
    h = rms_norm(x, weights["attn_norm"], c.rms_eps)
    q = rope(lin("attn_q", h).reshape(b, s, c.heads, c.head_dim), cos, sin)
    k = rope(lin("attn_k", h).reshape(b, s, c.kv_heads, c.head_dim), cos, sin)
    v = lin("attn_v", h).reshape(b, s, c.kv_heads, c.head_dim)
    p = kind.page_size
    group = c.heads // c.kv_heads
    attn = np.zeros((b, s, c.heads, c.head_dim), np.float32)
    for bi in range(b):
        n = int(past[bi])
        hist = np.stack([pool_values(kind, pages[page_table[bi, t // p], :, :, t % p]) for t in range(n)]) if n else np.zeros((0, 2, c.kv_heads, c.head_dim), np.float32)
        keys = np.concatenate([hist[:, 0], k[bi]], axis=0)  # [n+s, Hkv, D]
        vals = np.concatenate([hist[:, 1], v[bi]], axis=0)
        for si in range(s):
            visible = n + si + 1
            for hh in range(c.heads):
                kv = hh // group
                scores = keys[:visible, kv] @ q[bi, si, hh] / np.sqrt(c.head_dim)
                w = np.exp(scores - scores.max())
                attn[bi, si, hh] = (w / w.sum()) @ vals[:visible, kv]
    x2 = x + lin("attn_output", attn.reshape(b, s, -1))
    h2 = rms_norm(x2, weights["ffn_norm"], c.rms_eps)
    g = lin("ffn_gate", h2)
    y = x2 + lin("ffn_down", g / (1 + np.exp(-g)) * lin("ffn_up", h2))
    return y.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def head_forward(kind: BlockKind, weights, x):
    h = rms_norm(x, weights["output_norm"], kind.config.rms_eps)
    return (h @ linear_weight(kind, weights, "output").T).astype(np.float32)


def pool_rows(kind: BlockKind, values: np.ndarray) -> np.ndarray:
    """f32 values [..., head_dim] as the kind's pool stores them: cast, or q8_0 through gguf's own quantizer
    (llama.cpp's block_q8_0: 2 bytes of f16 scale, 32 int8 quants), its blocks laid out as our rows (the
    quants, then the scales)."""
    if kind.kv_type != "q8_0":
        return values.astype(kind.kv_dtype)
    lead, d = values.shape[:-1], values.shape[-1]
    blocks = gguf.quants.quantize(values.reshape(-1, d), gguf.GGMLQuantizationType.Q8_0).reshape(-1, d // 32, 34)
    quants = blocks[..., 2:].reshape(-1, d).view(np.int8)
    scales = blocks[..., :2].reshape(-1, d // 16).view(np.int8)
    return np.concatenate([quants, scales], axis=-1).reshape(*lead, -1)


def pool_values(kind: BlockKind, rows: np.ndarray) -> np.ndarray:
    """The kind's pool rows [..., row] as f32 values [..., head_dim] (q8_0 through gguf's dequantize)."""
    if kind.kv_type != "q8_0":
        return rows.astype(np.float32)
    lead, d = rows.shape[:-1], kind.config.head_dim
    flat = rows.reshape(-1, rows.shape[-1]).view(np.uint8)
    blocks = np.concatenate([flat[:, d:].reshape(-1, d // 32, 2), flat[:, :d].reshape(-1, d // 32, 32)], axis=-1)
    return gguf.quants.dequantize(blocks.reshape(-1, d // 32 * 34), gguf.GGMLQuantizationType.Q8_0).reshape(*lead, d)


def rows_with_q8_scales(bits: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """f32 rows [..., blocks * 32] whose q8_0 blocks have the f16 scales of `bits` (uint16 [..., blocks]),
    and the q8_0 rows [..., blocks * 34] they quantize to: each block's first value is +-127 d (its amax),
    the others d * (q + f) with |q| <= 126 and |f| <= 0.4, so d = amax / 127 and round(x / d) = q however
    the kernel divides (1 / d computed approximately, amax times 1 / 127)."""
    d = bits.view(np.float16).astype(np.float32)[..., None]
    q = rng.integers(-126, 127, bits.shape + (32,))
    q[..., 0] = np.where(rng.random(bits.shape) < 0.5, -127, 127)
    frac = rng.uniform(-0.4, 0.4, q.shape).astype(np.float32)
    frac[..., 0] = 0
    q = np.where(d == 0, 0, q)
    values = (d * (q + frac)).astype(np.float32).reshape(*bits.shape[:-1], -1)
    scales = np.ascontiguousarray(bits.astype("<u2")).view(np.int8)
    return values, np.concatenate([q.reshape(values.shape).astype(np.int8), scales], axis=-1)


def paged_inputs(kind: BlockKind, rng, batch: int, seq: int, pasts: list[int], extra_pages: int = 3):
    """Random x, RoPE tables, a pool with shuffled page ids holding each sequence's history."""
    c, p = kind.config, kind.page_size
    pages_per_seq = [(n + seq + p - 1) // p for n in pasts]
    max_pages = max(pages_per_seq)
    num_pages = sum(pages_per_seq) + extra_pages
    pool = pool_rows(kind, rng.standard_normal((num_pages, 2, c.kv_heads, p, c.head_dim)).astype(np.float32))
    ids = rng.permutation(num_pages)
    table = np.zeros((batch, max_pages), np.int32)
    at = 0
    for bi, n_pages in enumerate(pages_per_seq):
        table[bi, :n_pages] = ids[at:at + n_pages]
        at += n_pages
    past = np.array(pasts, np.int32)
    positions = past[:, None] + np.arange(seq)[None, :]
    cos, sin = rope_tables(positions, c.head_dim, c.rope_theta)
    x = rng.standard_normal((batch, seq, c.hidden)).astype(np.float32)
    return dict(x=x, cos=cos, sin=sin, pages=pool, page_table=table, past=past)


def gla_block_forward(kind: BlockKind, weights, x, state):
    """Numpy forward of a gated linear-attention block, token by token; returns (y, state_out)."""
    c = kind.config
    b, s, _ = x.shape
    lin = lambda name, h: h @ linear_weight(kind, weights, name).T  # noqa: E731
    heads = lambda t: t.reshape(b, s, c.heads, c.head_dim)  # noqa: E731
    h = rms_norm(x, weights["attn_norm"], c.rms_eps)
    q = heads(lin("attn_q", h)) / np.sqrt(c.head_dim)
    k, v = heads(lin("attn_k", h)), heads(lin("attn_v", h))
    a = 1 / (1 + np.exp(-heads(lin("attn_gate", h))))
    st = state.astype(np.float64).copy()
    mixed = np.zeros((b, s, c.heads, c.head_dim))
    for t in range(s):
        st = a[:, t, :, :, None] * st + k[:, t, :, :, None] * v[:, t, :, None, :]
        mixed[:, t] = np.einsum("bhi,bhij->bhj", q[:, t], st)
    x2 = x + lin("attn_output", mixed.reshape(b, s, -1))
    h2 = rms_norm(x2, weights["ffn_norm"], c.rms_eps)
    g = lin("ffn_gate", h2)
    y = x2 + lin("ffn_down", g / (1 + np.exp(-g)) * lin("ffn_up", h2))
    return y.astype(np.float32), st.astype(np.float32)


def hf_last_logits(hf, ids: list[int]) -> np.ndarray:
    """transformers' logits for the last position of `ids`."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' `n` greedy tokens after `ids` (no stop token)."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, len(ids):].tolist()


def stepwise_logits(model, prompt: list[int], moves: dict[int, str], steps: int) -> list[np.ndarray]:
    """Each step's logits of one session, the host's greedy pick fed back, with `moves` (Model.move's
    "BLOCKS=TARGET,...") made before the given steps."""
    ex = model.executor
    session = ex.new_session()
    logits = [ex.forward(session, prompt)]
    for step in range(steps):
        if step in moves:
            for part in moves[step].split(","):
                model.move(*part.split("="))
        logits.append(ex.forward(session, [int(np.argmax(logits[-1]))]))
    return logits
