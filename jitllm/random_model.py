"""Random-weight models of named shapes, written as .jlm (speed work and tests need no downloads).

The tokenizer is byte-level with no merges: ids 0-3 are <s>, </s>, <|im_end|>, <|im_start|>, then the 256 bytes; the
rest of the vocabulary are padding tokens that never come out of the encoder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.core.jlm_writer import RegionPlan, TensorSpec, write_jlm
from jitllm.core.layouts import WEIGHT_TYPES, check_linear_shape, weight_parts
from jitllm.core.quant import parts_from_float
from jitllm.ir.blocks import FileWeight, block_file_weights, block_kind, block_linear_specs, check_block_types
from jitllm.ir.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("llama", 2, 64, 4, 2, 16, 128, 320, 256, 10000.0, 1e-5, tied_head=True),
    "tiny-d32": ModelConfig("llama", 2, 64, 2, 1, 32, 128, 320, 256, 10000.0, 1e-5, tied_head=True),
    "tiny-hybrid": ModelConfig("llama", 4, 64, 4, 2, 16, 128, 320, 256, 10000.0, 1e-5, tied_head=True,
                               block_types=("llama", "gla", "llama", "gla")),
    # tests/test_moe.py's shapes: Qwen3-MoE (q/k norms, 8 experts, top 2) and Mixtral (4 experts, top 2)
    "tiny-qwen3moe": ModelConfig("qwen3moe", 2, 64, 4, 2, 16, 96, 320, 256, 1000000.0, 1e-6, tied_head=True,
                                 block_types=("moe", "moe"), qk_norm=True, experts=8, experts_used=2, expert_ffn=32),
    "tiny-mixtral": ModelConfig("llama", 2, 64, 4, 2, 16, 32, 320, 256, 1000000.0, 1e-5, tied_head=True,
                                block_types=("moe", "moe"), experts=4, experts_used=2, expert_ffn=32),
    "smollm2-135m": ModelConfig("llama", 30, 576, 9, 3, 64, 1536, 49152, 8192, 100000.0, 1e-5, tied_head=True),
    "llama-3.2-1b": ModelConfig("llama", 16, 2048, 32, 8, 64, 8192, 128256, 131072, 500000.0, 1e-5, tied_head=True),
    "llama-3.2-3b": ModelConfig("llama", 28, 3072, 24, 8, 128, 8192, 128256, 131072, 500000.0, 1e-5, tied_head=True),
}
SPECIALS = ["<s>", "</s>", "<|im_end|>", "<|im_start|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer_json(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_tokens = sorted(alphabet, key=lambda ch: _byte_of(ch))
    tokens = SPECIALS + byte_tokens
    tokens += [f"<pad{i}>" for i in range(vocab - len(tokens))]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def write_random_model(path: str | Path, preset: str | ModelConfig, wtype: str = "q4_1", seed: int = 0,
                       progress=None) -> ModelConfig:
    """Write a random-weight model; weights ~ N(0, 1/fan_in) quantized to `wtype`, norms near 1."""
    cfg = PRESETS.get(preset) if isinstance(preset, str) else preset
    if cfg is None:
        raise JitllmError(f"unknown model shape {preset!r} (known: {', '.join(PRESETS)})")
    if cfg.vocab < len(SPECIALS) + 256:
        raise JitllmError(f"vocab {cfg.vocab} is too small for the byte tokenizer (needs {len(SPECIALS) + 256})")
    check_block_types(cfg)
    shapes = [block_linear_specs(cfg, i) for i in range(cfg.num_blocks)]
    _check_weight_type(cfg, wtype, preset if isinstance(preset, str) else "the shape")
    rng = np.random.default_rng(seed)

    def matrix(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)))

    def floats(name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A norm's weights near 1; another float tensor (an MoE router) as a matrix."""
        if name.endswith("norm"):
            return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
        return matrix(*shape)

    def linear(prefix: str, n: int, k: int, scale: float = 1.0):
        yield from ((f"{prefix}.{part}", arr) for part, arr in parts_from_float(wtype, matrix(n, k) * scale).items())

    def specs(prefix: str, n: int, k: int) -> list[TensorSpec]:
        return [TensorSpec(f"{prefix}.{part}", shape, dtype) for part, shape, dtype in weight_parts(wtype, n, k)]

    def globals_arrays():
        yield from linear("token_embd", cfg.vocab, cfg.hidden, 8)
        yield "output_norm", floats("output_norm", (cfg.hidden,))

    def block_arrays(contents: list[FileWeight]):
        for weight in contents:
            if weight.spec is None:
                yield weight.name, floats(weight.name, weight.shape)
            else:
                yield from linear(weight.name, *weight.shape)

    norm_spec = ((cfg.hidden,), "float32")
    plans = [RegionPlan("globals", (*specs("token_embd", cfg.vocab, cfg.hidden), TensorSpec("output_norm", *norm_spec)),
                        globals_arrays)]
    for i in range(cfg.num_blocks):
        contents = _file_order(block_file_weights(block_kind(cfg, i, dict.fromkeys(shapes[i], wtype)), i))
        tensors, pages = [], {}
        for weight in contents:
            made = ([TensorSpec(weight.name, weight.shape, "float32")] if weight.spec is None else
                    specs(weight.name, *weight.shape))
            tensors += made
            if weight.expert is not None:
                pages.setdefault(f"expert.{weight.expert}", []).extend(t.name for t in made)
        plans.append(RegionPlan(f"block.{i}", tuple(tensors), lambda contents=contents: block_arrays(contents),
                                tuple((page, tuple(names)) for page, names in pages.items())))

    meta = {
        "format": "jitllm-model",
        "config": cfg.to_json(),
        "weights": {"token_embd": wtype, "output": wtype, "blocks": [{n: wtype for n in s} for s in shapes]},
        "tokenizer": byte_tokenizer_json(cfg.vocab),
        "chat_template": CHATML,
        "bos_token_id": None,
        "eos_token_id": 1,
        "stop_token_ids": [1, 2],
        "add_bos": False,
        "source": {"kind": "random", "path": preset if isinstance(preset, str) else "custom", "seed": seed},
    }
    write_jlm(path, meta, plans, progress=progress)
    return cfg


