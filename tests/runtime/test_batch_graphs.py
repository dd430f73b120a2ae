"""Captured batched decode steps (engine/batch_graphs.py) on the CPU: simulated devices record each bucket's
step with ReplayRecorder (the host's stand-in for CUDA graphs), which replays it over the captured tensors
as a CUDA graph replays over fixed addresses. A step of B decode rows is padded up to its bucket; its
logits must equal the eager batched step's and each session's alone (the CPU kernels reduce per row, so
bit for bit); a second step of the bucket replays without a new capture, also when a table gains a page;
a move drops only the captures of the devices it touched; mixed steps stay eager."""

from __future__ import annotations

import numpy as np
import pytest
from kv_contents import kv_of
from simulated_graphs import load_on_simulated

from jitllm.model import load
from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.engine.batch_graphs import bucket_for
from jitllm.runtime.engine.batch_runner import BatchRunner
from jitllm.runtime.sampling import Sampler, SamplingParams

LENGTHS = (5, 23, 40, 17, 9)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, 250, n)] for n in LENGTHS[:count]]


def decode_run(ex, ps: list[list[int]], steps: int) -> tuple[list, list[np.ndarray]]:
    """One prefill step of `ps`, then `steps` greedy batched decode steps: the sessions and each step's logits."""
    sessions = [ex.new_session() for _ in ps]
    out = [ex.batched_forward(list(zip(sessions, ps)))]
    for _ in range(steps):
        out.append(ex.batched_forward([(s, [int(np.argmax(row))]) for s, row in zip(sessions, out[-1])]))
    return sessions, out


def alone(ex, prompt: list[int], steps: int) -> list[np.ndarray]:
    session = ex.new_session()
    out = [ex.forward(session, prompt)]
    for _ in range(steps):
        out.append(ex.forward(session, [int(np.argmax(out[-1]))]))
    ex.close_session(session)
    return out


def grown(model) -> None:
    """Grow the pools once up front (a long session's pages, given back), so the test's steps take pages
    without a pool growing under them."""
    ex = model.executor
    session = ex.new_session()
    ex.forward(session, list(range(4, 124)))
    ex.close_session(session)


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 33, 64)] == [1, 2, 4, 4, 8, 8, 16, 32, 64, 64]
    assert bucket_for(65) is None


@pytest.mark.parametrize("count,bucket", [(3, 4), (5, 8)])
def test_padded_bucket_steps_equal_eager_steps_and_each_session_alone(tiny_model, cache_dir, count, bucket):
    model, _ = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0", kv_type="f32")
    ex = model.executor
    grown(model)
    ps = prompts(count)
    sessions, got = decode_run(ex, ps, 6)
    assert list(ex._batch_graphs.records) == [("sim:0", bucket, 0)]
    assert ex._batch_graphs.captures == 1  # the prefill step ran eagerly, the first decode step captured
    pad = ex._batch_graphs.pad_pages["sim:0"][1]
    assert all(pad not in t.ids for s in sessions for t in s.tables.values())
    ex.batch_graphs = False
    eager_sessions, want = decode_run(ex, ps, 6)
    assert ex._batch_graphs.captures == 1
    for have, expect in zip(got, want):
        assert np.array_equal(have, expect)
    for s, e in zip(sessions, eager_sessions):  # padding rows wrote into no session's pages
        for b in range(len(ex.blocks)):
            assert np.array_equal(kv_of(s, b, s.length), kv_of(e, b, e.length))
    for i, p in enumerate(ps):
        assert np.array_equal(np.array(alone(ex, p, 6)), np.array([step[i] for step in got]))


def test_a_second_step_of_the_bucket_replays_also_across_a_new_page(tiny_model, cache_dir):
    model, (sim0, _) = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0")
    ex = model.executor
    grown(model)
    pages = ex.pools["sim:0"].pages
    sessions = [ex.new_session() for _ in range(3)]
    ex.batched_forward(list(zip(sessions, [list(range(4, 4 + n)) for n in (14, 15, 30)])))
    before = [len(s.tables[0].ids) for s in sessions]
    for step in range(4):  # positions 14..17, 15..18, 30..33: every session takes a page
        ex.batched_forward([(s, [7 + step]) for s in sessions])
    assert [len(s.tables[0].ids) for s in sessions] == [b + 1 for b in before]
    assert ex.pools["sim:0"].pages is pages  # (no growth: the tables changed, nothing the graph baked)
    assert ex._batch_graphs.captures == 1 and sim0.graphs.captures == 1
    (record,) = ex._batch_graphs.records.values()
    assert len(record.graph.calls) == 2 + 2 * len(ex.blocks) + 1  # upload, main + append per block, head, download


