"""MoE blocks on cuda:0 (the routed experts: kernels/cuda/moe.py): tiny random Qwen3-MoE and Mixtral models
(kinds.MOE_MODELS) resident on the card against the host's exact kernels, a multi-token prefill and greedy
decode steps; an MoE block moved between the host and the card mid-generation; and expert streaming
(JITLLM_GPU_STREAM=1) through a small expert cache on the card against the resident run. Skipped where no
CUDA device exists."""

from __future__ import annotations

import numpy as np
import pytest
from kinds import EXPERT_STREAMING, MOE_KV_TYPE, MOE_MODELS

from cuda_check import cuda_available

pytestmark = pytest.mark.gpu

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

PROMPT = list(range(4, 28))
STEPS = 12
TOL = 1e-4
"""Of the largest logit: the card's f32 sums (nvcc's fast math) against the host's, over the same weights."""


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[tuple[str, str], object]:
    from jitllm.random_model import write_random_model

    root = tmp_path_factory.mktemp("moe")
    out = {}
    for preset, wtype in {*MOE_MODELS, EXPERT_STREAMING[:2]}:
        out[preset, wtype] = root / f"{preset}-{wtype}.jlm"
        write_random_model(out[preset, wtype], preset, wtype, seed=3)
    return out


def _load(path, cache_dir, devices, **options):
    from jitllm.model import load

    return load(path, devices=devices, ctx=128, cache_dir=cache_dir, cpu_kernels="exact", gpu_kernels="exact",
                kv_type=MOE_KV_TYPE, **options)


def _greedy(model, moves=None) -> tuple[list[np.ndarray], list[int]]:
    """The prompt's last logits and STEPS greedy steps' (each step's token its own argmax), and the tokens."""
    ex = model.executor
    session = ex.new_session()
    logits = [ex.forward(session, PROMPT)]
    tokens = [int(np.argmax(logits[-1]))]
    for step in range(STEPS):
        for blocks, target in (moves or {}).get(step, []):
            model.move(blocks, target)
        logits.append(ex.forward(session, [tokens[-1]]))
        tokens.append(int(np.argmax(logits[-1])))
    return logits, tokens


def _assert_close(got: tuple[list[np.ndarray], list[int]], want: tuple[list[np.ndarray], list[int]]) -> None:
    for step, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert np.abs(a - b).max() < TOL * max(1.0, np.abs(b).max()), f"step {step}: {np.abs(a - b).max()}"
    assert got[1] == want[1]


@pytest.mark.parametrize("preset, wtype", MOE_MODELS, ids=[f"{p}-{w}" for p, w in MOE_MODELS])
def test_moe_blocks_on_cuda_match_the_host(preset, wtype, moe_models, cache_dir):
    path = moe_models[preset, wtype]
    host = _greedy(_load(path, cache_dir, "cpu"))
    model = _load(path, cache_dir, "cuda:0")
    assert [(u.kind.kind, u.device.name) for u in model.executor.blocks] == [("moe", "cuda:0")] * 2
    assert model.executor.head.device.name == "cuda:0"
    _assert_close(_greedy(model), host)


def test_moe_blocks_split_and_moved_between_the_host_and_cuda(moe_models, cache_dir):
    """Block 0 on the card and block 1 on the host, then block 1 moved to the card after 4 steps and block 0
    to the host after 8 (their KV pages with them): the host's run."""
    path = moe_models["tiny-qwen3moe", "q4_0"]
    host = _greedy(_load(path, cache_dir, "cpu"))
    model = _load(path, cache_dir, "cuda:0", placement="0=cuda:0,1=host,head=cuda:0")
    assert [u.device.name for u in model.executor.blocks] == ["cuda:0", "host"]
    moved = _greedy(model, {4: [("1", "cuda:0")], 8: [("0", "host")]})
    assert [u.device.name for u in model.executor.blocks] == ["host", "cuda:0"]
    _assert_close(moved, host)


def test_expert_streaming_on_cuda_matches_the_resident_run(moe_models, cache_dir):
    """JITLLM_GPU_STREAM=1 with a cache of top-k + 1 experts (fewer than one block's): each token's misses
    uploaded through the card's copy stream into their slots; the resident run's logits and tokens, and the
    bytes uploaded = the misses' experts."""
    preset, wtype, (slots, every) = EXPERT_STREAMING
    path = moe_models[preset, wtype]
    resident = _greedy(_load(path, cache_dir, "cuda:0"))
    probe = _load(path, cache_dir, "cuda:0", stream_experts=True)
    cache = probe.executor.streams["cuda:0"].experts
    assert cache.count == every
    rest = sum(u.nbytes for u in probe.executor.blocks) + probe.executor.head.nbytes
    expert = cache.expert_bytes
    del probe, cache
    model = _load(path, cache_dir, f"cuda:0={rest + slots * expert + expert // 2}", stream_experts=True)
    pool = model.executor.streams["cuda:0"]
    assert pool.experts.count == slots and pool._queue is not None  # (the copy stream, not synchronous writes)
    _assert_close(_greedy(model), resident)
    assert pool.experts.slots.misses > slots and pool.experts.uploaded_bytes == expert * pool.experts.slots.misses
