"""Token sampling: greedy at temperature 0, else temperature + top-k + top-p with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        """Temperature 0: the largest logit, which the device can pick itself (Executor.next_token)."""
        return self.params.temperature <= 0

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if self.greedy:
            return int(np.argmax(logits))
        k = logits.shape[-1] if p.top_k <= 0 else min(p.top_k, logits.shape[-1])
        top = np.argpartition(logits, -k)[-k:]
        top = top[np.argsort(-logits[top], kind="stable")]
        z = (logits[top] - logits[top[0]]) / p.temperature
        probs = np.exp(z.astype(np.float64))
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            top, probs = top[:keep], probs[:keep] / probs[:keep].sum()
        return int(top[self._rng.choice(len(top), p=probs)])
