"""The host's KV pool grows with use: its tensor is reserved for the whole context (memory comes as pages are
written), its ids handed out in steps as sessions need them, never copied; a process's anonymous memory
after the load follows the KV used, not the context (issue 31, item 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.engine.kv_pages import PagePool

ROOT = Path(__file__).resolve().parents[2]
MARGIN = 8 << 20

CHILD = textwrap.dedent("""
    import json, sys
    from jitllm import model as jm

    def anon():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon"))

    path, cache, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = jm.load(path, devices="cpu", cpu_kernels="exact", cache_dir=cache, ctx=ctx, kv_type="f32")
    ex, base = model.executor, anon()
    pool = ex.pools["host"]
    first, tensor = pool.num_pages, pool.pages
    sessions = [ex.new_session() for _ in range(8)]
    tokens, pages = [], []
    for i, s in enumerate(sessions):
        tokens.append(model.generate_ids([4 + (7 * i + j) % 240 for j in range(100)], 4, session=s))
        pages.append(pool.num_pages)
    used = sum(s.length for s in sessions) * sum(pool.page_bytes // pool.page_size for _ in ex.blocks)
    held = sum(len(t.ids) for s in sessions for t in s.tables.values())
    print(json.dumps({"growth": anon() - base, "used": used, "first": first, "pages": pages, "held": held,
                      "step": pool.step, "same_tensor": pool.pages is tensor, "tokens": tokens}))
""")


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    """`tiny` (its kinds, so its artifacts) with a context of 65536."""
    import dataclasses

    from jitllm.random_model import PRESETS, write_random_model

    path = tmp_path_factory.mktemp("models") / "tiny-64k.jlm"
    write_random_model(path, dataclasses.replace(PRESETS["tiny"], context=65536), "q4_1", seed=1)
    return path


def run_child(model: Path, cache: Path, ctx: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), str(cache), str(ctx)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_a_long_context_pool_takes_memory_as_sessions_use_it(long_context_model, cache_dir):
    long = run_child(long_context_model, cache_dir, 65536)
    # ids in steps of 256 positions per block, within one tensor reserved ahead (no copy)
    assert long["first"] == long["step"] == 2 * 16 and long["same_tensor"]
    assert long["pages"] == sorted(long["pages"]) and long["pages"][-1] > long["pages"][0]
    assert long["held"] <= long["pages"][-1] < long["held"] + long["step"]
    assert long["growth"] <= long["used"] + MARGIN, f"{long['growth'] / 2**20:.1f} MiB after the load"
    short = run_child(long_context_model, cache_dir, 256)  # a quarter-context pool, grown by copies
    assert long["tokens"] == short["tokens"]


def test_reserved_rows_are_handed_out_in_steps_without_a_new_tensor():
    dev = simulated_device("sim")
    pool = PagePool(dev, 4, 2, 16, 8, reserve=64)
    tensor = pool.pages
    assert pool.rows == 64 and pool.num_pages == 4 and dev.kv_bytes == 4 * pool.page_bytes
    assert pool.allocate(3) == [0, 1, 2] and pool.allocate(6) is not None
    assert pool.num_pages == 12 and pool.pages is tensor and dev.kv_bytes == 12 * pool.page_bytes
    assert pool.allocate(60) is not None and pool.num_pages == 69 and pool.pages is not tensor  # past them: a copy


def test_a_refused_reservation_falls_back_to_growth_by_copies_keeping_the_pages(monkeypatch):
    dev = simulated_device("sim")
    empty = dev.empty

    def small_only(shape, dtype):
        if shape[0] > 8:
            raise MemoryError("no room for the reservation (injected)")
        return empty(shape, dtype)

    monkeypatch.setattr(dev, "empty", small_only)
    pool = PagePool(dev, 4, 2, 16, 8, reserve=64)
    assert pool.rows == 4 and pool.step == 0
    ids = pool.allocate(4)
    data = np.arange(4 * 2 * 2 * 16 * 8, dtype=np.float32).reshape(4, 2, 2, 16, 8)
    dev.write(pool.pages, data)
    assert pool.allocate(2) is not None and pool.rows == 8 and pool.num_pages == 8
    assert np.array_equal(dev.download(pool.pages)[ids], data)  # the pages held, copied into the new tensor
