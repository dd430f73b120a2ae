"""One step over many sessions: each session's new tokens (one to decode, or a chunk of its prompt) are
rows of one ragged batch, and every block runs once for all of them (each block's weights are read once
per step, whatever the batch). The blocks' ragged variants (BlockKind.ragged) take the rows with each
session's page table, history length and first row; the head's takes each session's last row.

Batch-1 steps keep their own path (forward.py, captured and pipelined decode); this one serves the step
plans of the batch scheduler (batch_scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.block_type import KV_PAGES
from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.engine import batch_graphs
from jitllm.runtime.engine.faults import device_faults
from jitllm.runtime.engine.forward import check_context, current_segments
from jitllm.runtime.engine.step_graphs import PlainTransfers, Segment, Transfers
from jitllm.runtime.model_layout import HEAD
from jitllm.runtime.program import Program


@dataclass
class RaggedRows:
    """A step's rows on the host: which session owns which rows, at which positions."""

    starts: np.ndarray
    """[sessions + 1] int32: session i's rows are starts[i] .. starts[i + 1] - 1."""
    past: np.ndarray
    """[sessions] int32: each session's history length before the step."""
    positions: np.ndarray
    """[rows] int64: each row's position in its session."""

    @classmethod
    def of(cls, lengths: list[int], counts: list[int]) -> "RaggedRows":
        starts = np.zeros(len(counts) + 1, np.int32)
        np.cumsum(counts, out=starts[1:])
        positions = np.concatenate([np.arange(p, p + n) for p, n in zip(lengths, counts)])
        return cls(starts, np.asarray(lengths, np.int32), positions)

    @property
    def last(self) -> np.ndarray:
        """[sessions] int32: each session's last row."""
        return self.starts[1:] - 1


def check_batchable(ex) -> None:
    """Batched steps need every unit's device to compile ragged variants and every block to keep its
    state in KV pages (a recurrent block's state has one sequence)."""
    for unit in (*ex.blocks, ex.head):
        if unit.index != HEAD and unit.state != KV_PAGES:
            raise JitllmError(f"block {unit.index} is a {unit.kind.kind} block (recurrent state), which batched "
                              "steps do not take: run its sessions one at a time")
        if not unit.device.target.caps.ragged_batches:
            raise JitllmError(f"{unit.device.name}: its target ({unit.device.target.name}) has no batched "
                              "(ragged) kernels yet: place the model on the CPU to batch it")


def ragged_program(ex, unit) -> Program:
    """The unit's ragged variant on its device, looked up once per unit and device."""
    key = (unit.index, unit.device.name)
    found = ex._ragged.get(key)
    if found is None:
        found = ex._ragged[key] = ex.program(unit.kind.ragged_variant(), unit.device)
    return found


def batched_forward(ex, work: list[tuple[object, list[int]]]) -> np.ndarray:
    """Each (session, ids) of `work` appended after that session's history, all in one step; the logits of
    each session's last new token, [sessions, vocab]. A session appears at most once."""
    if not work:
        raise ValueError("a batched step needs at least one session")
    if len({id(s) for s, _ in work}) != len(work):
        raise ValueError("a session appears twice in one step")
    ex.drain()
    for session, ids in work:
        if not ids:
            raise ValueError(f"session {session.id} has no tokens in this step")
        check_context(ex, session.length + len(ids))
    for session, ids in work:  # (relocation, where a device is full, moves blocks before the step)
        ex.ensure_room(session, session.length + len(ids))
    rows = RaggedRows.of([s.length for s, _ in work], [len(ids) for _, ids in work])
    x: Tensor | np.ndarray = ex.embed([t for _, ids in work for t in ids])[None]
    source: Device | None = None
    logits = None
    found = current_segments(ex)
    bucket = batch_graphs.bucket_of(ex, work, found)  # (None: this step runs eagerly)
    for segment in found:
        with device_faults(segment.device):
            if bucket is None:
                x, logits = _run_segment(ex, work, segment, x, source, rows)
            else:
                x, logits = batch_graphs.replay_segment(ex, work, segment, x, source, bucket)
        source = segment.device
    for session, ids in work:
        session.length += len(ids)
        session.tokens += ids
    return logits[: len(work)].copy() if isinstance(logits, np.ndarray) else source.download(logits)[0]


TABLE_WIDTH_STEP = 16
"""Page-table columns are rounded up to a multiple of this (256 positions at 16 per page), so a decode
batch keeps its staged inputs for many steps."""


ALIGN = 16
"""Elements (of 4 bytes) each staged input starts at a multiple of: kernels take 64-byte aligned data."""


