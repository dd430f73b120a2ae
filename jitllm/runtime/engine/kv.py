"""KV bookkeeping before a step: each device's page pool, and pages for every attention block of a session
(when a device has no room, the executor's `relocate` moves a block off it and the step goes on)."""

from __future__ import annotations

from jitllm.core.errors import JitllmError
from jitllm.ir.block_type import KV_PAGES
from jitllm.lowering.target import kv_type_on
from jitllm.runtime.backends.host import HOST
from jitllm.runtime.device import Device
from jitllm.runtime.engine.kv_pages import PagePool, PageTable
from jitllm.runtime.engine.scheduler import context_pages, initial_pages, step_pages


def pool(ex, device: Device) -> PagePool:
    """The device's page pool, grown on demand up to the pages its KV budget holds (Device.kv_budget_bytes;
    none: as many as allocation gives), in the model's KV type where the device's target stores it (else
    what kv_type_on falls back to: kind_for_target gives its kinds the same). Where the device takes memory
    only as it is written (the host), its tensor is reserved for the whole context of its blocks and its
    pages handed out in steps of 256 positions (scheduler.step_pages): memory follows the pages used, and
    one session never makes it copy; elsewhere it starts with a quarter of the context and grows by
    doubling, a copy each time."""
    if device.name not in ex.pools:
        cfg, page = ex.layout.config, ex.layout.block_kinds[0].page_size
        kv_type = kv_type_on(ex.layout.kv_type, device.target)
        blocks_here = sum(1 for i in range(cfg.num_blocks) if ex._placement[i] is device)
        max_pages = None
        if device.kv_budget_bytes is not None:
            max_pages = device.room(kv=True) // PagePool.bytes_per_page(cfg.kv_heads, page,
                                                                                                cfg.head_dim, kv_type)
            if max_pages < 1:
                raise JitllmError(f"{device.name}: its KV budget holds no page ({device.kv_budget_bytes} bytes)")
        reserve = context_pages(blocks_here, ex.ctx, page) if device.memory_on_touch else 0
        first = step_pages(blocks_here, ex.ctx, page) if reserve else initial_pages(blocks_here, ex.ctx, page)
        ex.pools[device.name] = PagePool(device, first if max_pages is None else min(first, max_pages), cfg.kv_heads,
                                         page, cfg.head_dim, max_pages, kv_type, reserve)
    return ex.pools[device.name]


def table_of(ex, session, unit) -> PageTable:
    """The session's page table of `unit` (an empty one on the unit's device where it has none yet)."""
    table = session.tables.get(unit.index)
    if table is None:
        table = session.tables[unit.index] = PageTable(ex.pool(unit.device), arena=session.arena(unit.device))
    return table


def pages_for(ex, session, unit, positions: int) -> PageTable:
    """The unit's page table holding `positions` positions. Where its device has no room for more pages
    (the pool says so, or the device's budget or allocator refuses a larger pool), `relocate` (if set)
    moves a block off that device, KV and all, and we try again."""
    ex.drain()
    ex._epoch += 1
    while True:
        table = table_of(ex, session, unit)
        try:
            if table.ensure(positions):
                return table
            problem: Exception = JitllmError(f"{unit.device.name}: out of KV pages for {positions} positions")
        except Exception as e:  # over the KV budget, or the device's own allocator failing
            problem = e
        if unit.device.name == HOST:
            raise problem
        if ex.relocate is None:
            raise JitllmError(f"{unit.device.name}: no room for more KV pages, so the context stops "
                              f"growing there (-relocate is off): {problem}") from None
        ex.relocate(unit.device, problem)


def try_room(ex, session, positions: int) -> bool:
    """Pages for `positions` in every attention block's table, without relocating anything: False where a
    device's pool is full (the batch scheduler then lets sessions wait, or spills one). Pages taken before
    the refusal stay the session's."""
    if positions <= session.kv_room:
        return True
    ex.drain()
    ex._epoch += 1
    for unit in ex.blocks:
        if unit.state != KV_PAGES:
            continue
        table = table_of(ex, session, unit)
        try:
            if not table.ensure(positions):
                return False
        except JitllmError:  # over the device's budget: the same answer as a full pool
            return False
    session.kv_room = min((len(t.ids) * t.pool.page_size for t in session.tables.values()), default=0)
    return True


def ensure_room(ex, session, positions: int) -> None:
    """Pages for `positions` in every attention block's table (before the step: relocation may move
    blocks, and must do so before it)."""
    if positions > session.kv_room:
        for unit in ex.blocks:
            if unit.state == KV_PAGES:
                ex.pages_for(session, unit, positions)
        session.kv_room = min((len(t.ids) * t.pool.page_size for t in session.tables.values()), default=0)
