"""Paged KV: a pool of fixed-size pages per device; each (block, session) owns a list of page ids.

The bookkeeping (free list, page lists) is plain integers (scheduler.py); the pool tensor
[rows, 2, kv_heads, page_size, row] of the device's KV type (f32, f16 or q8_0: the loaded kv type where
its target stores it; a row is head_dim values, or q8_0's bytes, jitllm.ir.kv_quant) lives on the device and
is only touched by kernels. Its rows are the ids handed out so far (`num_pages`) or, where the device's
memory is taken only as it is written, the whole context's pages reserved ahead, of which only the pages
sessions were given ever hold memory.
A session's page-table tensors on one device are rows of one tensor (TableArena), uploaded together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jitllm.ir.config import KV_DTYPES
from jitllm.ir.kv_quant import row_width
from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.engine.scheduler import PageAllocator, pages_for

TABLE_ROOM = 64
"""Page ids a table's tensor holds at first (1024 positions at 16 per page)."""


class PagePool:
    """One device's pool tensor and the page ids in it (scheduler.PageAllocator): hands out, frees and
    reports pages. Its ids (`num_pages`, what its device's KV budget is charged) grow as sessions need
    pages: within the tensor's rows in steps of the first size where the tensor was reserved ahead
    (`reserve`), else by a larger tensor holding the pages handed out so far."""

    def __init__(self, device: Device, num_pages: int, kv_heads: int, page_size: int, head_dim: int,
                 max_pages: int | None = None, kv_type: str = "f32", reserve: int = 0) -> None:
        """`num_pages`: the ids at first; `reserve`: the rows to allocate the tensor with from the start
        (at most `max_pages`), for a device whose memory is taken only as it is written
        (Device.memory_on_touch): the ids then grow in steps of `num_pages` with no new tensor. Where
        the reserved tensor cannot be allocated, the pool starts at `num_pages` rows and grows by copies."""
        self.device = device
        self.page_size = page_size
        self.max_pages = max_pages
        self.kv_type = kv_type
        self.dtype = KV_DTYPES[kv_type]
        self._page_shape = (2, kv_heads, page_size, row_width(kv_type, head_dim))
        self.page_bytes = self.bytes_per_page(kv_heads, page_size, head_dim, kv_type)
        self.step = num_pages if reserve > num_pages else 0
        """The ids' growth within reserved rows (0: the pool grows by larger tensors only)."""
        self.pages: Tensor | None = None
        self.ids = PageAllocator()
        rows = min(reserve, max_pages) if max_pages is not None else reserve
        if rows > num_pages:
            try:
                self._grow(num_pages, rows)
                return
            except Exception:  # noqa: BLE001 (refused: a budget refuses the smaller tensor below too)
                self.step = 0
        self._grow(num_pages, num_pages)

    @staticmethod
    def bytes_per_page(kv_heads: int, page_size: int, head_dim: int, kv_type: str = "f32") -> int:
        return 2 * kv_heads * page_size * row_width(kv_type, head_dim) * np.dtype(KV_DTYPES[kv_type]).itemsize

    @property
    def num_pages(self) -> int:
        return self.ids.capacity

    @property
    def free_pages(self) -> int:
        return len(self.ids.free)

    @property
    def rows(self) -> int:
        """Pages the tensor has room for (num_pages or more)."""
        return 0 if self.pages is None else int(self.pages.shape[0])

    def _grow(self, num_pages: int, rows: int) -> None:
        """Ids up to `num_pages`, in a tensor of `rows` pages: a new one, holding every page handed out so far
        (same ids, same content), where the current has fewer rows. Charges nothing where it raises."""
        extra = num_pages - self.num_pages
        self.device.reserve(extra * self.page_bytes, f"KV pool growth by {extra} pages", kv=True)
        if rows > self.rows:
            try:
                grown = self.device.empty((rows, *self._page_shape), self.dtype)
                if self.num_pages:  # (the rows past them were never handed out: not copied, not touched)
                    held = (self.num_pages, *self._page_shape)
                    self.device.copy_from(self.device.region(grown, held, self.dtype, 0),
                                          self.device.region(self.pages, held, self.dtype, 0), self.device)
            except BaseException:
                self.device.release(extra * self.page_bytes, kv=True)
                raise
            self.pages = grown
        self.ids.extend(num_pages)

    def allocate(self, count: int) -> list[int] | None:
        """`count` page ids; where too few are free, more ids: within the reserved rows in whole steps, else
        a tensor of twice the pages (up to max_pages). None where even max_pages is too few (the caller
        relocates, spills or waits). The device failing to hold a larger pool raises (its budget or its
        allocator), charging nothing."""
        taken = self.ids.take(count)
        if taken is None:
            want = self.ids.growth(count, self.max_pages)
            if want is None:
                return None
            need = self.num_pages + count - self.free_pages
            if need <= self.rows and self.step:  # (want >= need; a step may round past it, not past max_pages)
                want = min(-(-need // self.step) * self.step, self.rows, self.max_pages or self.rows)
            self._grow(want, max(want, self.rows))
            taken = self.ids.take(count)
        return taken

    def free(self, ids: list[int]) -> None:
        self.ids.give_back(ids)

    def close(self) -> None:
        self.device.release(self.num_pages * self.page_bytes, kv=True)
        self.pages = None
        self.ids = PageAllocator()


class TableArena:
    """The page-table tensors of one session's tables on one device as rows of one tensor, so the tables
    that gained pages together (every block of a session, every 16 tokens) are uploaded by one copy, not
    one each (28 small copies every 16 tokens were the largest host cost of a 3B decode step's
    bookkeeping). Each table's tensor is a view of its row (an alias, Device.aliases); the rows stay
    where they are until the arena needs more rows or more room, when it is laid out afresh (new
    tensors: captured steps that baked the old ones are captured again)."""

    def __init__(self, device) -> None:
        self.device = device
        self.host = np.zeros((0, TABLE_ROOM), np.int32)
        self._tensor: Tensor | None = None
        self._views: list[Tensor] = []
        self._free: list[int] = []
        self._used = 0
        self._dirty = False

    def row(self) -> int:
        """A row for a new table."""
        if self._free:
            return self._free.pop()
        self._used += 1
        return self._used - 1

    def release(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, ids: list[int]) -> None:
        """The table's ids, uploaded with every other row written before the next view is asked for."""
        rows, room = self.host.shape
        if row >= rows or len(ids) > room:  # doubling what is short
            grown = np.zeros((2 * row + 2 if row >= rows else rows,
                              room if len(ids) <= room else 1 << (len(ids) - 1).bit_length()), np.int32)
            grown[:rows, :room] = self.host
            self.host, self._tensor = grown, None
        self.host[row, : len(ids)] = ids
        self._dirty = True

    def view(self, row: int) -> Tensor:
        if self._tensor is None:
            rows, room = self.host.shape
            self._tensor = self.device.empty((rows, room), "int32")
            self._views = self.device.aliases(self._tensor, tuple(((1, room), "int32", r * room * 4) for r in range(rows)))
            self._dirty = True
        if self._dirty:
            self.device.write(self._tensor, self.host)
            self._dirty = False
        return self._views[row]


@dataclass
class PageTable:
    """The pages of one (block, session), in position order, and its int32 tensor for the kernels: a
    row of `arena` (the session's on the table's device; one of its own when none is given).

    The row has room for more ids than are in use (the kernels read only the ones the history needs)
    and is rewritten in place when pages are added, so its address stays fixed — captured decode
    graphs bake it — until the arena is laid out afresh."""

    pool: PagePool
    ids: list[int] = field(default_factory=list)
    arena: TableArena | None = None
    _row: int = -1

    def __post_init__(self) -> None:
        if self.arena is None:
            self.arena = TableArena(self.pool.device)

    def ensure(self, positions: int) -> bool:
        """Own enough pages for `positions` positions; False where the pool has no room for them."""
        need = pages_for(positions, self.pool.page_size) - len(self.ids)
        if need > 0:
            taken = self.pool.allocate(need)
            if taken is None:
                return False
            self.ids += taken
            self.arena.write(self._own_row(), self.ids)
        return True

    def truncate(self, positions: int) -> None:
        """Keep the pages that hold the first `positions` positions; the rest go back to the pool."""
        keep = pages_for(positions, self.pool.page_size)
        if keep < len(self.ids):
            self.pool.free(self.ids[keep:])
            del self.ids[keep:]
            self.arena.write(self._own_row(), self.ids)

    def tensor(self) -> Tensor:
        if self._row < 0:
            self.arena.write(self._own_row(), self.ids)
        return self.arena.view(self._row)

    def _own_row(self) -> int:
        if self._row < 0:
            self._row = self.arena.row()
        return self._row

    def release(self) -> None:
        self.pool.free(self.ids)
        self.ids = []
        if self._row >= 0:
            self.arena.release(self._row)
            self._row = -1
