"""`jitllm convert`: a GGUF file or a Hugging Face llama directory -> one .jlm model file.

Both sources answer the same questions by GGUF tensor name ("token_embd", "blk.3.attn_q", "output_norm"):
`info(name)` -> (shape, default weight type), `floats(name)` -> f32 array, `parts(name, wtype)` -> layout
parts; plus `config`, `tokenizer_meta` and `tensor_name(name)` (the source's own name, for messages).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.core.jlm import write_jlm
from jitllm.core.layouts import check_linear_shape
from jitllm.ir.config import ModelConfig
from jitllm.ir.llama import BLOCK_LINEARS, block_linear_shapes

from .gguf_source import GgufSource
from .hf_source import HfSource

CONVERT_TYPES = ("f32", "f16", "q8_0")
"""Weight types -dtype can ask for; without it quantized weights stay as they are."""

Source = GgufSource | HfSource


def open_source(src: Path) -> Source:
    """The source behind a path: a GGUF file (by magic) or a directory with config.json."""
    if src.is_dir() and (src / "config.json").is_file():
        return HfSource(src)
    if src.is_file():
        try:
            with open(src, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise JitllmError(f"cannot read {src}: {e.strerror or e}") from None
        if magic == b"GGUF":
            return GgufSource(src)
    elif not src.exists():
        raise JitllmError(f"{src}: no such file or directory")
    raise JitllmError(f"{src} is neither a GGUF file nor a Hugging Face model directory")


def convert(src: str, out: str, dtype: str | None = None, progress: bool = True) -> dict:
    """Convert `src` to the .jlm file `out` (written atomically). `dtype` None keeps each weight's type;
    "f32"/"f16"/"q8_0" converts every linear and the embedding. Returns a summary."""
    if dtype is not None and dtype not in CONVERT_TYPES:
        raise JitllmError(f"dtype {dtype!r} is not one of {', '.join(CONVERT_TYPES)}")
    src_path, out_path = Path(src), Path(out)
    _check_output(out_path)
    source = open_source(src_path)
    cfg = source.config
    weights = _weight_types(source, cfg, dtype)
    meta = {"format": "jitllm-model", "config": cfg.to_json(), "weights": weights, **source.tokenizer_meta,
            "source": {"kind": source.kind, "path": src_path.name}}
    from tqdm import tqdm

    with tqdm(total=cfg.num_blocks, desc="convert", unit="block", file=sys.stderr, disable=not progress) as bar:
        write_jlm(out_path, meta, _regions(source, cfg, weights, bar.update))
    block_types = sorted({t for block in weights["blocks"] for t in block.values()})
    return {"path": str(out_path), "arch": cfg.arch, "blocks": cfg.num_blocks, "bytes": out_path.stat().st_size,
            "weight_types": {"token_embd": weights["token_embd"], "output": weights["output"],
                             "blocks": block_types}, "tied_head": cfg.tied_head}


def _check_output(out: Path) -> None:
    """Fail before any work if `out` cannot be written (a directory, a path under a file, no permission)."""
    if out.is_dir():
        raise JitllmError(f"cannot write {out}: it is a directory")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise JitllmError(f"cannot write {out}: {parent} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise JitllmError(f"cannot write {out}: cannot create files in {parent} ({e.strerror or e})") from None


def _weight_types(source: Source, cfg: ModelConfig, dtype: str | None) -> dict:
    """The header's "weights" entry, after checking every tensor's presence, type and shape."""

    def check(name: str, shape: tuple[int, ...]) -> str:
        got, native = source.info(name)
        if got != shape:
            raise JitllmError(f"{source.tensor_name(name)}: shape {list(got)}, expected {list(shape)} from the config")
        wtype = dtype or native
        if len(shape) == 2 and (reason := check_linear_shape(source.tensor_name(name), wtype, *shape)):
            raise JitllmError(reason)
        return wtype

    norm = (cfg.hidden,)
    check("output_norm", norm)
    embd = check("token_embd", (cfg.vocab, cfg.hidden))
    head = embd if cfg.tied_head else check("output", (cfg.vocab, cfg.hidden))
    blocks = []
    for i in range(cfg.num_blocks):
        check(f"blk.{i}.attn_norm", norm)
        check(f"blk.{i}.ffn_norm", norm)
        blocks.append({lin: check(f"blk.{i}.{lin}", shape) for lin, shape in block_linear_shapes(cfg).items()})
    return {"token_embd": embd, "output": head, "blocks": blocks}


def _regions(source: Source, cfg: ModelConfig, weights: dict, step) -> Iterator[tuple[str, list]]:
    """("globals", ...), ("block.0", ...), ...: tensors in call order, one region per block."""

    def linear(name: str, wtype: str) -> list[tuple[str, np.ndarray]]:
        return [(f"{name}.{part}", arr) for part, arr in source.parts(name, wtype).items()]

    items = linear("token_embd", weights["token_embd"]) + [("output_norm", source.floats("output_norm"))]
    if not cfg.tied_head:
        items += linear("output", weights["output"])
    yield "globals", items
    for i, types in enumerate(weights["blocks"]):
        items = []
        for norm, linears in (("attn_norm", BLOCK_LINEARS[:4]), ("ffn_norm", BLOCK_LINEARS[4:])):
            items.append((f"blk.{i}.{norm}", source.floats(f"blk.{i}.{norm}")))
            for lin in linears:
                items += linear(f"blk.{i}.{lin}", types[lin])
        yield f"block.{i}", items
        step()