def _aligned(count: int) -> int:
    return -(-count // ALIGN) * ALIGN


class RaggedInputs:
    """A batched step's small inputs on one device as views of two buffers (int32: each session's history
    length, first rows and last row, and every block's page table; float32: cos and sin of each row),
    written with one copy each per step and laid out afresh only when the batch's shape changes (one upload
    per input per block was half of the step's host time). Its host arrays come from `transfers` (a
    captured step's: page-locked on CUDA, so `upload` can be a node of its graph)."""

    def __init__(self, device: Device, sessions: int, rows: int, width: int, blocks: int, half: int,
                 transfers: Transfers | None = None) -> None:
        self.shape = (sessions, rows, width, blocks)
        self.device = device
        self.transfers = transfers or PlainTransfers(device)
        sizes = [(sessions,), (sessions + 1,), (sessions,)] + [(sessions, width)] * blocks
        self._int_at = np.cumsum([0] + [_aligned(int(np.prod(s))) for s in sizes]).tolist()
        self.ints = self.transfers.host_array((self._int_at[-1],), "int32")
        self._float_at = _aligned(rows * half)
        self.floats = self.transfers.host_array((2 * self._float_at,), "float32")
        self.int_tensor = device.empty(self.ints.shape, "int32")
        self.float_tensor = device.empty(self.floats.shape, "float32")
        self.past, self.starts, self.last, *self.tables = device.aliases(
            self.int_tensor, tuple((shape, "int32", 4 * at) for shape, at in zip(sizes, self._int_at)))
        self.cos, self.sin = device.aliases(self.float_tensor, (((1, rows, half), "float32", 0),
                                                                ((1, rows, half), "float32", 4 * self._float_at)))

    def fill(self, rows: RaggedRows, tables: list[list[list[int]]], cos: np.ndarray, sin: np.ndarray) -> None:
        """This step's values (`tables`: per block, each session's page ids) into the host arrays."""
        sessions, count, width, _ = self.shape
        ints, at = self.ints, self._int_at
        ints[at[0]:at[0] + sessions] = rows.past
        ints[at[1]:at[1] + sessions + 1] = rows.starts
        ints[at[2]:at[2] + sessions] = rows.last
        for b, block in enumerate(tables):
            grid = ints[at[3 + b]:at[3 + b] + sessions * width].reshape(sessions, width)
            for i, ids in enumerate(block):
                grid[i, : len(ids)] = ids
        n = count * cos.shape[1]
        self.floats[:n] = cos[rows.positions].ravel()
        self.floats[self._float_at:self._float_at + n] = sin[rows.positions].ravel()

    def upload(self) -> None:
        """The host arrays into the device buffers: two copies."""
        self.transfers.copy_in(self.int_tensor, self.ints)
        self.transfers.copy_in(self.float_tensor, self.floats)


def staged_inputs(ex, segment: Segment, work, rows: RaggedRows) -> RaggedInputs:
    dev = segment.device
    tables = [[session.tables[unit.index].ids for session, _ in work] for unit in segment.blocks]
    longest = max((len(ids) for block in tables for ids in block), default=1)
    width = -(-max(longest, 1) // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP
    shape = (len(work), len(rows.positions), width, len(segment.blocks))
    staged = ex._ragged_inputs.get(dev.name)
    if staged is None or staged.shape != shape:
        staged = ex._ragged_inputs[dev.name] = RaggedInputs(dev, *shape, ex.layout.config.head_dim // 2)
    staged.fill(rows, tables, *ex.rope)
    staged.upload()
    return staged


def _run_segment(ex, work, segment: Segment, x, source: Device | None, rows: RaggedRows):
    dev = segment.device
    h = dev.upload(x) if isinstance(x, np.ndarray) else dev.receive(x, source)
    return run_units(ex, segment, h, staged_inputs(ex, segment, work, rows))


def run_units(ex, segment: Segment, h: Tensor, staged: RaggedInputs,
              call: Callable = lambda fn, *args: fn(*args)) -> tuple[Tensor, Tensor | None]:
    """The segment's ragged variants over `h` and `staged`, launched through `call` (directly, or recorded
    into a graph: batch_graphs.py): the hidden state out and, where the segment ends with the head, the
    logits of each session's last row."""
    pages = ex.pools[segment.device.name].pages if segment.blocks else None
    for unit, pt in zip(segment.blocks, staged.tables):
        program = ragged_program(ex, unit)
        h, k, v = unit.outputs(call(program.main, h, staged.cos, staged.sin, pages, pt, staged.past, staged.starts,
                                    *unit.call_weights()))
        unit.launched()
        call(program.append, pages, k, v, pt, staged.past, staged.starts)
    if segment.head is None:
        return h, None
    head = ragged_program(ex, segment.head)
    return h, call(head.main, h, staged.last, *segment.head.weights)