def _file_order(contents: list[FileWeight]) -> list[FileWeight]:
    """A block's tensors as the file holds them: its float tensors (norms, router), its linears, then each
    expert's linears (one page each, as the converter writes them)."""
    return sorted(contents, key=lambda w: (-2 if w.spec is None else -1) if w.expert is None else w.expert)


def _check_weight_type(cfg: ModelConfig, wtype: str, label: str) -> None:
    """A one-line error where `wtype` is unknown or cannot store one of the shape's matrices (K-quants take
    inputs in multiples of 256, so `tiny` has none)."""
    if wtype not in WEIGHT_TYPES:
        raise JitllmError(f"unknown weight type {wtype!r} (known: {', '.join(WEIGHT_TYPES)})")
    matrices = {"token_embd": (cfg.vocab, cfg.hidden)}
    for i in range(cfg.num_blocks):
        matrices.update({f"blk.{i}.{n}": shape for n, shape in block_linear_specs(cfg, i).items()})
    for name, (n, k) in matrices.items():
        if reason := check_linear_shape(name, wtype, n, k):
            raise JitllmError(f"{label}: {reason}")


def preset_layout(preset: str, wtype: str, page_size: int = 16):
    """The block kinds a random model of `preset` uses, without writing it (to compile ahead of time)."""
    from jitllm.ir.head import head_kind
    from jitllm.runtime.model_layout import ModelLayout

    cfg = PRESETS.get(preset)
    if cfg is None:
        raise JitllmError(f"unknown model shape {preset!r} (known: {', '.join(PRESETS)})")
    _check_weight_type(cfg, wtype, preset)
    kinds = tuple(block_kind(cfg, i, {n: wtype for n in block_linear_specs(cfg, i)}, page_size)
                  for i in range(cfg.num_blocks))
    return ModelLayout(cfg, kinds, head_kind(cfg, wtype), wtype)
