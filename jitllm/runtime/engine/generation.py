"""The generation loop: chunked prefill, then one decode step per token until a stop token or the limit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from jitllm.core.heap import give_back_freed
from jitllm.runtime.engine.executor import Executor
from jitllm.runtime.engine.session import Session
from jitllm.runtime.sampling import Sampler


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0


def generate_ids(executor: Executor, session: Session, prompt: list[int], max_new_tokens: int, sampler: Sampler,
                 stop_ids: set[int], stats: GenerationStats, ubatch: int = 512) -> Iterator[int]:
    """Yield sampled token ids; the first comes after prefill. Stop tokens end the loop unyielded. Greedy
    sampling lets the executor pick (on the device, where the head's program can, and with the next
    step launched before this one's token is read, where the model can: Executor.greedy_tokens)."""

    def pick(ids: list[int]) -> int:
        return executor.next_token(session, ids) if sampler.greedy else sampler(executor.forward(session, ids))

    def following(token: int, steps: int) -> Iterator[int]:
        if sampler.greedy:
            yield from executor.greedy_tokens(session, token, steps)
            return
        for _ in range(steps):
            token = sampler(executor.forward(session, [token]))
            yield token

    start = time.perf_counter()
    chunks = [prompt[at:at + ubatch] for at in range(0, len(prompt), ubatch)]
    for chunk in chunks[:-1]:  # no token from these
        executor.forward(session, chunk)
    token = pick(chunks[-1])
    stats.prompt_tokens += len(prompt)
    stats.prefill_seconds += time.perf_counter() - start
    give_back_freed()  # (the prompt's intermediates, kept by malloc: up to tens of MiB)
    if max_new_tokens <= 0:
        return
    start = time.perf_counter()
    rest = following(token, max_new_tokens - 1)
    try:
        while token not in stop_ids:
            stats.generated_tokens += 1
            yield token
            token = next(rest, None)
            if token is None:
                break
    finally:
        rest.close()  # (a step launched ahead and not taken is waited for and uncounted)
        stats.decode_seconds += time.perf_counter() - start
