"""Batched steps on CUDA (ragged variants, kernels/cuda/ragged.py): one step of three sessions with
different histories (a prompt chunk over a history and two decode rows, page-crossing), then a step of
three decode rows over the KV the ragged append wrote, against the same steps on the host's exact
kernels. Skipped where no CUDA device exists."""

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
