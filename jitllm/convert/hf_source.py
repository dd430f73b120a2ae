"""A Hugging Face llama/mistral/qwen3 directory as a conversion source (config.json, *.safetensors, tokenizer files).

Safetensors are read straight from a memory map (no torch; bf16 stays bf16, widened to f32 by hand where
floats are asked for). q_proj and k_proj rows are permuted into GGUF's order, so RoPE rotates interleaved
pairs for both sources.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from safetensors import SafetensorError, safe_open

from jitllm.core.errors import JitllmError, shown
from jitllm.core.quant import parts_from_float
from jitllm.ir.config import ModelConfig, RopeScaling
from jitllm.ir.rope import yarn_attention_factor
from jitllm.tokenizer import check_token_settings, stop_token_ids

from .rope_rows import permute_rows

# config.json "architectures" (or "model_type" when that is missing) -> ModelConfig.arch
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "mixtral", "llama": "llama",
                 "mistral": "mistral", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "mixtral"}
QK_NORM_ARCHS = ("qwen3", "qwen3moe")
"""Architectures whose attention RMS-normalises each head of q and k (ModelConfig.qk_norm)."""
HF_ROPE_TYPES = ("linear", "llama3", "yarn")
"""config.json rope types beside "default" (transformers' ROPE_INIT_FUNCTIONS names)."""
# safetensors dtype -> (numpy dtype as stored, the jitllm weight type it keeps when no -dtype is given)
DTYPES = {"F32": ("float32", "f32"), "F16": ("float16", "f16"), "BF16": ("uint16", "bf16")}
_CONFIG_KEYS = {"num_blocks": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "ffn": "intermediate_size",
                "vocab": "vocab_size", "context": "max_position_embeddings", "rope_theta": "rope_theta",
                "rms_eps": "rms_norm_eps", "tied_head": "tie_word_embeddings"}
"""ModelConfig field -> its config.json key."""
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
EXPERT_NAMES = {
    "qwen3moe": {"experts": "mlp.experts", "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "gate_proj",
                 "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"},
    "mixtral": {"experts": "block_sparse_moe.experts", "ffn_gate_inp": "block_sparse_moe.gate",
                "ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"},
}
"""Per MoE architecture: the module holding its experts, its router, and each expert's projections (the
hub checkpoints' per-expert layout: model.layers.N.mlp.experts.E.gate_proj.weight)."""
FUSED_EXPERTS = ("mlp.experts", "block_sparse_moe.experts")
"""Where transformers' fused expert layout may keep them: gate_up_proj [E, 2F, H], down_proj [E, H, F]."""


class HfSource:
    """Tensors are asked for by their GGUF names ("token_embd", "blk.3.attn_q") and mapped to HF's."""

    kind = "hf"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._cfg = _read_json(path / "config.json")
        self.config = self._config()
        self._tensors: dict[str, tuple[mmap.mmap, str, tuple[int, ...], int]] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise JitllmError(f"{path}: no *.safetensors weight files")
        for file in files:
            self._tensors.update(_index_safetensors(file))
        self._names = {**_BLOCK_NAMES, **EXPERT_NAMES.get(self.config.arch, {})}
        if self.config.arch in EXPERT_NAMES:
            self._tensors.update(_split_fused_experts(self._tensors, self._names))
        self.tokenizer_meta = _tokenizer_meta(path, self._cfg, self.config.vocab)

    def tensor_name(self, name: str) -> str:
        if name.startswith("blk."):
            _, block, part = name.split(".", 2)
            linear, _, expert = part.partition(".")  # (an expert's projection: "ffn_gate_exps.3")
            if expert:
                return f"model.layers.{block}.{self._names['experts']}.{expert}.{self._names[linear]}.weight"
            return f"model.layers.{block}.{self._names[part]}.weight"
        return f"{_GLOBAL_NAMES[name]}.weight"

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape [out, in] or [n], weight type kept by default) of a tensor."""
        _, dtype, shape, _ = self._entry(name)
        return shape, DTYPES[dtype][1]

    def floats(self, name: str) -> np.ndarray:
        buf, dtype, shape, offset = self._entry(name)
        raw = np.frombuffer(buf, dtype=DTYPES[dtype][0], count=int(np.prod(shape)), offset=offset).reshape(shape)
        w = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw.astype(np.float32)
        if name.endswith(".attn_q"):
            w = permute_rows(w, self.config.heads)
        elif name.endswith(".attn_k"):
            w = permute_rows(w, self.config.kv_heads)
        elif name.endswith((".attn_q_norm", ".attn_k_norm")):  # (one head's values, in the rows' new order)
            w = permute_rows(w, 1)
        return w

    def parts(self, name: str, wtype: str) -> Iterator[tuple[str, np.ndarray]]:
        """The matrix's layout parts as (part, array) pairs (each whole)."""
        yield from parts_from_float(wtype, self.floats(name)).items()

    def release_pages(self) -> None:
        """Let go of the pages of the weight files this process has read through their maps (they stay in
        the page cache), so converting a large model does not hold all of it in memory."""
        for buf in {id(entry[0]): entry[0] for entry in self._tensors.values()}.values():
            buf.madvise(mmap.MADV_DONTNEED)

    def _entry(self, name: str) -> tuple[mmap.mmap, str, tuple[int, ...], int]:
        full = self.tensor_name(name)
        entry = self._tensors.get(full)
        if entry is None:
            raise JitllmError(f"{self.path.name}: missing tensor {full}")
        if entry[1] not in DTYPES:
            raise JitllmError(f"{full}: dtype {entry[1]} is not supported ({', '.join(DTYPES)} are)")
        return entry

    def _config(self) -> ModelConfig:
        """The config from config.json, typed and range-checked by ModelConfig.from_json (messages name
        config.json's keys), with transformers' defaults where a key is absent."""
        c, where = self._cfg, self.path / "config.json"
        architectures = c.get("architectures") or [c.get("model_type")]
        name = architectures[0] if isinstance(architectures, list) else architectures
        if not isinstance(name, str) or name not in ARCHITECTURES:
            raise JitllmError(f"unsupported architecture {shown(name)} (supported: {', '.join(ARCHITECTURES)})")
        _, rope = _rope_parameters(c, where)
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if c.get(flag):
                raise JitllmError(f"{flag} is not supported")
        layer_types = c.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise JitllmError(f"layer types {shown(sorted(set(layer_types) - {'full_attention'}))} are not "
                              "supported (only full attention)")
        arch = ARCHITECTURES[name]
        values: dict[str, Any] = {"arch": arch, "context": 2048, "rope_theta": 10000.0,
                                  "rms_eps": 1e-6, "tied_head": False, "qk_norm": arch in QK_NORM_ARCHS}
        if arch in EXPERT_NAMES:
            values |= _expert_values(c, arch)
        values |= {f: c[key] for f, key in _CONFIG_KEYS.items() if c.get(key) is not None}
        if rope.get("rope_theta") is not None:
            values["rope_theta"] = rope["rope_theta"]
        if "heads" in values:
            values.setdefault("kv_heads", values["heads"])
        if "head_dim" not in values and type(values.get("hidden")) is int and type(values.get("heads")) is int:
            values["head_dim"] = values["hidden"] // max(values["heads"], 1)  # (heads < 1 is reported first)
        try:
            cfg = ModelConfig.from_json(values, _CONFIG_KEYS | _EXPERT_KEYS)
        except JitllmError as e:
            raise JitllmError(f"{where}: {e}") from None
        return replace(cfg, rope_scaling=hf_rope_scaling(c, where))


