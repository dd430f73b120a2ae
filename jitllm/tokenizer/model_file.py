"""The tokenizer of a model file, without its weights: a .jlm's header or a GGUF's metadata (vocabulary-only
GGUFs, which have no tensors, included). `jitllm tokenize` and the tests of llama.cpp's vocabularies use it."""

from __future__ import annotations

from pathlib import Path

from jitllm.core.jlm import JlmFile

from .gguf_metadata import read_gguf_metadata
from .runtime import Tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if _starts_with_gguf_magic(path):
        return Tokenizer.from_gguf(read_gguf_metadata(path))
    return Tokenizer.from_header(JlmFile(path).header)  # which names what is wrong with any other file


def _starts_with_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
