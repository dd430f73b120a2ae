"""`jitllm tokenize` as llama.cpp's llama-tokenize: `id -> 'piece'` lines, `-ids` as a list, BOS where the
model wants it; every bad input one line and exit code 2."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner, Result
from llama_cpp_data import vocab_cases
from test_cli import jitllm

from jitllm.cli import main
from jitllm.core.jlm import JlmFile
from jitllm.tokenizer import Tokenizer, read_gguf_metadata

LINE = re.compile(r" *(\d+) -> '(.*)'")


def tokenize(*args: str) -> Result:
    """The verb run in this process (the first test runs it as `python -m jitllm` too)."""
    return CliRunner().invoke(main, ["tokenize", *args])


def longest_printable_case(gguf) -> tuple[str, list[int]]:
    """A case whose pieces are one printable line each (no newlines, no characters split over tokens)."""
    return max((c for c in vocab_cases(gguf) if c[0].isascii() and c[0].isprintable()), key=lambda c: len(c[0]))


def pieces(stdout: str) -> tuple[list[int], list[str]]:
    matches = [LINE.fullmatch(line) for line in stdout.splitlines()]
    assert all(matches), stdout
    return [int(m.group(1)) for m in matches], [m.group(2) for m in matches]


def test_ids_follow_the_vocab_file_and_its_bos(llama_cpp_models, tmp_path):
    gguf = llama_cpp_models / "ggml-vocab-llama-spm.gguf"
    meta = read_gguf_metadata(gguf)
    assert meta["tokenizer.ggml.add_bos_token"] is True
    text, ids = max(vocab_cases(gguf), key=lambda c: len(c[0]))  # newlines, tabs, emoji, CJK
    out = jitllm("tokenize", str(gguf), text, "-ids", cache=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{[meta['tokenizer.ggml.bos_token_id'], *ids]}\n"
    assert tokenize(str(gguf), text, "-ids", "-no-bos").stdout == f"{ids}\n"


def test_special_tokens_are_text_unless_parsed(llama_cpp_models):
    gguf = llama_cpp_models / "ggml-vocab-llama-spm.gguf"
    meta = read_gguf_metadata(gguf)
    eos = meta["tokenizer.ggml.eos_token_id"]
    eos_text = meta["tokenizer.ggml.tokens"][eos]
    assert tokenize(str(gguf), eos_text, "-ids", "-no-bos", "-parse-special").stdout == f"{[eos]}\n"
    plain = tokenize(str(gguf), eos_text, "-ids", "-no-bos")
    assert plain.exit_code == 0 and str(eos) not in plain.stdout.strip("[]\n").split(", ")


@pytest.mark.parametrize("name, prefix", [("gpt-2", ""), ("llama-spm", " ")])
def test_pieces_spell_the_text(llama_cpp_models, name, prefix):
    """SentencePiece pieces keep the space llama.cpp puts before the text; byte-level ones are the text."""
    gguf = llama_cpp_models / f"ggml-vocab-{name}.gguf"
    text, ids = longest_printable_case(gguf)
    out = tokenize(str(gguf), text, "-no-bos")
    assert out.exit_code == 0, out.stderr
    got_ids, got_pieces = pieces(out.stdout)
    assert got_ids == ids
    assert "".join(got_pieces) == prefix + text


def test_a_jlm_tokenizes_with_its_header(tiny_model):
    out = tokenize(str(tiny_model), "hello world", "-ids")
    assert out.exit_code == 0, out.stderr
    expected = Tokenizer.from_header(JlmFile(tiny_model).header).encode("hello world", parse_special=False)
    assert out.stdout == f"{expected}\n"


@pytest.mark.parametrize("case, needle", [
    ("missing", "model file not found"),
    ("not a model", "not a .jlm model file"),
    ("truncated gguf", "truncated or corrupt GGUF file"),
    ("bert vocab", "tokenizer model 'bert'"),
])
def test_bad_models_are_one_line(llama_cpp_models, tmp_path, case, needle):
    path = {"missing": tmp_path / "absent.gguf", "not a model": tmp_path / "notes.txt",
            "truncated gguf": tmp_path / "cut.gguf", "bert vocab": llama_cpp_models / "ggml-vocab-bert-bge.gguf"}[case]
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "cut.gguf").write_bytes((llama_cpp_models / "ggml-vocab-gpt-2.gguf").read_bytes()[:5000])
    out = tokenize(str(path), "hi")
    assert (out.exit_code, out.stdout, isinstance(out.exception, SystemExit)) == (2, "", True)
    assert out.stderr.startswith("jitllm: error: ") and out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr
