"""Spilling a session's KV to host memory and resuming it from there: how the batch scheduler makes room
in a full pool without recomputing anything. A spilled session keeps its length and tokens; its pages go
back to their pools, their contents to host arrays; on resume it takes pages again and the contents are
written back, so its next step continues as if nothing happened (no prefill runs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.block_type import KV_PAGES
from jitllm.ir.kv_quant import convert_pages
from jitllm.runtime.engine.kv_pages import PageTable


@dataclass
class SpilledKV:
    """A session's KV pages by block, on the host."""

    positions: int
    tokens: list[int]
    pages: dict[int, np.ndarray]
    """Block index -> its pages' contents [pages, 2, kv_heads, page_size, row], in position order, as the
    pool they came from stores them."""
    kv_types: dict[int, str]
    """Block index -> the KV type of that pool (resume converts where the block's pool now stores another)."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.pages.values())


def spill(ex, session) -> SpilledKV:
    """Copy the session's pages to host arrays and give them back to their pools (sessions with recurrent
    state are not spilled: the batch scheduler takes KV-page models only)."""
    ex.drop_graphs(session)  # (drains)
    pages: dict[int, np.ndarray] = {}
    kv_types: dict[int, str] = {}
    for unit in ex.blocks:
        table = session.tables.get(unit.index)
        if unit.state != KV_PAGES or table is None or not table.ids:
            continue
        dev = unit.device
        staged = dev.empty((len(table.ids), *table.pool.pages.shape[1:]), table.pool.dtype)
        unit.program.export_pages(table.pool.pages, dev.upload(np.asarray(table.ids, np.int32)), staged)
        pages[unit.index] = dev.download(staged)
        kv_types[unit.index] = table.pool.kv_type
    for table in session.tables.values():
        table.release()
    session.tables.clear()
    session.arenas.clear()
    session.step_inputs.clear()
    session.kv_room = 0
    return SpilledKV(session.length, list(session.tokens), pages, kv_types)


def resume(ex, session, spilled: SpilledKV) -> bool:
    """Pages for the spilled history on each block's device (where the block is now: it may have moved,
    to a pool of another KV type: the contents are converted) with the contents written back; False,
    taking nothing, where a pool has no room yet."""
    tables: dict[int, PageTable] = {}
    for index, data in spilled.pages.items():
        unit = ex.blocks[index]
        table = tables[index] = PageTable(ex.pool(unit.device), arena=session.arena(unit.device))
        try:
            fits = table.ensure(spilled.positions)
        except JitllmError:  # over the device's budget: no room either
            fits = False
        if not fits:
            for taken in tables.values():
                taken.release()
            session.arenas.clear()
            return False
    ex.drain()
    ex._epoch += 1
    for index, table in tables.items():
        unit = ex.blocks[index]
        dev = unit.device
        unit.program.import_pages(table.pool.pages, dev.upload(np.asarray(table.ids, np.int32)),
                                  dev.upload(convert_pages(spilled.pages[index], spilled.kv_types[index],
                                                           table.pool.kv_type, table.pool.dtype)))
        session.tables[index] = table
    session.length, session.tokens = spilled.positions, list(spilled.tokens)  # (a fall-back reset the session)
    session.kv_room = 0
    return True
