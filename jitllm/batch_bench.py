"""`jitllm batch`'s measurement: llama.cpp's llama-batched-bench over jitllm's batched steps. For each batch
size B, B requests of PP random prompt tokens are prefilled (chunked under the token budget) and then
decode TG tokens each, every step one batched step for all of them; the table is llama-batched-bench's."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from jitllm.runtime.engine.batch_runner import BatchRunner
from jitllm.runtime.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class BatchResult:
    """One row of the table (llama-batched-bench's jsonl keys)."""

    pp: int
    tg: int
    pl: int
    n_kv: int
    t_pp: float
    speed_pp: float
    t_tg: float
    speed_tg: float
    t: float
    speed: float


def measure(executor, batch: int, pp: int, tg: int, reps: int, token_budget: int, seed: int = 0) -> BatchResult:
    """Mean times over `reps` runs of B = `batch` requests (PP prompt tokens, then TG decode steps each)."""
    vocab = executor.layout.config.vocab
    rng = np.random.default_rng(seed)
    t_pp = t_tg = 0.0
    for _ in range(reps):
        runner = BatchRunner(executor, token_budget=token_budget, max_sequences=batch)
        for _ in range(batch):
            runner.submit([int(t) for t in rng.integers(0, vocab, pp)], tg + 1, Sampler(SamplingParams(0.0)))
        start = time.perf_counter()
        while not all(r.plan.decoding or r.finished for r in runner.requests):  # prefill: until every request has its first token
            runner.step()
        prefilled = time.perf_counter()
        runner.run()  # TG steps of B tokens each
        t_pp += prefilled - start
        t_tg += time.perf_counter() - prefilled
    t_pp, t_tg = t_pp / reps, t_tg / reps
    n_kv = batch * (pp + tg)
    return BatchResult(pp, tg, batch, n_kv, t_pp, batch * pp / t_pp if t_pp else 0.0, t_tg,
                       batch * tg / t_tg if t_tg else 0.0, t_pp + t_tg, n_kv / (t_pp + t_tg))


def warm_up(executor) -> None:
    """One batched step of two requests, so the ragged variants are compiled (or loaded) before timing."""
    runner = BatchRunner(executor, token_budget=8, max_sequences=2)
    for _ in range(2):
        runner.submit([1, 2, 3], 2, Sampler(SamplingParams(0.0)))
    runner.run()


HEADER = ("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n"
          "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|")


def table_row(r: BatchResult) -> str:
    return (f"| {r.pp:5d} | {r.tg:6d} | {r.pl:4d} | {r.n_kv:6d} | {r.t_pp:8.3f} | {r.speed_pp:8.2f} | "
            f"{r.t_tg:8.3f} | {r.speed_tg:8.2f} | {r.t:8.3f} | {r.speed:8.2f} |")


def json_row(r: BatchResult) -> str:
    return json.dumps(asdict(r))
