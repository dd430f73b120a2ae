"""Streamed blocks (`~`): weights that stay in the mapped .jlm and pass through a few device slots.

A device that streams blocks has one SlotPool: STREAM_SLOTS buffers, each as large as the largest block
streamed there (only they are charged to its budget). A streamed unit's step asks for its weights
(`acquire`: aliases into the slot holding them, uploaded there first if no slot does) and says when its
kernels are launched (`release`); then the next streamed unit of the device (in block order, the first one
again after the last: the next token's) is uploaded into another slot, so its upload runs while this
one computes. A slot that already holds a unit's weights is used again without an upload (all streamed
blocks fit in the slots: they upload once). The KV pages of streamed blocks stay on their device.

Where the backend has a copy queue (BackendCaps.async_copies: CUDA), an upload is a read of the file
(pread, not the map: no page of the process is faulted in per token) into that slot's page-locked staging
buffer (one per slot: the model may not fit in host memory, so it is never pinned whole) and an
asynchronous copy on the queue's stream, which waits for the kernels of the slot's previous unit; the
unit's kernels wait for their upload. Elsewhere it is a synchronous write into the slot from the mapped
pages, which are let go after. Steps over segments with streamed units are not captured as graphs
(a graph would bake one unit's slot contents): they run eagerly (step_graphs.Segment.capturable).

The same pool serves expert streaming (JITLLM_GPU_STREAM=1): an MoE block whose routed experts stay in the
file runs its experts-apart program (attention, router, shared expert: resident, or streamed through the
slots above), then its routed experts through the pool's ExpertCache: the experts its router picked are
looked up (expert_cache.ExpertSlots), the misses uploaded into the cache's slots the same two ways as a
block (a synchronous write from the map; or a read into a page-locked staging buffer and copies on the
queue, ordered by markers), and the moe_experts program runs over the cache with a slot map. The host
must see the picks before it uploads, so each such block downloads its [tokens, k] expert ids.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from jitllm.core.errors import DeviceFault, JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.ir.blocks import weight_inputs
from jitllm.ir.config import BlockKind
from jitllm.runtime.backends.base import CopyQueue, Layout, Marker, Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.device_spec import format_bytes
from jitllm.runtime.engine.expert_cache import ExpertSlots
from jitllm.runtime.engine.packed_weights import ALIGN, pack_layout, part_offsets, write_parts
from jitllm.runtime.planner import STREAM_SLOTS
from jitllm.runtime.program import Program


@dataclass
class StreamedSource:
    """A streamed unit's weights where they stay: its file tensors (mapped), grouped per weight input."""

    groups: list[list[np.ndarray]]
    names: list[str]
    """Its file tensors' names, in the order of the parts of `groups`."""
    nbytes: int
    """The weights' bytes as charged (the file tensors'; the slots are charged this much each)."""
    layout: Layout = ()
    padded: int = 0
    """The bytes a slot needs for them (each tensor aligned)."""

    def __post_init__(self) -> None:
        self.layout, self.padded = pack_layout(self.groups)


@dataclass(eq=False)
class _Slot:
    buffer: Tensor
    holder: int | None = None
    views: dict = field(default_factory=dict)
    """layout -> the aliases of `buffer` made for it."""
    staging: np.ndarray | None = None
    ready: Marker | None = None
    """Where the slot's last upload ends (its unit's kernels wait for it; the next upload's host copy too)."""
    free: Marker | None = None
    """Where the kernels of the slot's unit end (the next upload into the slot waits for it)."""


