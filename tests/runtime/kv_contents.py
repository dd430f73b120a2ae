"""A block's KV contents of a session, read back from its page pool (tests compare them around a fault)."""

from __future__ import annotations

import numpy as np


def kv_of(session, index: int, length: int) -> np.ndarray:
    """Block `index`'s K and V of the session's first `length` positions, [2, kv_heads, length, head_dim]."""
    table = session.tables[index]
    pool = table.pool
    pages = pool.device.download(pool.pages)[table.ids]  # [pages, 2, kv_heads, page_size, head_dim]
    return pages.transpose(1, 2, 0, 3, 4).reshape(*pages.shape[1:3], -1, pages.shape[-1])[:, :, :length].copy()
