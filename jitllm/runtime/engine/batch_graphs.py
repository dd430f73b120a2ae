"""Captured batched decode steps: one graph per batch-size bucket (BUCKETS) and segment, replayed every step.

A step of B decode rows (one token per session) on devices that capture steps (CUDA graphs; the host's
stand-in, ReplayRecorder, on simulated devices) runs in the smallest bucket of at least B sessions. The
bucket's inputs are static buffers of that shape (`BucketInputs`): the hidden rows, each session's
history length, first and last row, every block's page table and each row's cos/sin. The host writes this
step's values into their host arrays (page-locked on CUDA); the graph begins by copying them in and, where
it ends with the head, ends by copying the logits out, so a step is one launch and one wait per segment.

Page tables are inputs, so a new page or a changed table needs no new capture; a table outgrowing the
bucket's width (doubled then) does. A capture bakes the units' weights, the device's page pool and the
buffers: its signature is their ids, checked every step. Pool growth drops the device's captures; a move
(migration.move_unit) drops the captures of the two devices it touched, no other.

Padding rows (sessions B .. bucket - 1) are decode rows at position 0 whose page tables point at one page
of the device's pool kept for them (`pad_page`), which no session owns: their appends write there and
their logits are dropped. Mixed steps (a prompt chunk beside decode rows), more than 64 sessions, streamed
or recurrent units and a pool with no page left for padding run eagerly (batched.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.engine import batched as ragged
from jitllm.runtime.engine.step_graphs import GraphRecord, Segment
from jitllm.runtime.model_layout import HEAD

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Sessions per captured batched step; a step is padded up to the first that holds it."""


def bucket_for(sessions: int) -> int | None:
    """The smallest bucket holding `sessions` (None past the largest: the step runs eagerly)."""
    return next((b for b in BUCKETS if b >= sessions), None)


@dataclass
class BatchGraphs:
    """An executor's captured batched steps, keyed (device name, bucket, the segment's first unit)."""

    records: dict[tuple, GraphRecord] = field(default_factory=dict)
    inputs: dict[tuple, "BucketInputs"] = field(default_factory=dict)
    pad_pages: dict[str, tuple[object, int]] = field(default_factory=dict)
    """Per device: (its pool, the page padding rows write to)."""
    pools: dict[str, Tensor] = field(default_factory=dict)
    """Per device: the pool tensor its captures baked (a grown pool drops them)."""
    captures: int = 0

    def drop(self, devices: tuple[str, ...] | None = None) -> None:
        """Forget the captures (and their buffers) on `devices` (all where None)."""
        for table in (self.records, self.inputs):
            for key in [k for k in table if devices is None or k[0] in devices]:
                del table[key]
        for name in [n for n in self.pools if devices is None or n in devices]:
            del self.pools[name]


def bucket_of(ex, work: list[tuple[object, list[int]]], found: list[Segment]) -> int | None:
    """The bucket this step replays in, or None where it runs eagerly: not decode rows only, more sessions
    than the largest bucket, a segment on a device without captured steps (or with streamed or recurrent
    units), captured steps off (`Executor.graphs`, `Executor.batch_graphs`), or no page for padding rows."""
    if not (ex.graphs and ex.batch_graphs) or any(len(ids) != 1 for _, ids in work):
        return None
    bucket = bucket_for(len(work))
    if bucket is None or not all(s.device.graphs is not None and s.capturable for s in found):
        return None
    if bucket > len(work) and any(pad_page(ex, s.device) is None for s in found if s.blocks):
        return None
    return bucket


def pad_page(ex, device: Device) -> int | None:
    """The page of `device`'s pool that padding rows write to, taken once per pool (None: the pool is full)."""
    pool = ex.pools[device.name]
    held = ex._batch_graphs.pad_pages.get(device.name)
    if held is not None and held[0] is pool:
        return held[1]
    ex._epoch += 1  # (the pool may grow: batch-1 captures check what they baked again)
    try:
        taken = pool.allocate(1)
    except JitllmError:  # over the device's KV budget: as a full pool
        return None
    if taken is None:
        return None
    ex._batch_graphs.pad_pages[device.name] = (pool, taken[0])
    return taken[0]


