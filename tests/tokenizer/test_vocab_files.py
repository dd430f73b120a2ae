"""llama.cpp's vocabulary-only GGUFs: each one we claim gives exactly the ids of its .out for every text of
its .inp (with llama.cpp's test settings: no BOS, special tokens not parsed); the others are refused in
one line. The expected ids are llama.cpp's, made by each model's own Hugging Face tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_cpp_data import vocab_cases

from jitllm.core.errors import JitllmError
from jitllm.tokenizer import Tokenizer, header_from_gguf, load_tokenizer, read_gguf_metadata

SUPPORTED = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe", "llama-spm", "mpt",
             "phi-3", "qwen2", "qwen35", "refact", "starcoder"]
REFUSED = {  # vocab file -> (the error, why we do not build it)
    "bert-bge": ("tokenizer model 'bert'", "WordPiece, for BERT embedding models"),
    "nomic-bert-moe": ("tokenizer model 't5'", "Unigram (T5-style SentencePiece) with a precompiled normalizer"),
    "gemma-4": ("tokenizer model 'gemma4'", "Gemma 4's SentencePiece-style BPE over raw UTF-8, not built yet"),
    "aquila": ("lacks tokenizer.ggml.pre", "no pre-tokenizer named; llama.cpp guesses one and warns"),
    "gpt-neox": ("lacks tokenizer.ggml.pre", "no pre-tokenizer named; llama.cpp guesses one and warns"),
}
WITHOUT_IDS = ["baichuan"]
"""SentencePiece vocabularies that load but have no .inp/.out: only round trips are checked."""


def vocab(models: Path, name: str) -> Path:
    return models / f"ggml-vocab-{name}.gguf"


def mismatches(tok: Tokenizer, cases: list[tuple[str, list[int]]]) -> list[tuple[str, list[int], list[int]]]:
    got = [(text, tok.encode(text, add_special=False, parse_special=False), ids) for text, ids in cases]
    return [(text, ours, theirs) for text, ours, theirs in got if ours != theirs]


def test_every_vocab_file_is_listed(llama_cpp_models):
    found = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
             for p in llama_cpp_models.glob("ggml-vocab-*.gguf")}
    assert found == {*SUPPORTED, *REFUSED, *WITHOUT_IDS}
    with_ids = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf.out") for p in llama_cpp_models.glob("*.out")}
    assert set(SUPPORTED) <= with_ids


@pytest.mark.parametrize("name", SUPPORTED)
def test_vocab_reproduces_llama_cpp(llama_cpp_models, name):
    tok = load_tokenizer(vocab(llama_cpp_models, name))
    cases = vocab_cases(vocab(llama_cpp_models, name))
    assert len(cases) >= 46
    assert mismatches(tok, cases) == []
    for text, ids in cases:
        assert tok.decode(ids) == text, (text, ids)


@pytest.mark.parametrize("name", ["llama-spm", "gpt-2"])
def test_the_jlm_header_tokenizes_the_same(llama_cpp_models, name):
    """A .jlm stores the tokenizer as JSON; loading it back must not change a single id."""
    tok = Tokenizer.from_header(header_from_gguf(read_gguf_metadata(vocab(llama_cpp_models, name))))
    assert mismatches(tok, vocab_cases(vocab(llama_cpp_models, name))) == []


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_vocab_is_refused_in_one_line(llama_cpp_models, name):
    error, _reason = REFUSED[name]
    with pytest.raises(JitllmError, match=error) as e:
        load_tokenizer(vocab(llama_cpp_models, name))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", WITHOUT_IDS)
def test_vocab_without_ids_round_trips(llama_cpp_models, name):
    tok = load_tokenizer(vocab(llama_cpp_models, name))
    for text, _ in vocab_cases(vocab(llama_cpp_models, "llama-spm")):
        assert tok.decode(tok.encode(text, add_special=False)) == text
