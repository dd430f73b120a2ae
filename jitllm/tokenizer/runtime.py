"""The runtime tokenizer: a Hugging Face `tokenizers` tokenizer plus the model's token settings.

It loads from a .jlm header (a tokenizers JSON string, the chat template, BOS/EOS and stop ids, add_bos),
or straight from a GGUF's metadata, so both sources (GGUF files and HF directories) run the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import decoders

from jitllm.core.errors import JitllmError

from .chat_template import compile_template, render_template
from .gguf_vocab import gguf_tokenizer, token_settings


_MARK = re.compile("\ue000([0-9]+)\ue001")
"""A message's place in a template rendered with placeholders (private-use characters around its index)."""


class StreamDecoder:
    """Text for token ids as they arrive; a multi-byte character split over tokens comes out whole.

    `context` ids are decoded first and never emitted, so the first id reads as it does inside a text
    (a SentencePiece word keeps its leading space, which a decode drops at the start of a text)."""

    def __init__(self, tok: tokenizers.Tokenizer, context: list[int]) -> None:
        self._tok = tok
        self._stream = decoders.DecodeStream(ids=list(context), skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        """The new text this id completes ("" while a character is still incomplete)."""
        return self._stream.step(self._tok, token_id) or ""


class Tokenizer:
    """The runtime tokenizer of a converted model."""

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

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer a .jlm converted from this GGUF would have (without its JSON round trip)."""
        tok = gguf_tokenizer(metadata)
        return cls(tok, **token_settings(metadata, tok))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. `add_special` prepends BOS when the model wants it (pass False for rendered
        chat templates, which write BOS themselves); `parse_special` matches special tokens written in
        the text (llama.cpp's parse_special; user-defined tokens are matched either way)."""
        self.backend.encode_special_tokens = not parse_special
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        """The text one token adds inside a text, as llama.cpp's token_to_piece gives it (the bytes of an
        unfinished character show as U+FFFD)."""
        anchor = self.decode([self.eos_token_id])
        return self.decode([self.eos_token_id, token_id])[len(anchor):]

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self.backend, [self.eos_token_id])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the model's jinja2 chat template, as transformers renders it."""
        if not self.chat_template:
            raise JitllmError("model has no chat template")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        return render_template(self._template, messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt,
                               bos_token=self.token(self.bos_token_id) or "",
                               eos_token=self.token(self.eos_token_id) or "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation through the chat template, where the messages' text cannot write the
        template's markers: the template is rendered with a placeholder for each message's content, its own
        text is encoded with special tokens parsed and each content without (a user's `<|im_end|>` stays
        text). The pieces put together must be the template's real rendering (a template that rewrites
        contents beyond Llama 3's `| trim` cannot be encoded safely: one line says so)."""
        marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        pieces = _MARK.split(self.apply_chat_template(marked, add_generation_prompt))
        texts, order = pieces[::2], [int(i) for i in pieces[1::2]]
        real = self.apply_chat_template(messages, add_generation_prompt)
        for transform in (lambda text: text, str.strip):
            contents = [transform(messages[i]["content"]) for i in order]
            if "".join(t + c for t, c in zip(texts, contents + [""])) == real:
                break
        else:
            raise JitllmError("chat template rewrites the messages' text, so their special tokens cannot be kept "
                              "apart from the template's")
        ids: list[int] = []
        for template_text, content in zip(texts, contents + [""]):
            ids += self.encode(template_text, add_special=False) + self.encode(content, False, parse_special=False)
        return ids
