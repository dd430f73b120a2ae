"""A conversation over one session whose KV cache is kept between turns (`jitllm chat`): each turn renders
the whole conversation through the chat template, and only the tokens the session does not already hold
(the new user message, and whatever the template writes differently from what was generated) are run."""

from __future__ import annotations

from typing import Iterator

from jitllm.core.errors import JitllmError
from jitllm.model import Model
from jitllm.runtime.sampling import SamplingParams


class ConversationFull(JitllmError):
    """The conversation with the new message does not fit the context (the message is not kept)."""


class Conversation:
    def __init__(self, model: Model, system: str | None = None) -> None:
        self.model = model
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.session = model.new_session()
        self.reused = 0
        """Positions the last turn took from the session's cache instead of running them again."""

    def say(self, text: str, max_tokens: int, sampling: SamplingParams) -> Iterator[str]:
        """The answer to `text`, as pieces of text as they are sampled. Stopping early (closing the iterator,
        or an interrupt) keeps what was answered so far as the assistant's turn; an answer the context cuts
        short ends there (Model.context_filled). A message the context has no room for raises ConversationFull."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.model.tokenizer.encode_chat(self.messages)
        except JitllmError:
            self.messages.pop()
            raise
        ex = self.model.executor
        if len(ids) > ex.ctx:
            self.messages.pop()
            raise ConversationFull(f"that message does not fit: the conversation would take {len(ids)} tokens of the "
                                   f"context's {ex.ctx}")
        if any(state.positions != self.session.length for state in self.session.states.values()):
            ex.reset_session(self.session)  # (a turn stopped inside a recurrent block's step)
        held = self.session.tokens
        common = next((i for i, (a, b) in enumerate(zip(ids, held)) if a != b), min(len(ids), len(held)))
        common = min(common, len(ids) - 1)  # (at least one token to run: its logits pick the first answer token)
        if not ex.truncate_session(self.session, common):  # (a recurrent block's state cannot be cut back)
            ex.reset_session(self.session)
            common = 0
        self.reused = common
        answer: list[str] = []
        decoder = self.model.tokenizer.stream()
        try:
            for token in self.model.generate_tokens(ids[common:], max_tokens, sampling, self.session):
                piece = decoder.push(token)
                if piece:
                    answer.append(piece)
                    yield piece
        finally:
            self.messages.append({"role": "assistant", "content": "".join(answer)})

    def close(self) -> None:
        self.model.executor.close_session(self.session)
