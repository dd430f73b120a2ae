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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from jitllm.core.errors import DeviceFault
from jitllm.core.jlm import JlmFile
from jitllm.runtime.backends.base import CopyQueue, Layout, Marker, Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.device_spec import format_bytes
from jitllm.runtime.engine.packed_weights import pack_layout, part_offsets, write_parts
from jitllm.runtime.planner import STREAM_SLOTS


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
            self._queue.host_waits(slot.ready)  # (the staging buffer's last upload has left it)
            staging = slot.staging[:source.padded]
            self._file.read_into((name, staging[at:at + part.nbytes]) for name, (part, at) in
                                 zip(source.names, part_offsets(source.groups, source.layout), strict=True))
            region = self.device.region(slot.buffer, (source.padded,), "uint8", 0)
            self._queue.upload(region, staging, after=slot.free, done=slot.ready)
        slot.holder = index
        self.uploads += 1
        self.uploaded_bytes += source.nbytes

    def stats(self) -> dict:
        """The slots and what they uploaded, as GET /v1/placement reports them."""
        return {"slots": self.count, "slot_bytes": max((s.nbytes for s in self.members.values()), default=0),
                "blocks": sorted(self.members), "uploads": self.uploads, "uploaded_bytes": self.uploaded_bytes,
                "slot_hits": self.hits, "passes": self.passes}

    def describe(self) -> str:
        """One line: what streamed here and what it uploaded."""
        size = max((s.nbytes for s in self.members.values()), default=0)
        each = format_bytes(self.uploaded_bytes // max(1, self.passes))
        return (f"{self.device.name}: {len(self.members)} streamed blocks through {self.count} slots of "
                f"{format_bytes(size)}: {self.uploads} uploads, {format_bytes(self.uploaded_bytes)} in "
                f"{self.passes} passes ({each} each), {self.hits} slot hits")
