"""The tokenizer of a model file, without its weights: a .jlm's header or a GGUF's metadata (vocabulary-only
GGUFs, which have no tensors, included). `jitllm tokenize` and the tests of llama.cpp's vocabularies use it.

`check_token_settings` is the one check of a model's token fields, for the loader and the converters alike:
each typed, every id inside the vocabulary, and the vocabulary no larger than the embedding (a token without
an embedding row would fail, or read another's, when it comes up)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tokenizers

from jitllm.core.errors import JitllmError, shown
from jitllm.core.jlm import JlmFile

from .gguf_metadata import read_gguf_metadata
from .runtime import Tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if _starts_with_gguf_magic(path):
        return Tokenizer.from_gguf(read_gguf_metadata(path))
    model = JlmFile(path)  # which names what is wrong with any other file
    try:
        return model_tokenizer(model.header)
    except JitllmError as e:
        raise JitllmError(f"{path}: {e}") from None


def model_tokenizer(header: Mapping[str, Any], embedding_rows: int | None = None) -> Tokenizer:
    """The tokenizer of a .jlm header, its token fields checked (`embedding_rows`: the model's vocab, where
    the model is to run)."""
    if not isinstance(header.get("tokenizer"), str):
        raise JitllmError(f"tokenizer must be a tokenizers JSON string (got {shown(header.get('tokenizer'))})")
    _check_types(header)
    tokenizer = Tokenizer.from_header(header)
    _check_ids(tokenizer.backend, header, embedding_rows)
    return tokenizer


def check_token_settings(tok: tokenizers.Tokenizer, settings: Mapping[str, Any], embedding_rows: int | None) -> None:
    """One-line errors where `settings` (a header's or a converter's bos_token_id, eos_token_id,
    stop_token_ids, add_bos, chat_template) are mistyped, name ids outside `tok`'s vocabulary, or the
    vocabulary has more tokens than the embedding has rows."""
    _check_types(settings)
    _check_ids(tok, settings, embedding_rows)


def vocabulary_size(tok: tokenizers.Tokenizer) -> int:
    """One more than the largest id `tok` can give: its added tokens may lie beyond the model's vocabulary."""
    return max(tok.get_vocab_size(with_added_tokens=True), max(tok.get_added_tokens_decoder(), default=-1) + 1)


def _check_ids(tok: tokenizers.Tokenizer, settings: Mapping[str, Any], embedding_rows: int | None) -> None:
    size = vocabulary_size(tok)
    if embedding_rows is not None and size > embedding_rows:
        raise JitllmError(f"the tokenizer has {size} tokens but the embedding only {embedding_rows} rows")
    ids = {"bos_token_id": settings.get("bos_token_id"), "eos_token_id": settings["eos_token_id"]}
    ids |= {f"stop_token_ids[{i}]": v for i, v in enumerate(settings.get("stop_token_ids") or [])}
    for name, value in ids.items():
        if value is not None and not 0 <= value < size:
            raise JitllmError(f"{name} {value} is not a token of the {size}-token vocabulary")


def _check_types(settings: Mapping[str, Any]) -> None:
    def fail(name: str, kind: str) -> JitllmError:
        return JitllmError(f"{name} must be {kind} (got {shown(settings.get(name))})")

    if "eos_token_id" not in settings:
        raise JitllmError("eos_token_id is missing")
    if type(settings["eos_token_id"]) is not int:
        raise fail("eos_token_id", "a token id")
    if settings.get("bos_token_id") is not None and type(settings["bos_token_id"]) is not int:
        raise fail("bos_token_id", "a token id or null")
    stops = settings.get("stop_token_ids")
    if stops is not None and not (isinstance(stops, list) and all(type(v) is int for v in stops)):
        raise fail("stop_token_ids", "a list of token ids")
    if type(settings.get("add_bos", False)) is not bool:
        raise fail("add_bos", "true or false")
    if not isinstance(settings.get("chat_template"), (str, type(None))):
        raise fail("chat_template", "a string or null")


def _starts_with_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