class BucketInputs:
    """One bucket's static inputs of one segment: the ragged inputs (ragged.RaggedInputs over the device's
    transfers), the hidden rows [1, bucket, hidden] and, where the segment ends with the head, the logits'
    host array [1, bucket, vocab]."""

    def __init__(self, device: Device, bucket: int, width: int, blocks: int, hidden: int, half: int,
                 vocab: int | None) -> None:
        transfers = device.graphs
        self.width = width
        self.ragged = ragged.RaggedInputs(device, bucket, bucket, width, blocks, half, transfers)
        self.x = device.empty((1, bucket, hidden), "float32")
        self.x_host = transfers.host_array((1, bucket, hidden), "float32")
        self.logits = transfers.host_array((1, bucket, vocab), "float32") if vocab else None
        self.x_staged = True
        """Whether this step's hidden rows come from the host (the first segment), not another device."""

    def feed(self, x: Tensor | np.ndarray, device: Device, source: Device | None) -> None:
        """This step's hidden rows: host rows into the host array (padding rows repeat the first), or the
        segment before's output (on `source`, all the bucket's rows) copied into `x` now."""
        self.x_staged = isinstance(x, np.ndarray)
        if self.x_staged:
            rows = x.shape[1]
            self.x_host[0, :rows] = x[0]
            self.x_host[0, rows:] = x[0, 0]
            return
        device.copy_from(self.x, x, source)
        source.synchronize()
        device.synchronize()

    def upload(self) -> None:
        """The host arrays into the device buffers (a captured step's first nodes)."""
        self.ragged.upload()
        if self.x_staged:
            self.ragged.transfers.copy_in(self.x, self.x_host)

    def download(self, logits: Tensor) -> None:
        """The head's logits into the host array (a captured step's last node)."""
        self.ragged.transfers.copy_out(self.logits, logits)


def replay_segment(ex, work: list[tuple[object, list[int]]], segment: Segment, x, source: Device | None,
                   bucket: int) -> tuple[Tensor, np.ndarray | None]:
    """One batched decode step of the segment as its bucket's graph (captured where none matches what it
    would bake): the hidden rows out (on the device) and, where it ends with the head, the logits'
    host array ([bucket, vocab]: the padding rows' after the sessions')."""
    dev, state = segment.device, ex._batch_graphs
    pad = bucket - len(work)
    pads = [[pad_page(ex, dev)]] * pad if pad and segment.blocks else [[]] * pad
    tables = [[s.tables[u.index].ids for s, _ in work] + pads for u in segment.blocks]
    if segment.blocks and state.pools.get(dev.name) is not ex.pools[dev.name].pages:
        state.drop((dev.name,))  # (every capture here baked the pool before it grew)
        state.pools[dev.name] = ex.pools[dev.name].pages
    key = (dev.name, bucket, segment.blocks[0].index if segment.blocks else HEAD)
    inputs = _inputs(ex, key, segment, bucket, max((len(t) for block in tables for t in block), default=1))
    rows = ragged.RaggedRows.of([s.length for s, _ in work] + [0] * pad, [1] * bucket)
    inputs.ragged.fill(rows, tables, *ex.rope)
    inputs.feed(x, dev, source)
    objects = _baked(ex, segment, inputs)
    record = state.records.get(key)
    if record is None or record.signature != _signature(objects, inputs):
        record = state.records[key] = _capture(ex, segment, inputs, objects, bucket, len(work))
    record.graph.replay()
    return record.output, (inputs.logits[0] if segment.head is not None else None)


WIDTH_FLOOR = 16
"""Page-table columns of a bucket's buffers at first (256 positions at 16 per page); doubled when short."""


def _inputs(ex, key: tuple, segment: Segment, bucket: int, longest: int) -> BucketInputs:
    inputs = ex._batch_graphs.inputs.get(key)
    if inputs is None or inputs.width < longest or inputs.ragged.shape[3] != len(segment.blocks):
        width = max(WIDTH_FLOOR, 1 << (longest - 1).bit_length())
        cfg = ex.layout.config
        inputs = ex._batch_graphs.inputs[key] = BucketInputs(
            segment.device, bucket, width, len(segment.blocks), cfg.hidden, cfg.head_dim // 2,
            cfg.vocab if segment.head is not None else None)
    return inputs


def _baked(ex, segment: Segment, inputs: BucketInputs) -> list:
    """What a segment's captured step bakes in: its device and buffers and, per unit, the unit, its device,
    weights and ragged program (and the blocks' page pool)."""
    objects: list = [segment.device, inputs]
    if segment.blocks:
        objects.append(ex.pools[segment.device.name].pages)
    for unit in [*segment.blocks, *([segment.head] if segment.head is not None else [])]:
        objects += [unit, unit.device, unit.weights, ragged.ragged_program(ex, unit)]
    return objects


def _signature(objects: list, inputs: BucketInputs) -> tuple:
    return tuple(map(id, objects)) + (inputs.x_staged,)


def _capture(ex, segment: Segment, inputs: BucketInputs, objects: list, bucket: int, sessions: int) -> GraphRecord:
    """Record the segment's step (its inputs already hold this step's values: a recorder may run it while
    capturing), keeping every object the graph's addresses point into."""
    keep = list(objects)

    def body(call):
        def keeping(fn, *args):
            out = call(fn, *args)
            keep.extend(args)
            keep.append(out)
            return out

        keeping(inputs.upload)
        h, logits = ragged.run_units(ex, segment, inputs.x, inputs.ragged, keeping)
        if logits is None:
            return h
        keeping(inputs.download, logits)
        return h

    graph, output = segment.device.graphs.capture(body)
    ex._batch_graphs.captures += 1
    if ex.log:
        ex.log(f"captured batched decode graph: bucket {bucket} ({sessions} sessions), {len(segment.blocks)} "
               f"blocks{' + head' if segment.head is not None else ''} on {segment.device.name}")
    return GraphRecord(_signature(objects, inputs), graph, output, keep)
