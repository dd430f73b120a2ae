"""A llama-family GGUF file as a conversion source: config and tokenizer from metadata, tensors as stored.

GGUF already uses jitllm's conventions (W is [out, in]; llama's Q/K rows permuted for interleaved RoPE), so
quantized tensors pass through without dequantizing when their type is kept. Archs llama.cpp rotates
NeoX-style (qwen3) keep Q/K in the Hugging Face order: their rows are permuted as they are read (whole
rows, so quantized bytes still pass through).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from jitllm.core.errors import JitllmError, shown
from jitllm.core.quant import REPACK_ROWS, parts_from_float, parts_from_ggml
from jitllm.ir.config import ModelConfig, RopeScaling
from jitllm.ir.rope import yarn_attention_factor
from jitllm.tokenizer import GgufTensorInfo, check_token_settings, gguf_tokenizer, read_gguf
from jitllm.tokenizer.gguf_vocab import token_settings

from .rope_rows import interleaved_order

ARCHITECTURES = ("llama", "mistral", "qwen3", "qwen3moe")
NEOX_ARCHS = ("qwen3", "qwen3moe")
"""Archs llama.cpp rotates NeoX-style (LLAMA_ROPE_TYPE_NEOX): their q/k rows are stored in the Hugging
Face order and permuted here (convert/rope_rows.py)."""
QK_NORM_ARCHS = ("qwen3", "qwen3moe")
"""Archs with per-head q/k RMS norms (blk.N.attn_q_norm, attn_k_norm; ModelConfig.qk_norm)."""
# GGML tensor type -> the jitllm weight type it keeps when no -dtype is given (every other type, e.g. Q2_K,
# Q3_K, the IQ and TQ types, MXFP4, is refused by name)
NATIVE_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1",
                "Q5_0": "q5_0", "Q5_1": "q5_1", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
_REPACKED = ("bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
"""Types whose GGML bytes are repacked as they are (no dequantize and requantize)."""
_FLOAT_VIEWS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
"""GGML types whose tensors are viewed as numbers (the others as bytes), as GGUFReader does."""
_CONFIG_KEYS = {"num_blocks": "block_count", "hidden": "embedding_length", "heads": "attention.head_count",
                "kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
                "ffn": "feed_forward_length", "context": "context_length", "rope_theta": "rope.freq_base",
                "rms_eps": "attention.layer_norm_rms_epsilon"}
"""ModelConfig field -> its GGUF metadata key after "<arch>."."""
_EXPERT_KEYS = {"experts": "expert_count", "experts_used": "expert_used_count",
                "expert_ffn": "expert_feed_forward_length", "shared_ffn": "expert_shared_feed_forward_length"}
"""The MoE fields (Mixtral's llama-arch GGUFs keep the experts' size in feed_forward_length)."""


@dataclass(frozen=True)
class _Tensor:
    """A tensor of the file: `shape` numpy's way ([out, in]), `data` a view of the map (None for a GGML type
    gguf does not know), as GGUFReader gives it: F32/F16 values, the other types' bytes as [rows, row bytes]."""

    shape: tuple[int, ...]
    type_name: str
    qtype: GGMLQuantizationType | None
    data: np.ndarray | None