def _expert_values(c: dict, arch: str) -> dict[str, Any]:
    """The MoE fields of the config (its raw values: ModelConfig.from_json types and checks them), and which
    blocks are MoE blocks: Qwen3-MoE's decoder_sparse_step and mlp_only_layers keep some dense."""
    experts = c.get("num_experts", c.get("num_local_experts"))
    values = {"experts": experts, "experts_used": c.get("num_experts_per_tok"),
              "expert_ffn": c.get("moe_intermediate_size") if arch == "qwen3moe" else c.get("intermediate_size"),
              "norm_topk": c.get("norm_topk_prob", False) if arch == "qwen3moe" else True}
    values = {k: v for k, v in values.items() if v is not None}
    layers, step, dense = c.get("num_hidden_layers"), c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
    if type(layers) is int and type(step) is int and step > 0 and isinstance(dense, list):
        values["block_types"] = ["moe" if i not in dense and (i + 1) % step == 0 else "llama" for i in range(layers)]
    return values


_EXPERT_KEYS = {"experts": "num_experts", "experts_used": "num_experts_per_tok", "expert_ffn": "moe_intermediate_size",
                "norm_topk": "norm_topk_prob"}


def _split_fused_experts(tensors: dict, names: dict[str, str]) -> dict[str, tuple[mmap.mmap, str, tuple[int, ...], int]]:
    """Per-expert entries (under the hub layout's names) for transformers' fused expert tensors:
    gate_up_proj [E, 2F, H] holds expert e's gate rows then its up rows, down_proj [E, H, F] its down
    matrix, each a contiguous run of the file. (Mixtral's router is mlp.gate in that layout.)"""
    out = {}
    for full, (buf, dtype, shape, offset) in tensors.items():
        if full.endswith(".mlp.gate.weight") and names["ffn_gate_inp"] != "mlp.gate":  # (its router there too)
            out[full.replace(".mlp.gate.", f".{names['ffn_gate_inp']}.")] = (buf, dtype, shape, offset)
        stem = full.removesuffix(".weight")
        module, _, which = stem.rpartition(".")
        if which not in ("gate_up_proj", "down_proj") or not module.endswith(FUSED_EXPERTS) or len(shape) != 3:
            continue
        size = np.dtype(DTYPES[dtype][0]).itemsize if dtype in DTYPES else 0
        experts, rows, cols = shape
        prefix = module.removesuffix(".experts").removesuffix(".mlp").removesuffix(".block_sparse_moe")
        for e in range(experts):
            at = offset + e * rows * cols * size
            base = f"{prefix}.{names['experts']}.{e}"
            if which == "down_proj":
                out[f"{base}.{names['ffn_down_exps']}.weight"] = (buf, dtype, (rows, cols), at)
            else:
                half = rows // 2
                out[f"{base}.{names['ffn_gate_exps']}.weight"] = (buf, dtype, (half, cols), at)
                out[f"{base}.{names['ffn_up_exps']}.weight"] = (buf, dtype, (half, cols), at + half * cols * size)
    return out


