"""One step over many sessions: each session's new tokens (one to decode, or a chunk of its prompt) are
rows of one ragged batch, and every block runs once for all of them (each block's weights are read once
per step, whatever the batch). The blocks' ragged variants (BlockKind.ragged) take the rows with each
session's page table, history length and first row; the head's takes each session's last row.

Batch-1 steps keep their own path (forward.py, captured and pipelined decode); this one serves the step
plans of the batch scheduler (batch_scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.block_type import KV_PAGES
from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.engine.faults import device_faults
from jitllm.runtime.engine.forward import check_context, current_segments
from jitllm.runtime.engine.step_graphs import Segment
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
    for segment in current_segments(ex):
        with device_faults(segment.device):
            x, logits = _run_segment(ex, work, segment, x, source, rows)
        source = segment.device
    for session, ids in work:
        session.length += len(ids)
        session.tokens += ids
    return source.download(logits)[0]


def _run_segment(ex, work, segment: Segment, x, source: Device | None, rows: RaggedRows):
    dev = segment.device
    h = dev.upload(x) if isinstance(x, np.ndarray) else dev.receive(x, source)
    cos, sin = ex.rope
    cos_t, sin_t = dev.upload(cos[rows.positions][None]), dev.upload(sin[rows.positions][None])
    past_t, starts_t = dev.upload(rows.past), dev.upload(rows.starts)
    for unit in segment.blocks:
        tables = [session.tables[unit.index] for session, _ in work]
        pool = tables[0].pool
        width = max(len(t.ids) for t in tables)
        pt = np.zeros((len(tables), width), np.int32)
        for i, table in enumerate(tables):
            pt[i, : len(table.ids)] = table.ids
        pt_t = dev.upload(pt)
        program = ragged_program(ex, unit)
        h, k, v = program.main(h, cos_t, sin_t, pool.pages, pt_t, past_t, starts_t, *unit.weights)
        program.append(pool.pages, k, v, pt_t, past_t, starts_t)
    if segment.head is None:
        return h, None
    head = ragged_program(ex, segment.head)
    return h, head.main(h, dev.upload(rows.last), *segment.head.weights)
