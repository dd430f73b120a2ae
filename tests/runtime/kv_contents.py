"""A block's KV contents of a session, read back from its page pool (tests compare them around a fault)."""

from __future__ import annotations

import numpy as np


def kv_of(session, index: int, length: int) -> np.ndarray:
    """Block `index`'s K and V of the session's first `length` positions, [2, kv_heads, length, head_dim]."""
    table = session.tables[index]
    pool = table.pool
    pages = pool.device.download(pool.pages)[table.ids]  # [pages, 2, kv_heads, page_size, head_dim]
    return pages.transpose(1, 2, 0, 3, 4).reshape(*pages.shape[1:3], -1, pages.shape[-1])[:, :, :length].copy()


def f32_kv_device():
    """A simulated device whose target stores f32 KV only (TargetCaps.kv_types): a block moving there from
    an f16 or q8_0 pool has its pages converted."""
    from dataclasses import replace

    from jitllm.lowering.targets.llvm import LlvmTarget
    from jitllm.runtime.backends.fake import simulated_device

    wide = simulated_device("sim:f32")
    wide.target = LlvmTarget("exact")
    wide.target.caps = replace(LlvmTarget.caps, kv_types=("f32",))
    return wide
