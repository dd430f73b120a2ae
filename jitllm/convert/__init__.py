"""`jitllm convert`: a GGUF file or a Hugging Face llama directory -> one .jlm model file.

Both sources answer the same questions by GGUF tensor name ("token_embd", "blk.3.attn_q", "output_norm"):
`info(name)` -> (shape, default weight type), `floats(name)` -> f32 array, `parts(name, wtype)` -> layout
parts as (part, array) pieces (whole, or runs of leading rows in order: jitllm.core.jlm_writer); plus `config`, `tokenizer_meta` and `tensor_name(name)` (the source's own name, for messages).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jitllm.core.atomic import writable_target
from jitllm.core.errors import JitllmError
from jitllm.core.jlm_writer import RegionPlan, TensorSpec, write_jlm
from jitllm.core.layouts import check_linear_shape, weight_parts
from jitllm.ir.blocks import FileWeight, block_file_weights, block_kind, block_linear_specs
from jitllm.ir.config import ModelConfig

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
    _check_output(out_path, src_path)
    source = open_source(src_path)
    cfg = source.config
    weights = _weight_types(source, cfg, dtype)
    meta = {"format": "jitllm-model", "config": cfg.to_json(), "weights": weights, **source.tokenizer_meta,
            "source": {"kind": source.kind, "path": src_path.name}}
    from tqdm import tqdm

    with tqdm(total=cfg.num_blocks, desc="convert", unit="block", file=sys.stderr, disable=not progress) as bar:
        write_jlm(out_path, meta, _plans(source, cfg, weights), progress=lambda region: bar.update(0 if region == "globals" else 1))
    block_types = sorted({t for block in weights["blocks"] for t in block.values()})
    return {"path": str(out_path), "arch": cfg.arch, "blocks": cfg.num_blocks, "bytes": out_path.stat().st_size,
            "weight_types": {"token_embd": weights["token_embd"], "output": weights["output"],
                             "blocks": block_types}, "tied_head": cfg.tied_head}


def _check_output(out: Path, src: Path) -> None:
    """Fail before any work if `out` cannot be written (a directory, a device or another non-regular file,
    a path under a file, no permission) or is one of the files the conversion reads."""
    writable_target(out)
    if out.is_dir():
        raise JitllmError(f"cannot write {out}: it is a directory")
    if out.exists() and any(_same_file(out, f) for f in _source_files(src)):
        raise JitllmError(f"cannot write {out}: it is the model being converted ({src}); choose another output")
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


def _source_files(src: Path) -> list[Path]:
    """The files a conversion of `src` reads: the GGUF, or a Hugging Face directory's weights and JSON/jinja."""
    if src.is_dir():
        return [f for pattern in ("*.safetensors", "*.json", "*.jinja") for f in src.glob(pattern)]
    return [src]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _weight_types(source: Source, cfg: ModelConfig, dtype: str | None) -> dict:
    """The header's "weights" entry, after checking every tensor's presence, type and shape."""

    def check(name: str, shape: tuple[int, ...], linear: bool = True) -> str:
        got, native = source.info(name)
        if got != shape:
            raise JitllmError(f"{source.tensor_name(name)}: shape {list(got)}, expected {list(shape)} from the config")
        wtype = dtype or native
        if linear and (reason := check_linear_shape(source.tensor_name(name), wtype, *shape)):
            raise JitllmError(reason)
        return wtype

    check("output_norm", (cfg.hidden,), linear=False)
    embd = check("token_embd", (cfg.vocab, cfg.hidden))
    head = embd if cfg.tied_head else check("output", (cfg.vocab, cfg.hidden))
    blocks = []
    for i in range(cfg.num_blocks):
        planned = block_kind(cfg, i, dict.fromkeys(block_linear_specs(cfg, i), "f32"))  # (names and shapes only)
        types: dict[str, str] = {}
        for weight in block_file_weights(planned, i):
            wtype = check(weight.name, weight.shape, linear=weight.spec is not None)
            if weight.linear is None:
                continue
            if types.setdefault(weight.linear, wtype) != wtype:
                raise JitllmError(f"{source.tensor_name(weight.name)} is {wtype}, the other experts of "
                                  f"blk.{i}.{weight.linear} are {types[weight.linear]}")
        blocks.append(types)
    return {"token_embd": embd, "output": head, "blocks": blocks}


def _plans(source: Source, cfg: ModelConfig, weights: dict) -> list[RegionPlan]:
    """Region "globals", then "block.0", ...: each region's tensors, and their arrays made from the source
    one linear at a time when the writer comes to the region, the source's pages let go once a linear's
    parts are made (so a conversion holds about one block matrix twice and a few thousand rows of the
    embedding, not the model)."""

    def linear_specs(name: str, wtype: str, shape: tuple[int, int]) -> list[TensorSpec]:
        return [TensorSpec(f"{name}.{part}", s, dtype) for part, s, dtype in weight_parts(wtype, *shape)]

    def linear(name: str, wtype: str) -> Iterator[tuple[str, np.ndarray]]:
        for part, piece in source.parts(name, wtype):
            yield f"{name}.{part}", piece
        source.release_pages()

    def norm(name: str) -> TensorSpec:
        return TensorSpec(name, (cfg.hidden,), "float32")

    matrix = (cfg.vocab, cfg.hidden)
    globals_specs = [*linear_specs("token_embd", weights["token_embd"], matrix), norm("output_norm")]
    if not cfg.tied_head:
        globals_specs += linear_specs("output", weights["output"], matrix)

    def globals_arrays() -> Iterator[tuple[str, np.ndarray]]:
        yield from linear("token_embd", weights["token_embd"])
        yield "output_norm", source.floats("output_norm")
        if not cfg.tied_head:
            yield from linear("output", weights["output"])

    def block_arrays(contents: list[FileWeight]) -> Iterator[tuple[str, np.ndarray]]:
        for weight in contents:
            if weight.spec is None:
                yield weight.name, source.floats(weight.name)
            else:
                yield from linear(weight.name, weight.spec.wtype)

    plans = [RegionPlan("globals", tuple(globals_specs), globals_arrays)]
    for i, types in enumerate(weights["blocks"]):
        contents = block_file_weights(block_kind(cfg, i, types), i)
        contents.sort(key=lambda w: -1 if w.expert is None else w.expert)  # the block's, then each expert's
        specs, pages = [], {}
        for weight in contents:
            made = ([TensorSpec(weight.name, weight.shape, "float32")] if weight.spec is None else
                    linear_specs(weight.name, weight.spec.wtype, weight.shape))
            specs += made
            if weight.expert is not None:
                pages.setdefault(f"expert.{weight.expert}", []).extend(t.name for t in made)
        plans.append(RegionPlan(f"block.{i}", tuple(specs), lambda contents=contents: block_arrays(contents),
                                tuple((page, tuple(names)) for page, names in pages.items())))
    return plans
