"""Batched steps of ever new row counts keep the host's memory bounded: the host VMs' allocator gives a
step's buffers back (TVM's default pooled allocator kept a set per row count seen: jitllmd's RSS climbed
through a soak, docs/server.md)."""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import pytest

from jitllm import model as jm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not had back (heap chunks in use and mmapped chunks)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        pytest.skip("no glibc mallinfo2")
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def test_batched_steps_of_new_row_counts_give_their_buffers_back(tiny_model, cache_dir):
    model = jm.load(tiny_model, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir)
    ex = model.executor
    rng = np.random.default_rng(0)

    def step(rows: int) -> None:
        a, b = ex.new_session(), ex.new_session()
        ex.batched_forward([(a, [int(t) for t in rng.integers(4, 250, rows)]), (b, [5])])
        ex.close_session(a)
        ex.close_session(b)

    step(200)  # (the pools and the kernels' first buffers)
    step(7)
    before = malloc_in_use()
    for rows in range(9, 200, 3):  # 64 row counts never seen
        step(rows)
    grown = malloc_in_use() - before
    assert grown < 2 << 20, f"malloc holds {grown / 2**20:.1f} MiB more after 64 new row counts"
