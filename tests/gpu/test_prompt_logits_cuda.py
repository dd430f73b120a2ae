"""Executor.prompt_logits on CUDA (the head's general program over every row, blocks split across the host
and the GPU) against the host, and perplexity's two ways of scoring there (exact kernels). Skipped where no
CUDA device exists (and not run with this change: no CUDA machine ran this branch)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jitllm.model import load
from jitllm.perplexity import perplexity, windows

from cuda_check import cuda_available

pytestmark = pytest.mark.gpu
PROMPT = list(range(4, 44))


if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)


@pytest.mark.parametrize("placement", [None, "0=cuda:0,1=host,head=cuda:0", "*=cuda:0,head=host"])
def test_prompt_logits_on_cuda_match_the_host(placement, tiny_model, cache_dir):
    host = load(tiny_model, devices="cpu", ctx=64, cache_dir=cache_dir, cpu_kernels="exact").executor
    gpu = load(tiny_model, devices="cuda:0", placement=placement, ctx=64, cache_dir=cache_dir, cpu_kernels="exact",
               gpu_kernels="exact").executor
    expected = host.prompt_logits(host.new_session(), PROMPT)
    got = gpu.prompt_logits(gpu.new_session(), PROMPT)
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() < 1e-4 * np.abs(expected).max()


def test_decode_steps_score_what_prefill_scores_on_cuda(tiny_model, cache_dir):
    # f32 KV: decode steps read their history from the pages, which an f16 cache rounds (prefill does not)
    model = load(tiny_model, devices="cuda:0", ctx=64, cache_dir=cache_dir, gpu_kernels="exact", kv_type="f32")
    chunks = windows(list(range(4, 260)) * 2, 64, None)
    by_prefill, by_steps = perplexity(model.executor, chunks), perplexity(model.executor, chunks, decode=True)
    assert math.log(by_steps.ppl) == pytest.approx(math.log(by_prefill.ppl), abs=1e-3)