def test_pool_growth_captures_again(tiny_model, cache_dir):
    model, _ = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0")
    ex = model.executor
    sessions = [ex.new_session() for _ in range(2)]
    ex.batched_forward(list(zip(sessions, prompts(2))))
    ex.batched_forward([(s, [5]) for s in sessions])
    assert ex._batch_graphs.captures == 1
    pages = ex.pools["sim:0"].pages
    ex.forward(ex.new_session(), list(range(4, 124)))  # another session grows the pool
    assert ex.pools["sim:0"].pages is not pages
    ex.batched_forward([(s, [6]) for s in sessions])
    assert ex._batch_graphs.captures == 2
    assert not any(kept is pages for r in ex._batch_graphs.records.values() for kept in r.keep)  # old pool let go


def test_a_move_drops_only_the_captures_of_the_devices_it_touched(tiny_model, cache_dir):
    model = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact",
                 extra_devices=[simulated_device(f"sim:{i}", graphs=True) for i in range(3)])
    for move in ("0=sim:0", "1=sim:1", "head=sim:1"):
        model.move(*move.split("="))
    ex = model.executor
    grown(model)
    ps = prompts(3)
    sessions = [ex.new_session() for _ in ps]
    expected = [alone(ex, p, 7) for p in ps]
    out = [ex.batched_forward(list(zip(sessions, ps)))]
    for _ in range(3):
        out.append(ex.batched_forward([(s, [int(np.argmax(row))]) for s, row in zip(sessions, out[-1])]))
    assert set(ex._batch_graphs.records) == {("sim:0", 4, 0), ("sim:1", 4, 1)}
    assert ex._batch_graphs.captures == 2
    first = ex._batch_graphs.records[("sim:0", 4, 0)]
    model.move("head", "sim:2")  # sim:1 and sim:2 touched; sim:0's step is what it was
    assert set(ex._batch_graphs.records) == {("sim:0", 4, 0)}
    for _ in range(4):
        out.append(ex.batched_forward([(s, [int(np.argmax(row))]) for s, row in zip(sessions, out[-1])]))
    assert ex._batch_graphs.records[("sim:0", 4, 0)] is first
    assert set(ex._batch_graphs.records) == {("sim:0", 4, 0), ("sim:1", 4, 1), ("sim:2", 4, "head")}
    assert ex._batch_graphs.captures == 4
    for i, want in enumerate(expected):
        assert np.array_equal(np.array(want), np.array([step[i] for step in out]))


def test_mixed_steps_and_large_batches_run_eagerly(tiny_model, cache_dir):
    model, (sim0, _) = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0")
    ex = model.executor
    a, b = ex.new_session(), ex.new_session()
    ex.batched_forward([(a, [5, 6, 7])])
    ex.batched_forward([(a, [8]), (b, [9, 10, 11])])  # a decode row beside a prompt chunk
    assert ex._batch_graphs.captures == 0 and sim0.graphs.captures == 0
    many = [ex.new_session() for _ in range(65)]
    ex.batched_forward([(s, [4]) for s in many])
    ex.batched_forward([(s, [5]) for s in many])  # 65 decode rows: past the largest bucket
    assert ex._batch_graphs.captures == 0


def test_runner_with_joining_and_finishing_requests(tiny_model, cache_dir):
    """Requests finish at different steps and one joins late: the buckets change as the batch does, and
    every request's tokens are those it gets alone."""
    model, _ = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:1")
    ex = model.executor
    ps = prompts(5)
    limits = [4, 12, 7, 10, 6]
    expected = [[int(np.argmax(row)) for row in alone(ex, p, n - 1)] for p, n in zip(ps, limits)]
    runner = BatchRunner(ex, token_budget=32)
    greedy = Sampler(SamplingParams(temperature=0.0))
    requests = [runner.submit(p, n, greedy) for p, n in zip(ps[:4], limits[:4])]
    for _ in range(5):
        runner.step()
    requests.append(runner.submit(ps[4], limits[4], greedy))
    runner.run()
    assert [r.output for r in requests] == expected
    assert {key[1] for key in ex._batch_graphs.records} >= {2, 4}
