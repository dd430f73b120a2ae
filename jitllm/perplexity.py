"""Perplexity of a text as llama.cpp's `llama-perplexity` measures it (its default mode).

The text is tokenized once (BOS first where the model adds one, special tokens not parsed), cut into
non-overlapping windows of `ctx` tokens (the tail that fills no window is dropped), and each window runs
from an empty context with its first token replaced by BOS where the model adds one. Only the second half
of a window is scored: the logits of positions ctx/2 .. ctx-2 predict tokens ctx/2 + 1 .. ctx-1, so every
scored token has at least ctx/2 tokens before it. PPL = exp(mean negative log-likelihood), and its
uncertainty is llama.cpp's: the standard error of the mean NLL times PPL.

That scores the prefill kernels (all of a window's logits from batched steps, as llama.cpp does it); the
`decode` mode scores the same tokens through the decode steps a generation takes, one token at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from jitllm.core.errors import JitllmError

if TYPE_CHECKING:  # (the engine imports the backends: they load with the model, not with this module)
    from jitllm.runtime.engine.executor import Executor


@dataclass
class Estimate:
    """Running sums over the scored tokens (llama.cpp's nll, nll2 and count)."""

    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0
    windows: int = 0

    def add(self, nll: np.ndarray) -> None:
        self.count += int(nll.size)
        self.nll += float(nll.sum())
        self.nll2 += float(np.square(nll).sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def error(self) -> float:
        """PPL's uncertainty: sqrt(var(NLL) / (count - 1)) * PPL, as llama-perplexity prints it."""
        mean = self.nll / self.count
        variance = self.nll2 / self.count - mean * mean
        return math.sqrt(max(variance, 0.0) / (self.count - 1)) * self.ppl if self.count > 1 else math.nan


def windows(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """The non-overlapping windows of `ctx` tokens, each beginning with `bos` where given (llama.cpp replaces
    the window's first token); a one-line error where the text fills fewer than two."""
    if len(tokens) < 2 * ctx:
        raise JitllmError(f"the text has {len(tokens)} tokens: a context of {ctx} needs at least {2 * ctx} "
                          f"(two windows)")
    out = [tokens[at:at + ctx] for at in range(0, len(tokens) - ctx + 1, ctx)]
    if bos is not None:
        out = [[bos, *window[1:]] for window in out]
    return out


def scored_nll(logits: np.ndarray, window: list[int], start: int) -> np.ndarray:
    """The negative log-likelihoods of the scored tokens that `logits` (the rows of window positions
    start .. start + len(logits) - 1) predict: positions from ctx/2 to ctx - 2 (float64)."""
    ctx = len(window)
    lo, hi = max(start, ctx // 2), min(start + len(logits), ctx - 1)
    if lo >= hi:
        return np.zeros(0)
    rows = logits[lo - start:hi - start].astype(np.float64)
    targets = np.asarray(window[lo + 1:hi + 1])
    top = rows.max(axis=1)
    log_sum = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
    return log_sum - rows[np.arange(len(targets)), targets]


def window_nll(ex: Executor, window: list[int], batch: int, decode: bool = False) -> np.ndarray:
    """One window from an empty context, `batch` tokens a step: its scored tokens' NLL. With `decode`, the
    scored half runs one token a step (the decode kernels and head a generation uses) after the first half
    as a prefill; otherwise every position comes from prefill steps (Executor.prompt_logits)."""
    session = ex.new_session()
    try:
        if decode:
            first = len(window) // 2
            for start in range(0, first, batch):
                ex.forward(session, window[start:min(start + batch, first)])
            return np.concatenate([scored_nll(ex.forward(session, [window[p]])[None], window, p)
                                   for p in range(first, len(window) - 1)])
        return np.concatenate([scored_nll(ex.prompt_logits(session, window[start:start + batch]), window, start)
                               for start in range(0, len(window), batch)])
    finally:
        ex.close_session(session)


def perplexity(ex: Executor, chunks: list[list[int]], batch: int = 512, decode: bool = False,
               on_window: Callable[[Estimate], None] | None = None) -> Estimate:
    """The estimate over `chunks` (from `windows`), `on_window` called after each with the running figures."""
    estimate = Estimate()
    for window in chunks:
        estimate.add(window_nll(ex, window, batch, decode))
        estimate.windows += 1
        if on_window is not None:
            on_window(estimate)
    return estimate
