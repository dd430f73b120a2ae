"""Batched steps on CUDA (ragged variants, kernels/cuda/ragged.py): one step of three sessions with
different histories (a prompt chunk over a history and two decode rows, page-crossing), then a step of
three decode rows over the KV the ragged append wrote, against the same steps on the host's exact
kernels; and decode steps captured per batch-size bucket (engine/batch_graphs.py) against the same steps
run eagerly and against batch-1 steps. Skipped where no CUDA device exists."""

from __future__ import annotations

import numpy as np
import pytest

from cuda_check import cuda_available

pytestmark = pytest.mark.gpu


if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

TOL = 1e-4
"""Logits error relative to the largest logit (exact family: f32 attention, f32-accurate linears)."""


def _steps(model, histories: list[list[int]], steps: list[list[list[int]]]) -> list[np.ndarray]:
    """Each session's history by batch-1 steps, then `steps` as batched steps: their logits."""
    ex = model.executor
    sessions = [ex.new_session() for _ in histories]
    for session, ids in zip(sessions, histories):
        ex.forward(session, ids)
    out = [ex.batched_forward(list(zip(sessions, step))) for step in steps]
    for session in sessions:
        ex.close_session(session)
    return out


@pytest.mark.parametrize("model,kv_type", [("tiny_model", "f16"), ("tiny_d32", "q8_0")])
def test_ragged_steps_on_cuda_match_the_host(model, kv_type, request, cache_dir):
    """At the default f16 KV and at q8_0 (tiny-d32: the ragged append quantizes as the host's does)."""
    from jitllm.model import load

    tiny_model = request.getfixturevalue(model)
    rng = np.random.default_rng(3)
    tokens = lambda n: [int(t) for t in rng.integers(4, 250, n)]  # noqa: E731
    histories = [tokens(9), tokens(37), tokens(14)]
    steps = [[tokens(20), tokens(1), tokens(1)],  # a chunk over positions 9..28 and two decode rows
             [tokens(1), tokens(1), tokens(1)]]
    host = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type=kv_type)
    gpu = load(tiny_model, devices="cuda:0", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", gpu_kernels="exact",
               kv_type=kv_type)
    assert all(u.device.name == "cuda:0" for u in (*gpu.executor.blocks, gpu.executor.head))
    want, got = _steps(host, histories, steps), _steps(gpu, histories, steps)
    for a, b in zip(got, want):
        assert a.shape == b.shape == (3, host.executor.layout.config.vocab)
        for row_a, row_b in zip(a, b):  # each session's logits
            assert np.abs(row_a - row_b).max() < TOL * np.abs(row_b).max()
            assert int(np.argmax(row_a)) == int(np.argmax(row_b))


def _decode_schedule(ex, prompts: list[list[int]], joins: list[int], limits: list[int]):
    """Greedy batched steps: session i joins at step joins[i] (its prompt in a step beside the others' decode
    rows: eager), decodes until it has limits[i] tokens, then finishes. Each session's tokens and the logits
    that picked them."""
    sessions = [ex.new_session() for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    step = 0
    while any(len(t) < n for t, n in zip(tokens, limits)):
        live = [i for i, (t, n) in enumerate(zip(tokens, limits)) if joins[i] <= step and len(t) < n]
        work = [(sessions[i], [tokens[i][-1]] if tokens[i] else prompts[i]) for i in live]
        for i, row in zip(live, ex.batched_forward(work)):
            logits[i].append(row)
            tokens[i].append(int(np.argmax(row)))
        step += 1
    for session in sessions:
        ex.close_session(session)
    return tokens, logits


def _alone(ex, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """Batch-1 steps (captured decode graphs) fed `tokens`: the logits before each."""
    session = ex.new_session()
    out = [ex.forward(session, prompt)]
    out += [ex.forward(session, [t]) for t in tokens[:-1]]
    ex.close_session(session)
    return out


def _same_pick(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    """The same greedy token, unless b's top two are within the tolerance (a near-tie either may break)."""
    top = np.sort(b)[-2:]
    return int(np.argmax(a)) == int(np.argmax(b)) or top[1] - top[0] < 2 * tol * np.abs(b).max()


@pytest.mark.parametrize("count,bucket", [(3, 4), (5, 8)])
def test_captured_bucket_steps_match_eager_steps_and_batch_1(count, bucket, tiny_model, cache_dir):
    """B decode rows padded up to their bucket and replayed as its CUDA graph (sessions joining and finishing:
    the batch, so the bucket, changes): greedy tokens equal the eager batched steps', logits within TOL of
    them and of batch-1 decode steps fed the same tokens; each bucket captured once (the pool grown first)."""
    from jitllm.model import load

    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(4, 250, n)] for n in (9, 37, 14, 22, 5)[:count]]
    joins = [0] * (count - 1) + [2]  # the last joins at step 2
    limits = [6] + [10] * (count - 1)  # the first finishes early
    model = load(tiny_model, devices="cuda:0", ctx=128, cache_dir=cache_dir, cpu_kernels="exact",
                 gpu_kernels="exact")
    ex = model.executor
    warm = [ex.new_session() for _ in range(4)]  # the pool grown once, so no capture is for its growth
    for session in warm:
        ex.forward(session, list(range(4, 104)))
    for session in warm:
        ex.close_session(session)
    captured, captured_logits = _decode_schedule(ex, prompts, joins, limits)
    buckets = {key[1] for key in ex._batch_graphs.records}
    assert bucket in buckets and all(key[0] == "cuda:0" for key in ex._batch_graphs.records)
    assert ex._batch_graphs.captures == len(buckets)  # every later step of a bucket replayed
    ex.batch_graphs = False
    eager, eager_logits = _decode_schedule(ex, prompts, joins, limits)
    assert ex._batch_graphs.captures == len(buckets)
    assert captured == eager
    for rows_a, rows_b in zip(captured_logits, eager_logits):
        for a, b in zip(rows_a, rows_b):
            assert np.abs(a - b).max() < TOL * np.abs(b).max()
    for prompt, tokens, rows in zip(prompts, captured, captured_logits):
        for a, b in zip(rows, _alone(ex, prompt, tokens)):
            assert np.abs(a - b).max() < TOL * np.abs(b).max()
            assert _same_pick(a, b, TOL)
