"""Prompt chunks beside decoding slots are sized by the learnt step cost (server/step_cost.py), so a step that
carries a prompt stays within the stretch of a decode-only step, and the streams' tokens do not change."""

from __future__ import annotations

import threading

import numpy as np
from solo import alone

from jitllm import model as jm
from jitllm.runtime.sampling import SamplingParams
from jitllm.server.engine import Engine, EngineSettings, Finished, Job, Token
from jitllm.server.metrics import Metrics
from jitllm.server.step_cost import StepCost


def test_the_fit_gives_the_fixed_part_in_rows_and_pages_of_room():
    cost = StepCost()
    assert cost.prompt_room(8, 2.0, 16) == 16  # (nothing learnt: the cautious answer, one page)
    for rows in (4, 8, 16, 40, 8, 100, 12):
        cost.observe(rows, 0.030 + 0.003 * rows)  # 30 ms fixed, 3 ms a row: the fixed part is 10 rows' worth
    assert abs(cost.fixed_rows() - 10.0) < 1e-6
    assert cost.prompt_room(64, 2.0, 16) == 64  # (10 + 64) rows of room, cut to whole pages
    assert cost.prompt_room(8, 1.5, 16) == 16  # 9 rows: less than a page, one page all the same
    same = StepCost()
    for _ in range(5):
        same.observe(8, 0.05)
    assert same.fixed_rows() == 0.0  # (steps of one size say nothing of the slope)


class TenRows(StepCost):
    def fixed_rows(self) -> float:
        return 10.0  # (1.5 - 1) * (10 + 1 decoding) = 5 rows: one page a step


def test_a_prompt_beside_decoding_slots_is_fed_in_chunks_of_the_room(tiny_model, cache_dir):
    model = jm.load(tiny_model, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir)
    ex = model.executor
    rng = np.random.default_rng(1)
    short, long = [int(t) for t in rng.integers(4, 250, 6)], [int(t) for t in rng.integers(4, 250, 150)]

    expected = [alone(model, short, 40), alone(model, long, 8)]
    steps: list[tuple[int, int]] = []  # (decode rows, prompt rows) of each batched step
    forward = ex.batched_forward

    def recorded(work):
        steps.append((sum(len(ids) == 1 for _, ids in work), sum(len(ids) for _, ids in work if len(ids) > 1)))
        return forward(work)

    ex.batched_forward = recorded
    engine = Engine(lambda log: model, EngineSettings(parallel=4, queue=4, cache_sessions=4), Metrics())
    engine._log = lambda message: None
    engine._costs = TenRows()  # (the tiny model's steps are all fixed cost: a machine-independent fit instead)
    engine.start()
    tokens: list[list[int]] = [[], []]
    done = [threading.Event(), threading.Event()]
    started = threading.Event()

    def deliver(i: int):
        def take(event) -> None:
            if isinstance(event, Token):
                tokens[i].append(event.id)
                if i == 0 and len(tokens[0]) == 3:
                    started.set()
            else:
                assert isinstance(event, Finished), event
                done[i].set()
        return take

    try:
        while not engine.ready:
            threading.Event().wait(0.01)
        # the short stream decodes (alone: batch-1 steps) before the long prompt comes; then both take batched steps
        engine.submit([Job(short, 40, SamplingParams(temperature=0.0), None, True, deliver(0))])
        assert started.wait(60)
        engine.submit([Job(long, 8, SamplingParams(temperature=0.0), None, True, deliver(1))])
        assert all(d.wait(120) for d in done)
    finally:
        engine.stop()
    assert tokens == expected
    beside = [prompt for decode, prompt in steps if decode and prompt]
    assert beside and max(beside) == 16, steps  # (a page a step, not 150 tokens at once)
    assert len(beside) >= len(long) // 16 - 1