class GgufSource:
    """Tensors are named the GGUF way without ".weight" ("token_embd", "blk.3.attn_q", "output_norm")."""

    kind = "gguf"

    def __init__(self, path: Path) -> None:
        self.path = path
        contents = read_gguf(path)
        meta = contents.metadata  # (not kept: the vocabulary's Python objects are tens of MB)
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise JitllmError(f"cannot read {path}: {e.strerror or e}") from None
        data = np.frombuffer(self._map, np.uint8)[contents.data_start:]
        self._tensors = {t.name: _mapped_tensor(path, t, data) for t in contents.tensors}
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise JitllmError(f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
        self._neox = arch in NEOX_ARCHS
        self.config = self._config(meta, arch)
        tok = gguf_tokenizer(meta)
        settings = token_settings(meta, tok)
        del contents, meta  # (the vocabulary's lists are not held beside the tokenizer's JSON)
        self.tokenizer_meta = {"tokenizer": tok.to_str(), **settings}
        try:
            check_token_settings(tok, self.tokenizer_meta, self.config.vocab)
        except JitllmError as e:
            raise JitllmError(f"{path.name}: {e}") from None

    def tensor_name(self, name: str) -> str:
        return f"{name}.weight"

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape [out, in] or [n], weight type kept by default) of a tensor."""
        t = self._tensor(name)
        return t.shape, _native_type(self.tensor_name(name), t)

    def floats(self, name: str) -> np.ndarray:
        t = self._tensor(name)
        _native_type(self.tensor_name(name), t)
        order = self._row_order(name, t.shape[0])
        return _floats(t.data if order is None else t.data[order], t.qtype)

    def parts(self, name: str, wtype: str) -> Iterator[tuple[str, np.ndarray]]:
        """The matrix's layout parts as (part, leading rows) pieces in row order, REPACK_ROWS matrix rows at
        a time with the file's pages let go after each, so neither a large matrix's source bytes nor its
        parts (the embedding's) are held whole."""
        (n, k), native = self.info(name)
        t = self._tensor(name)
        order = self._row_order(name, n)
        for start in range(0, n, REPACK_ROWS):
            rows = t.data[start:start + REPACK_ROWS] if order is None else t.data[order[start:start + REPACK_ROWS]]
            if wtype == native and wtype in _REPACKED:
                chunk = parts_from_ggml(wtype, rows, len(rows), k)
            else:
                chunk = parts_from_float(wtype, _floats(rows, t.qtype))
            self.release_pages()
            yield from chunk.items()
            del chunk

    def release_pages(self) -> None:
        """Let go of the pages of the file this process has read through the map (they stay in the page
        cache), so converting a large model does not hold all of it in memory."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def _row_order(self, name: str, rows: int) -> np.ndarray | None:
        """Where the rows of a NeoX-order arch's q/k projection (or q/k norm) come from, else None."""
        tensor = name.rsplit(".", 1)[-1]
        if not self._neox or tensor not in ("attn_q", "attn_k", "attn_q_norm", "attn_k_norm"):
            return None
        heads = {"attn_q": self.config.heads, "attn_k": self.config.kv_heads}.get(tensor, 1)
        return interleaved_order(rows, heads)

    def _tensor(self, name: str) -> _Tensor:
        stacked, _, expert = name.rpartition(".")
        if stacked.endswith("_exps") and expert.isdigit():
            return self._expert(stacked, int(expert))
        t = self._tensors.get(self.tensor_name(name))
        if t is None:
            raise JitllmError(f"{self.path.name}: missing tensor {self.tensor_name(name)}")
        return t

    def _expert(self, stacked: str, expert: int) -> _Tensor:
        """Expert `expert` of a block's [experts, rows, cols] tensor (blk.N.ffn_gate_exps), as a tensor of
        its own (a view of its rows)."""
        t = self._tensor(stacked)
        if len(t.shape) != 3 or t.shape[0] != self.config.experts:
            raise JitllmError(f"{self.tensor_name(stacked)}: shape {list(t.shape)}, expected "
                              f"[{self.config.experts}, rows, cols] (one matrix per expert)")
        return _Tensor(t.shape[1:], t.type_name, t.qtype, None if t.data is None else t.data[expert])

    def _config(self, meta: dict[str, Any], arch: str) -> ModelConfig:
        """The config from the metadata, typed and range-checked by ModelConfig.from_json (messages name the
        GGUF keys); the vocabulary is the embedding's row count."""
        p = f"{arch}."
        names = {field: p + key for field, key in _CONFIG_KEYS.items()}
        names |= {field: p + key for field, key in _EXPERT_KEYS.items()}
        values: dict[str, Any] = {"arch": arch, "qk_norm": arch in QK_NORM_ARCHS,
                                  **{f: meta[k] for f, k in names.items() if meta.get(k) is not None}}
        if values.get("experts"):  # (llama.cpp renormalises these archs' top-k weights: build_moe_ffn's norm_w)
            values.setdefault("expert_ffn", values.get("ffn"))
            if type(values.get("num_blocks")) is int:
                values["block_types"] = ["moe"] * values["num_blocks"]
        if "heads" in values:
            values.setdefault("kv_heads", values["heads"])
        if "head_dim" not in values and type(values.get("hidden")) is int and type(values.get("heads")) is int:
            values["head_dim"] = values["hidden"] // max(values["heads"], 1)  # (heads < 1 is reported first)
        embedding = self.info("token_embd")[0]
        if len(embedding) != 2:
            raise JitllmError(f"token_embd.weight: shape {list(embedding)}, expected [vocab, hidden]")
        values |= {"vocab": embedding[0], "tied_head": "output.weight" not in self._tensors}
        values.setdefault("rope_theta", 10000.0)
        try:
            cfg = ModelConfig.from_json(values, names)
        except JitllmError as e:
            raise JitllmError(f"{self.path.name}: {e}") from None
        rope_dim = self._number(meta, p + "rope.dimension_count", cfg.head_dim, int)
        if rope_dim != cfg.head_dim:
            raise JitllmError(f"partial rotary embedding ({rope_dim} of {cfg.head_dim} dims) is not supported")
        return replace(cfg, rope_theta=_f32(cfg.rope_theta), rms_eps=_f32(cfg.rms_eps),
                       rope_scaling=self._rope_scaling(meta, p, cfg.head_dim, cfg.context))

    def _number(self, meta: dict[str, Any], key: str, default: float, kind: type = float) -> Any:
        """A numeric metadata value (`kind` int: an integer), or `default` where the key is absent."""
        value = meta.get(key, default)
        if type(value) is not kind and not (kind is float and type(value) is int):
            noun = "an integer" if kind is int else "a number"
            raise JitllmError(f"{self.path.name}: {key} must be {noun} (got {shown(value)})")
        return value

    def _rope_scaling(self, meta: dict[str, Any], p: str, head_dim: int, context: int) -> RopeScaling:
        """The RoPE scaling as llama.cpp reads it: rope.scaling.type (linear where it is absent but a factor is
        set), rope.scaling.factor (or the older rope.scale_linear), rope.scaling.attn_factor on cos/sin, and
        Llama 3's per-pair frequency divisors in the rope_freqs.weight tensor. YaRN's parameters are the
        yarn_* keys convert_hf_to_gguf.py copies from config.json, read as transformers reads them."""
        key = f"{p}rope.scaling."
        factor = self._number(meta, key + "factor", 0.0) or self._number(meta, p + "rope.scale_linear", 0.0)
        kind = meta.get(key + "type", "linear" if factor not in (0.0, 1.0) else "none")
        attn = _f32(self._number(meta, key + "attn_factor", 1.0))
        if "rope_freqs.weight" in self._tensors:
            if kind != "none":
                raise JitllmError(f"rope_freqs.weight with rope scaling {kind!r} is not supported")
            divisors = self.floats("rope_freqs")
            if divisors.shape != (head_dim // 2,):
                raise JitllmError(f"rope_freqs.weight: shape {list(divisors.shape)}, expected [{head_dim // 2}]")
            return RopeScaling("llama3", attention_factor=attn, freq_factors=tuple(float(d) for d in divisors))
        if kind == "none":
            return RopeScaling(attention_factor=attn)
        if kind not in ("linear", "yarn"):
            raise JitllmError(f"rope scaling {kind!r} is not supported (supported: none, linear, yarn, "
                              "and llama3 as rope_freqs.weight)")
        if not factor:
            raise JitllmError(f"{self.path.name}: GGUF metadata lacks {key}factor (rope scaling {kind!r})")
        factor = _f32(factor)
        if kind == "linear":
            return RopeScaling("linear", factor, attention_factor=attn)
        for name, plain in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
            if self._number(meta, key + name, plain) != plain:
                raise JitllmError(f"{key}{name} = {meta[key + name]} is not supported")
        attention = (_f32(self._number(meta, key + "yarn_attn_factor", 1.0)) if key + "yarn_attn_factor" in meta
                     else yarn_attention_factor(factor))
        return RopeScaling("yarn", factor, self._number(meta, key + "original_context_length", 0, int) or context,
                           beta_fast=_f32(self._number(meta, key + "yarn_beta_fast", 32.0)),
                           beta_slow=_f32(self._number(meta, key + "yarn_beta_slow", 1.0)), attention_factor=attention * attn)


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _floats(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def _native_type(name: str, t: _Tensor) -> str:
    if t.type_name not in NATIVE_TYPES:
        raise JitllmError(f"{name}: tensor type {t.type_name} is not supported ({', '.join(NATIVE_TYPES)} are)")
    return NATIVE_TYPES[t.type_name]


def _mapped_tensor(path: Path, info: GgufTensorInfo, data: np.ndarray) -> _Tensor:
    """A tensor info with its view of the data section, its bytes checked to lie inside the file."""
    shape = tuple(reversed(info.dims))
    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:  # a type this gguf does not know: reported by name if the tensor is used
        return _Tensor(shape, str(info.ggml_type), None, None)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if not info.dims or info.dims[0] % block:
        raise JitllmError(f"{path}: truncated or corrupt GGUF file ({info.name}: dims {list(info.dims)} "
                          f"for {qtype.name})")
    nbytes = math.prod(info.dims) // block * type_size
    if info.offset + nbytes > len(data):
        raise JitllmError(f"{path}: truncated or corrupt GGUF file ({info.name} lies past its end)")
    view = data[info.offset:info.offset + nbytes]
    if qtype in _FLOAT_VIEWS:
        view = view.view(_FLOAT_VIEWS[qtype]).reshape(shape)
    else:
        view = view.reshape(quant_shape_to_byte_shape(shape, qtype))
    return _Tensor(shape, qtype.name, qtype, view)