class SlotPool:
    """One device's streaming slots and the streamed units it serves (see the module docstring)."""

    def __init__(self, device: Device, file: JlmFile, slots: int = STREAM_SLOTS) -> None:
        """`file`: where the members' weights are (read into staging buffers, or through its map)."""
        self.device, self.count, self._file = device, slots, file
        self.members: dict[int, StreamedSource] = {}
        self.charged = 0
        """Bytes of the device's budget the slots hold: `count` x the largest member's bytes."""
        self.slots: list[_Slot] = []
        """Made at the first acquire, `count` buffers of the largest member's padded size."""
        self._queue: CopyQueue | None = device.backend.copy_queue() if device.backend.caps.async_copies else None
        self._current: _Slot | None = None
        self._first: int | None = None
        self._next: dict[int, int | None] = {}
        self.uploads = self.uploaded_bytes = self.hits = self.passes = 0
        """Counts: uploads into slots and their bytes, prefetches that found their unit still in a slot (no
        upload), and passes (steps through the first streamed block: a prompt chunk or a decode token)."""
        self.experts: ExpertCache | None = None
        """Where blocks of this device stream their routed experts: its expert cache (expert streaming)."""

    # -- members ----------------------------------------------------------------------------------
    def admit(self, index: int, source: StreamedSource) -> None:
        """Stream unit `index` through these slots: the budget charged for their growth (or a one-line error)."""
        self._recharge({**self.members, index: source}, f"streaming slots for block {index}")
        self.members[index] = source
        self._order()
        if self.slots and source.padded > int(self.slots[0].buffer.shape[0]):
            self._drop_slots()  # (made again, larger, at the next acquire)

    def leave(self, index: int) -> None:
        """Unit `index` no longer streams here (it moved); the slots shrink with what is left."""
        if self.members.pop(index, None) is None:
            return
        self._order()
        for slot in self.slots:
            if slot.holder == index:
                slot.holder = None
        self._recharge(self.members, "")
        if not self.members or self.slots and max(s.padded for s in self.members.values()) < int(
                self.slots[0].buffer.shape[0]):
            self._drop_slots()

    def _recharge(self, members: dict[int, StreamedSource], what: str) -> None:
        wanted = self.count * max((s.nbytes for s in members.values()), default=0)
        if wanted > self.charged:
            self.device.reserve(wanted - self.charged, what)
        else:
            self.device.release(self.charged - wanted)
        self.charged = wanted

    def _drop_slots(self) -> None:
        with contextlib.suppress(DeviceFault):  # (a device that failed has nothing left in flight to wait for)
            self.quiesce()
        self.slots, self._current = [], None

    # -- steps ------------------------------------------------------------------------------------
    def acquire(self, index: int) -> list[Tensor]:
        """Unit `index`'s weights in a slot (uploaded now unless a slot holds them), as its program takes them."""
        self.passes += index == self._first
        slot = self._holding(index, avoid=None)
        self._current = slot
        if self._queue is not None:
            self._queue.device_waits(slot.ready)
        source = self.members[index]
        views = slot.views.get(source.layout)
        if views is None:
            views = slot.views[source.layout] = self.device.aliases(slot.buffer, source.layout)
        return views

    def release(self, index: int) -> None:
        """Unit `index`'s kernels are launched: its slot is free once they ran, and the next streamed unit is
        uploaded into another slot meanwhile."""
        slot = self._current
        if self._queue is not None:
            self._queue.record_kernels(slot.free)
        following = self._next[index]
        if following is not None:
            self._holding(following, avoid=slot)

    def quiesce(self) -> None:
        """Wait for every upload in flight (before the slots' memory is let go)."""
        if self._queue is not None:
            for slot in self.slots:
                self._queue.host_waits(slot.ready)

    def _order(self) -> None:
        """The members' order, worked out when it changes: the first, and each one's follower (the next
        in block order, the first after the last; None where a member is alone)."""
        order = sorted(self.members)
        self._first = order[0] if order else None
        self._next = {i: (order[(k + 1) % len(order)] if len(order) > 1 else None) for k, i in enumerate(order)}

    def _holding(self, index: int, avoid: _Slot | None) -> _Slot:
        """The slot holding `index`'s weights, uploaded into the slot used longest ago (not `avoid`) if none does."""
        if not self.slots:
            self._make_slots()
        for slot in self.slots:
            if slot.holder == index:
                self.hits += avoid is not None  # (a prefetch that found its unit still there)
                self._touch(slot)
                return slot
        slot = next(s for s in self.slots if s is not avoid)
        self._upload(index, slot)
        self._touch(slot)
        return slot

    def _touch(self, slot: _Slot) -> None:
        self.slots.remove(slot)
        self.slots.append(slot)  # (the list runs from used longest ago to used last)

    def _make_slots(self) -> None:
        size = max(s.padded for s in self.members.values())
        self.slots = [_Slot(self.device.empty((size,), "uint8")) for _ in range(self.count)]
        if self._queue is not None:
            for slot in self.slots:
                slot.staging = self._queue.staging(size)
                slot.ready, slot.free = self._queue.marker(), self._queue.marker()

    def _upload(self, index: int, slot: _Slot) -> None:
        source = self.members[index]
        slot.holder = None
        if self._queue is None:  # (through the map, whose pages read are let go after)
            write_parts(self.device, slot.buffer, source.groups, source.layout)
            self._file.release_pages(source.names)
        else:  # read from the file straight into the staging buffer: no mapped page faulted in
            staging = slot.staging[:source.padded]
            reads = [(name, staging[at:at + part.nbytes]) for name, (part, at) in
                     zip(source.names, part_offsets(source.groups, source.layout), strict=True)]
            region = self.device.region(slot.buffer, (source.padded,), "uint8", 0)
            self.staged_upload(reads, [(region, staging, slot.ready)], [slot.ready], slot.free)
        slot.holder = index
        self.uploads += 1
        self.uploaded_bytes += source.nbytes

    def staged_upload(self, reads: list[tuple[str, np.ndarray]], copies: list[tuple[Tensor, np.ndarray, Marker]],
                      staged: list[Marker], after: Marker) -> None:
        """Through the copy queue: the file tensors of `reads` into their (page-locked staging) arrays once the
        host waited for `staged` (the staging buffer's last upload has left it), then each (destination,
        staging bytes, done marker) of `copies` queued once `after` passed."""
        for marker in staged:
            self._queue.host_waits(marker)
        self._file.read_into(reads)
        for region, source, done in copies:
            self._queue.upload(region, source, after=after, done=done)

    def stats(self) -> dict:
        """The slots and what they uploaded, as GET /v1/placement reports them (`experts`: the expert cache's)."""
        return {"slots": self.count, "slot_bytes": max((s.nbytes for s in self.members.values()), default=0),
                "blocks": sorted(self.members), "uploads": self.uploads, "uploaded_bytes": self.uploaded_bytes,
                "slot_hits": self.hits, "passes": self.passes,
                "experts": None if self.experts is None else self.experts.stats()}

    def describe(self) -> str:
        """One line: what streamed here and what it uploaded."""
        size = max((s.nbytes for s in self.members.values()), default=0)
        each = format_bytes(self.uploaded_bytes // max(1, self.passes))
        return (f"{self.device.name}: {len(self.members)} streamed blocks through {self.count} slots of "
                f"{format_bytes(size)}: {self.uploads} uploads, {format_bytes(self.uploaded_bytes)} in "
                f"{self.passes} passes ({each} each), {self.hits} slot hits")


@dataclass
class ExpertBank:
    """A block's routed experts where they stay: per expert, its file tensors (mapped) and their names, in
    the order of the moe_experts kind's weight inputs."""

    parts: list[list[np.ndarray]]
    names: list[list[str]]

    @property
    def expert_bytes(self) -> int:
        return max(sum(p.nbytes for p in parts) for parts in self.parts)


STAGING_PER_PICK = 2
"""Staging buffers of an expert cache over a copy queue, per expert a token picks: one block's misses read
while the previous block's copies run."""


@dataclass(eq=False)
class _Staging:
    buffer: np.ndarray
    done: list[Marker]
    """The markers of its last upload's copies (one per part), waited for before it is refilled."""


class ExpertCache:
    """One device's cache of routed experts (see the module docstring): `slots` experts of one layout (the
    moe_experts `kind`'s weight inputs, each [slots * rows, ...]: slot s of input j is its rows s * rows ..),
    in one buffer charged to the device's budget; its members are the blocks that stream their experts."""

    def __init__(self, pool: SlotPool, kind: BlockKind, program: Program, slots: int, policy: str) -> None:
        self.pool, self.kind, self.program, self.count = pool, kind, program, slots
        self.members: dict[int, ExpertBank] = {}
        layout, at = [], 0
        for _, shape, dtype in weight_inputs(kind):
            layout.append((tuple(shape), dtype, at))
            at += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
        self.layout: Layout = tuple(layout)
        self._part_bytes = [int(np.prod(shape)) * np.dtype(dtype).itemsize // slots for shape, dtype, _ in layout]
        self.expert_bytes = sum(self._part_bytes)
        self.charged = slots * self.expert_bytes
        pool.device.reserve(self.charged, f"an expert cache of {slots} experts")
        self.buffer = pool.device.empty((max(at, ALIGN),), "uint8")
        self.views = pool.device.aliases(self.buffer, self.layout)
        self.slots = ExpertSlots(slots, policy)
        self.uploads = self.uploaded_bytes = self.calls = 0
        queue = pool._queue
        self._ready: list[list[Marker] | None] = [None] * slots
        """Per slot: the markers of its upload's copies not yet waited for by kernels (copy queues only)."""
        self._free = [queue.marker() for _ in range(slots)] if queue is not None else []
        """Per slot: where the kernels that last read it end (its next upload waits for it)."""
        self._staging: list[_Staging] = []
        if queue is not None:
            width = kind.config.experts_used * STAGING_PER_PICK
            self._staging = [_Staging(queue.staging(self.expert_bytes), [queue.marker() for _ in layout])
                             for _ in range(width)]
        self._next_staging = 0

    def admit(self, index: int, bank: ExpertBank, kind: BlockKind) -> None:
        """Block `index` streams its experts here (`kind`: its moe_experts kind over this cache's slots)."""
        if kind != self.kind:
            first = min(self.members)
            raise JitllmError(f"JITLLM_GPU_STREAM=1: blocks {first} and {index} on {self.pool.device.name} store "
                              f"their experts differently ({_types(self.kind)} and {_types(kind)}): one expert "
                              "cache per device serves one expert layout (not built for several)")
        self.members[index] = bank

    def run(self, index: int, x: Tensor, h: Tensor, ids: Tensor, weights: Tensor, shared: Tensor | None) -> Tensor:
        """Block `index`'s routed experts over its experts-apart outputs: y = x + their sum (+ `shared`). The
        picks come to the host; the rows run in as few groups as the cache holds each group's experts at once
        (a decode step: one)."""
        device, cfg = self.pool.device, self.kind.config
        picks = device.download(ids).reshape(-1, cfg.experts_used)
        groups = _row_groups(picks, self.count)
        if len(groups) == 1:
            return self._call(index, picks, (x, h, ids, weights, shared))
        rows = picks.shape[0]
        out = device.empty((1, rows, cfg.hidden), "float32")
        for first, end in groups:
            inputs = [None if t is None else _rows(device, t, first, end) for t in (x, h, ids, weights, shared)]
            y = self._call(index, picks[first:end], inputs)
            device.copy_from(device.region(out, (1, end - first, cfg.hidden), "float32", first * cfg.hidden * 4), y,
                             device)
        return out

    def _call(self, index: int, picks: np.ndarray, inputs) -> Tensor:
        where, misses = self.slots.place((index, int(e)) for e in np.unique(picks))
        for (block, expert), slot in misses:
            self._upload(self.members[block], expert, slot)
        slot_map = np.full(self.kind.config.experts, -1, np.int64)
        for (_, expert), slot in where.items():
            slot_map[expert] = slot
        queue = self.pool._queue
        if queue is not None:
            for slot in where.values():
                for marker in self._ready[slot] or ():
                    queue.device_waits(marker)
                self._ready[slot] = None
        x, h, ids, weights, shared = inputs
        tail = [] if shared is None else [shared]
        y = self.program.main(x, h, ids, weights, self.pool.device.upload(slot_map), *tail, *self.views)
        if queue is not None:
            for slot in where.values():
                queue.record_kernels(self._free[slot])
        self.calls += 1
        return y

    def _upload(self, bank: ExpertBank, expert: int, slot: int) -> None:
        device, parts, names = self.pool.device, bank.parts[expert], bank.names[expert]
        regions = [device.region(self.buffer, (nbytes,), "uint8", at + slot * nbytes)
                   for (_, _, at), nbytes in zip(self.layout, self._part_bytes, strict=True)]
        queue = self.pool._queue
        if queue is None:  # (through the map, whose pages read are let go after)
            for region, part in zip(regions, parts, strict=True):
                device.write(region, part.reshape(-1).view(np.uint8))
            self.pool._file.release_pages(names)
        else:
            staging = self._staging[self._next_staging]
            self._next_staging = (self._next_staging + 1) % len(self._staging)
            pieces, at = [], 0
            for part in parts:
                pieces.append(staging.buffer[at:at + part.nbytes])
                at += part.nbytes
            self.pool.staged_upload(list(zip(names, pieces, strict=True)),
                                    list(zip(regions, pieces, staging.done, strict=True)), staging.done,
                                    self._free[slot])
            self._ready[slot] = list(staging.done)
        self.uploads += 1
        self.uploaded_bytes += sum(p.nbytes for p in parts)

    def stats(self) -> dict:
        """What the cache holds and did, as GET /v1/placement reports it."""
        return {"slots": self.count, "expert_bytes": self.expert_bytes, "blocks": sorted(self.members),
                "policy": self.slots.policy, "hits": self.slots.hits, "misses": self.slots.misses,
                "uploads": self.uploads, "uploaded_bytes": self.uploaded_bytes}

    def describe(self) -> str:
        """One line: the cache and what it uploaded."""
        s = self.slots
        rate = 100.0 * s.hits / max(1, s.hits + s.misses)
        return (f"{self.pool.device.name}: {len(self.members)} blocks stream their experts through a cache of "
                f"{self.count} experts of {format_bytes(self.expert_bytes)} ({s.policy}): {s.hits} hits, "
                f"{s.misses} misses ({rate:.1f}% hits), {format_bytes(self.uploaded_bytes)} uploaded")


def _types(kind: BlockKind) -> str:
    return "/".join(spec.wtype for spec in kind.linears)


def _row_groups(picks: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """Consecutive row ranges whose picks together fit `capacity` experts (each row's alone always do)."""
    groups, first, seen = [], 0, set()
    for row, experts in enumerate(picks):
        more = seen | {int(e) for e in experts}
        if len(more) > capacity:
            groups.append((first, row))
            first, more = row, {int(e) for e in experts}
        seen = more
    groups.append((first, len(picks)))
    return groups


def _rows(device: Device, tensor: Tensor, first: int, end: int) -> Tensor:
    """Rows first..end of a [1, rows, width] tensor, copied into a tensor of their own on its device."""
    width, dtype = int(tensor.shape[-1]), str(tensor.dtype)
    shape = (1, end - first, width)
    out = device.empty(shape, dtype)
    device.copy_from(out, device.region(tensor, shape, dtype, first * width * np.dtype(dtype).itemsize), device)
    return out
