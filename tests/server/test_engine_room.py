"""The server's engine thread (in process, no HTTP) where room runs out: a KV pool too small for all the slots
closes idle cached sessions first, then spills the slot admitted last to the host and resumes it, and a device
that fails mid-stream sends every unit home; in both, every stream's temp-0 tokens are those it gets alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from solo import alone

from jitllm import model as jm
from jitllm.runtime.backends.fake import simulated_device, with_faults
from jitllm.runtime.sampling import SamplingParams
from jitllm.server.engine import Engine, EngineSettings, Failed, Finished, Job, Token
from jitllm.server.metrics import Metrics

LENGTHS = (5, 23, 40, 17)
STEPS = 20


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(4, 250, n)] for n in LENGTHS]



class Run:
    """Jobs submitted together to a started engine; `wait` gives each one's tokens (or raises on a failure)."""

    def __init__(self, engine: Engine, ps: list[list[int]], on_token=lambda job, count: None) -> None:
        self.tokens: list[list[int]] = [[] for _ in ps]
        self.done = [threading.Event() for _ in ps]
        self.failed: list[str] = []
        jobs = [Job(p, STEPS, SamplingParams(temperature=0.0), None, True, self._deliver(i, on_token))
                for i, p in enumerate(ps)]
        engine.submit(jobs)

    def _deliver(self, i: int, on_token):
        def deliver(event) -> None:
            if isinstance(event, Token):
                self.tokens[i].append(event.id)
                on_token(i, len(self.tokens[i]))
            else:
                if isinstance(event, Failed):
                    self.failed.append(event.message)
                assert isinstance(event, (Finished, Failed))
                self.done[i].set()
        return deliver

    def wait(self) -> list[list[int]]:
        assert all(d.wait(300) for d in self.done)
        assert not self.failed, self.failed
        return self.tokens


def started(model, logged: list[str]) -> tuple[Engine, Metrics]:
    metrics = Metrics()
    engine = Engine(lambda log: model, EngineSettings(parallel=4, queue=8, cache_sessions=8), metrics)
    engine._log = logged.append
    engine.start()
    for _ in range(3000):
        if engine.ready:
            return engine, metrics
        threading.Event().wait(0.01)
    pytest.fail(f"the engine did not start: {engine.stage}")


def count(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_a_full_pool_discards_idle_sessions_then_spills_and_resumes(tiny_model, cache_dir):
    model = jm.load(tiny_model, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir)
    ps = prompts()
    expected = [alone(model, p, STEPS) for p in ps]
    logged: list[str] = []
    engine, metrics = started(model, logged)
    try:
        Run(engine, [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]).wait()  # (leaves an idle session in the cache)
        idle_at_spill: list[int] = []
        spill = engine._spill

        def recorded(slot) -> None:
            idle_at_spill.append(sum(not e.busy for e in engine.cache.entries.values()))
            spill(slot)

        engine._spill = recorded
        # room for ~ 1.5 requests' full histories: (40 + 20) positions = 4 pages per block at most
        model.executor.pools["host"].max_pages = 2 * 6
        assert Run(engine, ps).wait() == expected
    finally:
        engine.stop()
    assert count(metrics, "jitllm_sessions_discarded_total") >= 1
    assert idle_at_spill and set(idle_at_spill) == {0}  # (no idle session was left when a busy one spilled)
    assert count(metrics, "jitllm_kv_resumes_total") == count(metrics, "jitllm_kv_spills_total") >= 1
    assert count(metrics, "jitllm_batched_steps_total") > 0 and count(metrics, "jitllm_recomputed_block_positions_total") == 0
    assert any(line.startswith("kv: a full pool spilled") for line in logged)


def test_a_device_failing_mid_stream_falls_back_with_unchanged_tokens(tiny_model, cache_dir):
    """sim:0 (block 1) fails mid-stream: its block comes home, only its KV computed again; the head stays on
    sim:1 (the fall-back is per device, as per node in a cluster)."""
    sim = with_faults(simulated_device("sim:0"))
    model = jm.load(tiny_model, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir,
                    extra_devices=[sim, simulated_device("sim:1")])
    model.move("1", "sim:0")
    model.move("head", "sim:1")
    ps = prompts()[:3]
    expected = [alone(model, p, STEPS) for p in ps]
    logged: list[str] = []
    engine, metrics = started(model, logged)

    def fail_later(job: int, tokens: int) -> None:
        if job == 0 and tokens == 4:
            sim.backend.faults.launch = True

    try:
        assert Run(engine, ps, fail_later).wait() == expected
    finally:
        engine.stop()
    assert [u.device.name for u in [*model.executor.blocks, model.executor.head]] == ["host", "host", "sim:1"]
    assert count(metrics, "jitllm_device_fallbacks_total") == 1
    assert count(metrics, "jitllm_recomputed_block_positions_total") > 0
    assert any(line.startswith("warning: sim:0: ") and "recomputed only block 1 for" in line for line in logged)


def test_prompt_chunks_end_at_page_boundaries():
    """The ragged kernels reduce a prompt fed in page-aligned chunks exactly as one fed whole (not one cut
    mid-page), so a chunk that stops short of the history is cut back to a page boundary where it can be."""
    from types import SimpleNamespace

    from jitllm.server.engine import Slot, _page_aligned

    def slot(at: int, prompt: int) -> Slot:
        job = SimpleNamespace(prompt=list(range(prompt)))
        return Slot(job, SimpleNamespace(length=at), 0, None)

    assert _page_aligned(slot(0, 100), 40, 16) == 32  # (ends at 32, not mid-page at 40)
    assert _page_aligned(slot(32, 100), 68, 16) == 68  # (the rest of the prompt: all of it)
    assert _page_aligned(slot(16, 100), 10, 16) == 10  # (no boundary inside: fed as planned, never starved)
    assert _page_aligned(slot(20, 100), 30, 16) == 28