def hf_rope_scaling(c: dict, where: Path) -> RopeScaling:
    """config.json's RoPE scaling as transformers reads it: `rope_scaling`, else transformers 5's
    `rope_parameters` (rope_type default, linear, llama3 or yarn, with transformers' defaults)."""
    key, rope = _rope_parameters(c, where)
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise JitllmError(f"partial rotary embedding (partial_rotary_factor {shown(partial)}) is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return RopeScaling()
    if kind not in HF_ROPE_TYPES:
        raise JitllmError(f"rope scaling {shown(kind)} is not supported (supported: {', '.join(HF_ROPE_TYPES)})")

    def need(name: str) -> float:
        if rope.get(name) is None:
            raise JitllmError(f"{where}: {key} lacks {name!r} (rope type {kind!r})")
        return _number(rope[name], name, where)

    def optional(name: str) -> float | None:
        return None if rope.get(name) is None else _number(rope[name], name, where)

    factor = need("factor")
    if kind == "linear":
        return RopeScaling("linear", factor)
    original = (c.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                or c.get("max_position_embeddings", 2048))
    if type(original) is not int:
        raise JitllmError(f"{where}: original_max_position_embeddings must be an integer (got {shown(original)})")
    if kind == "llama3":
        return RopeScaling("llama3", factor, original, need("low_freq_factor"), need("high_freq_factor"))
    attention = optional("attention_factor")
    if attention is None:
        attention = yarn_attention_factor(factor, optional("mscale"), optional("mscale_all_dim"))
    truncate = rope.get("truncate", True)
    if type(truncate) is not bool:
        raise JitllmError(f"{where}: truncate must be true or false (got {shown(truncate)})")
    return RopeScaling("yarn", factor, original, beta_fast=optional("beta_fast") or 32.0,
                       beta_slow=optional("beta_slow") or 1.0, truncate=truncate, attention_factor=attention)


def _number(value: object, name: str, where: Path) -> float:
    if type(value) not in (int, float):
        raise JitllmError(f"{where}: {name} must be a number (got {shown(value)})")
    return float(value)


def _rope_parameters(c: dict, where: Path) -> tuple[str, dict]:
    """The key config.json declares RoPE under and its dict: older configs' `rope_scaling` wins over
    `rope_parameters`, as in transformers."""
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    rope = c.get(key) or {}
    if not isinstance(rope, dict):
        raise JitllmError(f"{where}: {key} must be an object (got {shown(rope)})")
    return key, rope


def _read_json(path: Path) -> dict:
    """A JSON file holding one object (config.json and its companions)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise JitllmError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError):
        raise JitllmError(f"{path}: not valid JSON") from None
    if not isinstance(data, dict):
        raise JitllmError(f"{path}: must hold a JSON object (got {type(data).__name__})")
    return data


def _index_safetensors(path: Path) -> dict[str, tuple[mmap.mmap, str, tuple[int, ...], int]]:
    """name -> (map, dtype, shape, byte offset) for every tensor of one file.

    Format: u64 little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, data. The
    safetensors library checks the header first: each tensor's data_offsets span exactly shape x dtype,
    the tensors tile the data without gaps or overlaps, and the data ends with the file."""
    try:
        safe_open(path, framework="numpy")
    except SafetensorError as e:
        reason = str(e).removeprefix("Error while deserializing header: ")
        raise JitllmError(f"{path.name}: truncated or corrupt safetensors file ({reason})") from None
    except OSError as e:
        raise JitllmError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        with open(path, "rb") as f:
            hlen = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(hlen))
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise JitllmError(f"cannot read {path}: {e.strerror or e}") from None
    return {name: (buf, t["dtype"], tuple(t["shape"]), 8 + hlen + t["data_offsets"][0])
            for name, t in header.items() if name != "__metadata__"}


def _tokenizer_meta(path: Path, cfg: dict, vocab: int) -> dict:
    """The header's token fields, checked against the model's `vocab` (its embedding rows)."""
    if not (path / "tokenizer.json").is_file():
        raise JitllmError(f"{path}: no tokenizer.json")
    try:
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises bare Exception)
        raise JitllmError(f"{path / 'tokenizer.json'}: cannot be loaded: {e}") from None
    tc = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    sources = {"tokenizer_config.json": tc, "generation_config.json": gen, "config.json": cfg}

    def token_id(value: Any) -> int | None:
        content = value.get("content") if isinstance(value, dict) else value
        return tok.token_to_id(content) if isinstance(content, str) else None

    def ids(key: str, *files: str) -> list[int]:
        return [i for file in files for i in _ids(sources[file].get(key), path / file, key)]

    bos = token_id(tc.get("bos_token"))
    if bos is None:
        bos = next(iter(ids("bos_token_id", "generation_config.json", "config.json")), None)
    eos_ids = [i for i in [token_id(tc.get("eos_token")), *ids("eos_token_id", "generation_config.json", "config.json")]
               if i is not None]
    if not eos_ids:
        raise JitllmError(f"{path}: no EOS token in tokenizer_config.json, generation_config.json or config.json")
    add_bos = tc["add_bos_token"] if "add_bos_token" in tc else _post_processor_adds(tok, bos)
    if type(add_bos) is not bool:
        raise JitllmError(f"{path / 'tokenizer_config.json'}: add_bos_token must be true or false (got {shown(add_bos)})")
    meta = {"tokenizer": tok.to_str(), "chat_template": _chat_template(path, tc), "bos_token_id": bos,
            "eos_token_id": eos_ids[0], "stop_token_ids": stop_token_ids(tok, eos_ids), "add_bos": add_bos}
    try:
        check_token_settings(tok, meta, vocab)
    except JitllmError as e:
        raise JitllmError(f"{path}: {e}") from None
    return meta


def _ids(value: Any, where: Path, key: str) -> list[int]:
    """A token id or a list of them (generation_config.json's eos_token_id may be either)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(type(i) is int for i in ids):
        raise JitllmError(f"{where}: {key} must be a token id or a list of them (got {shown(value)})")
    return ids


def _chat_template(path: Path, tc: dict) -> str | None:
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if template is None and (path / "chat_template.jinja").is_file():
        try:
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        except OSError as e:
            raise JitllmError(f"cannot read {path / 'chat_template.jinja'}: {e.strerror or e}") from None
        except ValueError:
            raise JitllmError(f"{path / 'chat_template.jinja'}: not UTF-8 text") from None
    if not isinstance(template, (str, type(None))):
        raise JitllmError(f"{path / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                          f"named templates (got {shown(template)})")
    return template


def _post_processor_adds(tok: tokenizers.Tokenizer, bos: int | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (Llama-3 style), when tokenizer_config.json
    does not say."""
    if bos is None:
        return False
    bos_token = tok.id_to_token(bos)
    processors = [json.loads(tok.to_str()).get("post_processor") or {}]
    while processors:
        p = processors.pop()
        processors += p.get("processors") or []
        first = (p.get("single") or [{}])[0] if p.get("type") == "TemplateProcessing" else {}
        if first.get("SpecialToken", {}).get("id") == bos_token:
            return True
    return False
