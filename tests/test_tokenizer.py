"""Tokenizers built from GGUF metadata, the runtime Tokenizer, chat templates; the real model vs transformers."""

from __future__ import annotations

import json

import pytest

from jitllm.core.errors import JitllmError
from jitllm.tokenizer import CONTROL, StreamDecoder, Tokenizer, gguf_tokenizer, stop_token_ids

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_tokenizer_metadata(pre: str = "smollm") -> dict:
    """GGUF tokenizer metadata of a 264-token byte-level BPE with ChatML control tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "l l", "ll o"]
    tokens = specials + byte_alphabet() + [m.replace(" ", "") for m in merges]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), 264)]
    types = [CONTROL] * len(specials) + [1] * (len(tokens) - len(specials))
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML}


def tiny_header(**overrides) -> dict:
    header = {"tokenizer": gguf_tokenizer(tiny_tokenizer_metadata()).to_str(), "chat_template": CHATML,
              "bos_token_id": 1, "eos_token_id": 2, "stop_token_ids": [2, 0], "add_bos": False}
    header.update(overrides)
    return header


def test_tiny_vocab_merges_and_control_tokens():
    tok = Tokenizer.from_header(tiny_header())
    ids = tok.encode("<|im_start|>the hello<|im_end|>")
    pieces = [tok.backend.id_to_token(i) for i in ids]
    assert pieces == ["<|im_start|>", "t", "he", "Ġ", "he", "llo", "<|im_end|>"]
    assert tok.decode(ids) == "<|im_start|>the hello<|im_end|>"
    assert tok.vocab_size == 264


def test_add_bos_only_when_the_model_wants_it():
    assert Tokenizer.from_header(tiny_header()).encode("hi")[0] != 1
    bos = Tokenizer.from_header(tiny_header(add_bos=True))
    assert bos.encode("hi")[0] == 1
    assert bos.encode("hi", add_special=False)[0] != 1


def test_pre_tokenizers_follow_llama_cpp():
    def pieces(pre: str, text: str) -> list[str]:
        tok = gguf_tokenizer(tiny_tokenizer_metadata(pre))
        return [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]

    assert pieces("smollm", "ab 123") == ["ab", "Ġ", "1", "2", "3"]
    assert pieces("llama-bpe", "ab 12345") == ["ab", "Ġ", "123", "45"]
    assert pieces("gpt-2", "ab 12345") == ["ab", "Ġ12345"]


def test_stop_tokens_are_eos_then_end_of_turn_specials():
    tok = gguf_tokenizer(tiny_tokenizer_metadata())
    assert stop_token_ids(tok, [2]) == [2, 0]
    assert stop_token_ids(tok, [5, 2]) == [5, 2, 0]


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": "bert"}, r"tokenizer model 'bert' .* supported: 'gpt2' .*, 'llama'"),
    ({"tokenizer.ggml.pre": "deepseek-v3"}, r"pre-tokenizer 'deepseek-v3' .* supported: .*llama-bpe.*qwen2"),
    ({"tokenizer.ggml.pre": None}, r"lacks tokenizer.ggml.pre"),
    ({"tokenizer.ggml.merges": None}, r"lacks tokenizer.ggml.merges"),
])
def test_unsupported_tokenizers_are_named_never_guessed(change, message):
    with pytest.raises(JitllmError, match=message):
        gguf_tokenizer(dict(tiny_tokenizer_metadata(), **change))


def test_stream_decoder_holds_back_split_characters():
    tok = Tokenizer.from_header(tiny_header())
    ids = tok.encode("a日b🤖")
    assert len(ids) == 9  # every byte is its own token in this vocabulary
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert pieces == ["a", "", "", "日", "b", "", "", "", "🤖"]
    assert isinstance(stream, StreamDecoder)


def test_chat_template_renders_and_reports_problems():
    tok = Tokenizer.from_header(tiny_header())
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False).endswith("<|im_end|>\n")
    with pytest.raises(JitllmError, match="model has no chat template"):
        Tokenizer.from_header(tiny_header(chat_template=None)).apply_chat_template([])
    failing = Tokenizer.from_header(tiny_header(chat_template="{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(JitllmError, match="roles must alternate"):
        failing.apply_chat_template([])
    for template, message in (("{% tool %}{% endtool %}", "does not compile: Encountered unknown tag 'tool'"),
                              ("{% for t in tools %}{% endfor %}", "TypeError: 'NoneType' object is not iterable")):
        with pytest.raises(JitllmError, match=message) as e:
            Tokenizer.from_header(tiny_header(chat_template=template)).apply_chat_template([])
        assert "\n" not in str(e.value)
    eos = Tokenizer.from_header(tiny_header(chat_template="{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"))
    assert eos.apply_chat_template([{"role": "user", "content": "é<"}]) == \
        '<|im_start|>[{"role": "user", "content": "é<"}]<|im_end|>'


# --- the real model (SmolLM2-135M-Instruct) against transformers' GGUF tokenizer ---

REAL_TEXTS = [
    "The capital of France is",
    "Hello, world! I'm here; you're there.",
    "Digits: 12345 and 3.14159, year 2024.",
    "héllo wörld — 日本語のテキスト 🤖👩‍👩‍👧 naïve café",
    "def f(x):\n\treturn x**2  # square\n",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? Ünïcødé ok"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


@pytest.fixture(scope="module")
def real_tokenizer(setup_failed) -> Tokenizer:
    from jitllm.core.jlm import JlmFile
    from jitllm.default_model import default_model_path

    try:
        return Tokenizer.from_header(JlmFile(default_model_path()).header)
    except JitllmError as e:
        setup_failed(f"default model unavailable: {e}")


@pytest.fixture(scope="module")
def hf_tokenizer(setup_failed):
    from jitllm.default_model import default_gguf_path

    try:
        import transformers
    except ImportError as e:
        setup_failed(f"transformers (a test dependency) is not installed: {e}")
    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_real_model_header(real_tokenizer):
    assert (real_tokenizer.bos_token_id, real_tokenizer.eos_token_id, real_tokenizer.add_bos) == (1, 2, False)
    assert real_tokenizer.stop_token_ids == [2, 0]
    assert real_tokenizer.backend.id_to_token(1) == "<|im_start|>"


def test_real_model_smollm_digits_split_like_llama_cpp(real_tokenizer):
    # transformers' GGUF loader uses plain GPT-2 splitting for "smollm"; llama.cpp and the model's own
    # tokenizer.json split digits first, which leaves "  " before a digit as one piece.
    ids = real_tokenizer.encode("a  4")
    assert [real_tokenizer.backend.id_to_token(i) for i in ids] == ["a", "ĠĠ", "4"]


@pytest.mark.slow
def test_real_model_ids_match_transformers(real_tokenizer, hf_tokenizer):
    chat = real_tokenizer.apply_chat_template(CHAT)
    assert chat == hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for text in REAL_TEXTS + [chat, real_tokenizer.apply_chat_template(CHAT[1:2])]:
        ids = real_tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert real_tokenizer.decode(ids) == hf_tokenizer.decode(ids) == text
        stream = real_tokenizer.stream()
        assert "".join(stream.push(i) for i in ids) == text


@pytest.mark.slow
def test_real_model_chat_template_matches_transformers(real_tokenizer, hf_tokenizer):
    for messages in (CHAT, CHAT[1:2], [{"role": "user", "content": json.dumps({"k": "<b>"})}]):
        for prompt in (True, False):
            assert real_tokenizer.apply_chat_template(messages, add_generation_prompt=prompt) == \
                hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
