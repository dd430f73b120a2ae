"""Token sampling: greedy at temperature 0, else temperature + top-k + top-p + min-p with a seeded generator;
presence and frequency penalties (OpenAI's) lower the logits of the tokens this sampler already picked."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jitllm.core.errors import JitllmError

_BOUNDS = {"temperature": (0.0, math.inf), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
           "presence_penalty": (-math.inf, math.inf), "frequency_penalty": (-math.inf, math.inf)}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None
    """None: a fresh random seed; any integer (negative ones too) a reproducible one."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the likeliest one (0: keep all)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token picked before."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was picked before."""

    def __post_init__(self) -> None:
        for name, (low, high) in _BOUNDS.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and low <= value <= high):
                raise JitllmError(f"sampling {name} {value} is out of range: a finite number in [{low:g}, {high:g}]")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self._counts: dict[int, int] = {}
        """How often each token was picked (for the penalties)."""

    @property
    def greedy(self) -> bool:
        """Temperature 0 without penalties: the largest logit, which the device can pick itself
        (Executor.next_token)."""
        return self.params.temperature <= 0 and not self.params.penalized

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.penalized and self._counts:
            logits = self.penalize(logits)
        token = int(np.argmax(logits)) if p.temperature <= 0 else self._sample(logits)
        if p.penalized:
            self._counts[token] = self._counts.get(token, 0) + 1
        return token

    def penalize(self, logits: np.ndarray) -> np.ndarray:
        """The logits less the penalties of the tokens picked so far."""
        ids = np.fromiter(self._counts, np.int64, len(self._counts))
        counts = np.fromiter(self._counts.values(), np.float32, len(self._counts))
        out = logits.astype(np.float32, copy=True)
        out[ids] -= self.params.presence_penalty + self.params.frequency_penalty * counts
        return out

    def _sample(self, logits: np.ndarray) -> int:
        p = self.params
        k = logits.shape[-1] if p.top_k <= 0 else min(p.top_k, logits.shape[-1])
        top = np.argpartition(logits, -k)[-k:]
        top = top[np.argsort(-logits[top], kind="stable")]
        with np.errstate(over="ignore"):  # (a tiny temperature sends every logit but the top one to -inf)
            z = (logits[top].astype(np.float64) - float(logits[top[0]])) / p.temperature
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            top, probs = top[:keep], probs[:keep] / probs[:keep].sum()
        if p.min_p > 0:
            keep = int(np.count_nonzero(probs >= p.min_p * probs[0]))
            top, probs = top[:keep], probs[:keep] / probs[:keep].sum()
        return int(top[self._rng.choice(len(top), p=probs)])
