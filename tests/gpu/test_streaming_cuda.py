"""Streamed blocks (`~`) on cuda:0: a four-block random model through two slots of a budget smaller than
its weights, uploads on the copy stream (backends/cuda_copies.py) overlapping the kernels, against the same
model resident on the card; then a move that makes a streamed block resident. Skipped where no CUDA
device exists."""

from __future__ import annotations

import numpy as np
import pytest

from cuda_check import cuda_available

pytestmark = pytest.mark.gpu

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

PROMPT = list(range(4, 30))
STEPS = 12


def _logits(model, moves=None) -> list[np.ndarray]:
    ex = model.executor
    session = ex.new_session()
    out = [ex.forward(session, PROMPT)]
    for k in range(STEPS):
        for blocks, target in (moves or {}).get(k, []):
            model.move(blocks, target)
        out.append(ex.forward(session, [int(np.argmax(out[-1]))]))
    return out


def test_streamed_blocks_on_cuda_match_resident_ones(tiny_four_blocks, cache_dir):
    from jitllm.model import load

    kw = dict(ctx=128, cache_dir=cache_dir, cpu_kernels="exact", gpu_kernels="exact")
    resident = _logits(load(tiny_four_blocks, devices="cuda:0", **kw))
    model = load(tiny_four_blocks, devices="cuda:0=100000", placement="*=cuda:0~", **kw)
    ex = model.executor
    assert 4 * ex.blocks[0].nbytes + ex.head.nbytes > 100000  # the weights do not fit; the slots and one block do
    pool = ex.streams["cuda:0"]
    assert pool._queue is not None  # the copy stream, not synchronous writes
    assert model.devices["cuda:0"].used_bytes == 2 * ex.blocks[0].nbytes + ex.head.nbytes
    streamed = _logits(model, {6: [("2", "cuda:0")], 9: [("2", "cuda:0~")]})
    for a, b in zip(streamed, resident, strict=True):
        assert np.abs(a - b).max() < 1e-5
    assert [int(np.argmax(a)) for a in streamed] == [int(np.argmax(b)) for b in resident]
    assert pool.uploads >= 4 * (STEPS + 1) - 6  # (block 2 resident for three tokens)
    assert sorted(pool.members) == [0, 1, 2, 3]
