"""Prefill (ppN) and decode (tgN) speed of a loaded model, measured the way llama-bench does, and the
named target presets `jitllm speed -targets` compares.

ppN: one forward of an N-token prompt into an empty context. tgN: N single-token greedy steps after a
one-token prompt. Each repetition uses a fresh session; figures are mean ± standard deviation, as
llama-bench prints them. `jitllm speed` and bench/gpu_decode.py both call this.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TargetPreset:
    """A (target, backend, device) to measure: every block and the head placed on `devices`."""

    name: str
    target: str
    backend: str
    devices: str
    about: str

    @property
    def placement(self) -> str | None:
        """The map that puts the whole model on the preset's device (None: the host, where it is anyway)."""
        return None if self.devices == "cpu" else f"*={self.devices},head={self.devices}"


TARGET_PRESETS = {
    "llvm": TargetPreset("llvm", "llvm", "host", "cpu", "TVM's llvm kernels on the host CPU"),
    "ort": TargetPreset("ort", "onnxruntime", "ort", "ort", "ONNX Runtime's CPU execution provider on the block graphs"),
    "cuda": TargetPreset("cuda", "cuda", "cuda", "cuda:0", "TVM's CUDA kernels on cuda:0"),
    "ort:cuda": TargetPreset("ort:cuda", "onnxruntime", "ort", "ort:cuda", "ONNX Runtime's CUDA execution provider"),
    "vulkan": TargetPreset("vulkan", "webgpu", "vulkan", "vulkan:0", "TVM's WGSL kernels through wgpu on vulkan:0"),
}
"""What `jitllm speed -targets` names (`-targets list` prints them)."""


@dataclass(frozen=True)
class SpeedResult:
    test: str
    rates: list[float]
    """tokens/s of each repetition"""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rates)

    @property
    def sd(self) -> float:
        return statistics.stdev(self.rates) if len(self.rates) > 1 else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(min(4, vocab - 1), vocab, length)]


def prefill_speed(model, tokens: int, reps: int) -> SpeedResult:
    ex = model.executor
    rates = []
    warm = ex.new_session()  # a first call of the same size: compile/load, allocate pools and host arrays untimed
    ex.forward(warm, _prompt(tokens, ex.layout.config.vocab, 99))
    ex.close_session(warm)
    for rep in range(reps):
        session = ex.new_session()
        ids = _prompt(tokens, ex.layout.config.vocab, rep)
        start = time.perf_counter()
        ex.forward(session, ids)
        rates.append(tokens / (time.perf_counter() - start))
        ex.close_session(session)
    return SpeedResult(f"pp{tokens}", rates)


def decode_speed(model, tokens: int, reps: int, history: int = 0) -> SpeedResult:
    """`tokens` greedy steps after a one-token prompt (or, with `history`, after that many positions of
    stand-in KV: pages allocated and left as they are, as speed does not depend on their values)."""
    ex = model.executor
    rates = []
    for rep in range(reps + 1):  # the first run warms up (graph capture, pool growth) and is not counted
        session = ex.new_session()
        if history:
            for unit in ex.blocks:
                ex.pages_for(session, unit, history + tokens + 1)
            session.length = history
        token = ex.next_token(session, _prompt(1, ex.layout.config.vocab, rep))
        start = time.perf_counter()
        for _ in ex.greedy_tokens(session, token, tokens):
            pass
        if rep:
            rates.append(tokens / (time.perf_counter() - start))
        ex.close_session(session)
    return SpeedResult(f"tg{tokens}" + (f"@{history}" if history else ""), rates)


def weight_bytes(model) -> int:
    ex = model.executor
    return sum(u.nbytes for u in ex.blocks) + ex.head.nbytes


def table(name: str, model, results: list[SpeedResult]) -> str:
    """llama-bench's markdown table."""
    ex = model.executor
    where = ", ".join(sorted({u.device.name for u in [*ex.blocks, ex.head]}))
    size = f"{weight_bytes(model) / 2**20:.2f} MiB"
    rows = ["| model | size | backend | test | t/s |", "| --- | ---: | --- | ---: | ---: |"]
    rows += [f"| {name} | {size} | {where} | {r.test} | {r.mean:.2f} ± {r.sd:.2f} |" for r in results]
    return "\n".join(rows)


def target_table(name: str, size_bytes: int, rows: list[tuple[TargetPreset, list[SpeedResult]]]) -> str:
    """llama-bench's table with a row per target and test, and each test's rate against the first target's."""
    first = {r.test: r.mean for r in rows[0][1]}
    lines = [f"| model | size | target | backend | test | t/s | vs {rows[0][0].name} |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for preset, results in rows:
        for r in results:
            ratio = r.mean / first[r.test] if first.get(r.test) else float("nan")
            lines.append(f"| {name} | {size_bytes / 2**20:.2f} MiB | {preset.name} | {preset.backend} | {r.test} | "
                         f"{r.mean:.2f} ± {r.sd:.2f} | {ratio:.2f}x |")
    return "\n".join(lines)


def list_targets() -> str:
    return "\n".join(f"{p.name:<9} target {p.target:<12} backend {p.backend:<5} -devices {p.devices:<9} {p.about}"
                     for p in TARGET_PRESETS.values())
