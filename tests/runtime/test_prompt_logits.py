"""Executor.prompt_logits: every position's logits of a prompt, as the last-row path gives each prefix's."""

from __future__ import annotations

import numpy as np
import pytest

from jitllm.model import load

PROMPT = list(range(4, 44))  # crosses two 16-position pages


@pytest.fixture(scope="module")
def host(tiny_model, cache_dir):
    """f32 KV: every row is compared with decode steps over the pages (which an f16 cache rounds)."""
    return load(tiny_model, devices="cpu", ctx=64, cache_dir=cache_dir, cpu_kernels="exact", kv_type="f32")


def test_each_row_is_the_logits_of_its_prefix(host):
    ex = host.executor
    rows = ex.prompt_logits(ex.new_session(), PROMPT)
    assert rows.shape == (len(PROMPT), ex.layout.config.vocab)
    session = ex.new_session()
    stepwise = [ex.forward(session, PROMPT[:3])] + [ex.forward(session, [t]) for t in PROMPT[3:]]
    assert np.abs(rows[2:] - np.stack(stepwise)).max() < 1e-4


def test_chunks_continue_the_session(host):
    ex = host.executor
    whole = ex.prompt_logits(ex.new_session(), PROMPT)
    session = ex.new_session()
    parts = [ex.prompt_logits(session, PROMPT[:17]), ex.prompt_logits(session, PROMPT[17:18]),
             ex.prompt_logits(session, PROMPT[18:])]
    assert session.length == len(PROMPT) and session.tokens == PROMPT
    assert np.abs(np.concatenate(parts) - whole).max() < 1e-4


def test_blocks_and_head_on_other_devices(host, tiny_model, cache_dir):
    """Seams between devices (a block and the head on ONNX Runtime, one block on the host)."""
    split = load(tiny_model, devices="ort", placement="0=ort,1=host,head=ort", ctx=64, cache_dir=cache_dir,
                 cpu_kernels="exact", kv_type="f32")
    assert [u.device.name for u in split.executor.blocks] == ["ort", "host"]
    assert split.executor.head.device.name == "ort"
    expected = host.executor.prompt_logits(host.executor.new_session(), PROMPT)
    got = split.executor.prompt_logits(split.executor.new_session(), PROMPT)
    assert np.abs(got - expected).max() < 2e-4 * np.abs(expected).max()
