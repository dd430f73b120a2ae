"""One choice's text as its tokens arrive (on the event loop's thread, where all tokenizer work happens): the
streamed decode, stop strings (text that might begin one is held back until it cannot), logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from jitllm.server.engine import Finished, Token


class StopStrings:
    """Text as it may be shown: up to the first stop string, holding back a tail that could begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(the text that can be shown now, whether a stop string ended it)."""
        self.pending += text
        found = [at for at in (self.pending.find(s) for s in self.stops) if at >= 0]
        if found:
            out, self.pending = self.pending[:min(found)], ""
            return out, True
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Choice:
    """A choice of a response: its text so far, its tokens' logprobs, and how it ended."""

    index: int
    decoder: object
    stops: StopStrings
    text: str = ""
    tokens: int = 0
    logprobs: list[Token] = field(default_factory=list)
    finish_reason: str | None = None
    finished: Finished | None = None

    def add(self, token: Token) -> str:
        """The text `token` adds to what can be shown (a stop string ends the choice: its job is cancelled and
        the tokens still coming are not added)."""
        self.tokens += 1
        if token.logprob is not None:
            self.logprobs.append(token)
        shown, stopped = self.stops.push(self.decoder.push(token.id))
        self.text += shown
        if stopped:
            self.finish_reason = "stop"
        return shown

    def end(self, finished: Finished) -> str:
        """The text held back for stop strings, now that the choice has ended."""
        self.finished = finished
        self.finish_reason = self.finish_reason or finished.reason
        shown = self.stops.flush()  # (nothing after a stop string: push emptied it)
        self.text += shown
        return shown
