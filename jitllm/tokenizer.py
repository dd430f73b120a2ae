"""Tokenizers: built offline from GGUF metadata at convert time, run from the .jlm header at load time.

The header stores a Hugging Face `tokenizers` JSON string, so both sources (GGUF and HF directories)
load the same way. Chat templates render like transformers' `apply_chat_template`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from jitllm.core.errors import JitllmError

CONTROL, USER_DEFINED = 3, 4  # GGUF tokenizer.ggml.token_type values

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (llama.cpp's names).
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "tekken": _TEKKEN_SPLIT}

END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>",
              "<end_of_turn>")
"""Special tokens that end a turn wherever a vocabulary has them (llama.cpp's end-of-generation list)."""


def tokenizer_json_from_gguf(metadata: Mapping[str, Any]) -> str:
    """A `tokenizers` JSON string from GGUF metadata values by key (gpt2-style byte-level BPE only)."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise JitllmError(f"tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE is)")
    if "tokenizer.ggml.tokens" not in metadata:
        raise JitllmError("GGUF metadata lacks tokenizer.ggml.tokens")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", ())]
    pre = metadata.get("tokenizer.ggml.pre", "default")
    split = _SPLITS.get(pre)
    # Llama-3-style vocabularies take a whole pre-token that is in the vocabulary as is (llama.cpp, HF).
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=split is not None)
    tok = tokenizers.Tokenizer(bpe)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type", ()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok.to_str()


def stop_token_ids(tok: tokenizers.Tokenizer, eos_ids: list[int]) -> list[int]:
    """The EOS ids followed by every special end-of-turn token the vocabulary has, without repeats."""
    special = {added.content: i for i, added in tok.get_added_tokens_decoder().items() if added.special}
    out: list[int] = []
    for i in [*eos_ids, *(special[t] for t in END_TOKENS if t in special)]:
        if i not in out:
            out.append(i)
    return out


class StreamDecoder:
    """Text for token ids as they arrive; a multi-byte character split over tokens comes out whole."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self._tok = tok
        self._stream = decoders.DecodeStream(skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        """The new text this id completes ("" while a character is still incomplete)."""
        return self._stream.step(self._tok, token_id) or ""


class Tokenizer:
    """The runtime tokenizer of a converted model (everything comes from the .jlm header)."""

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_id: int,
                 stop_token_ids: list[int], add_bos: bool, chat_template: str | None) -> None:
        self.backend = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.stop_token_ids = list(stop_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template = None

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> Tokenizer:
        try:
            tok = tokenizers.Tokenizer.from_str(header["tokenizer"])
        except Exception as e:  # noqa: BLE001 (the tokenizers library raises bare Exception)
            raise JitllmError(f"model tokenizer cannot be loaded: {e}") from None
        return cls(tok, bos_token_id=header.get("bos_token_id"), eos_token_id=header["eos_token_id"],
                   stop_token_ids=header.get("stop_token_ids") or [header["eos_token_id"]],
                   add_bos=bool(header.get("add_bos")), chat_template=header.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched. `add_special` prepends
        BOS when the model wants it (pass False for rendered chat templates, which write BOS themselves)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self.backend)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the model's jinja2 chat template, as transformers renders it."""
        if not self.chat_template:
            raise JitllmError("model has no chat template")
        import jinja2

        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.token(self.bos_token_id) or "",
                                         eos_token=self.token(self.eos_token_id) or "")
        except jinja2.TemplateError as e:
            raise JitllmError(f"chat template: {e}") from None


def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override: jinja's own tojson escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise JitllmError(f"chat template does not compile: {e}") from None
