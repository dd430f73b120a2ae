"""OpenAI's response objects: chat.completion(.chunk) and text_completion, usage, and logprobs in each
endpoint's shape."""

from __future__ import annotations

import json

from jitllm.server.choices import Choice
from jitllm.server.engine import Token


class Responses:
    """The objects of one response (its id, model and creation time shared by every chunk)."""

    def __init__(self, rid: str, model: str, created: int, chat: bool, tokenizer) -> None:
        self.rid, self.model, self.created, self.chat, self.tokenizer = rid, model, created, chat, tokenizer

    def _object(self, kind: str, choices: list[dict], usage: dict | None, stream: bool) -> dict:
        body = {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None or stream:
            body["usage"] = usage
        return body

    def whole(self, choices: list[Choice], usage: dict) -> dict:
        """The non-streamed answer."""
        if self.chat:
            return self._object("chat.completion", [
                {"index": c.index, "message": {"role": "assistant", "content": c.text},
                 "logprobs": self.logprobs(c.logprobs) if c.logprobs else None, "finish_reason": c.finish_reason}
                for c in choices], usage, False)
        return self._object("text_completion", [
            {"index": c.index, "text": c.text, "logprobs": self.logprobs(c.logprobs) if c.logprobs else None,
             "finish_reason": c.finish_reason} for c in choices], usage, False)

    def chunk(self, index: int, text: str | None, tokens: list[Token], finish_reason: str | None = None,
              first: bool = False) -> dict:
        """A streamed piece of one choice (`first`: the chat's opening delta with the role)."""
        logprobs = self.logprobs(tokens) if tokens else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._object("chat.completion.chunk", [choice], None, True)
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._object("text_completion", [choice], None, True)

    def usage_chunk(self, usage: dict) -> dict:
        """stream_options.include_usage: the last chunk, with no choices."""
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage, True)

    def logprobs(self, tokens: list[Token]) -> dict:
        if self.chat:
            return {"content": [{**self._entry(t.id, t.logprob), "top_logprobs": [self._entry(i, lp) for i, lp in t.top]}
                                for t in tokens]}
        pieces = [self.tokenizer.piece(t.id) for t in tokens]
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{self.tokenizer.piece(i): lp for i, lp in t.top} for t in tokens],
                "text_offset": offsets}

    def _entry(self, token: int, logprob: float) -> dict:
        piece = self.tokenizer.piece(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(data: dict | str) -> bytes:
    """One server-sent event (`data: ...` and a blank line)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
