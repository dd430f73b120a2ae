"""Where a wgpu device's time goes, dispatch by dispatch (bench/vulkan_decode.py -profile): a timer set as
the backend's `timer` takes over the encoding of every dispatch until it is removed, so only a profiled
run pays for it.

- "timestamps": each dispatch in a compute pass of its own whose beginning and end write timestamps (the
  WebGPU "timestamp-query" feature; wgpu_adapters asks for it where the adapter has it): the device's time
  of the kernel alone. (wgpu 0.32 also offers "timestamp-query-inside-passes", not used: a pass per
  dispatch needs only the portable feature.)
- "submit": each dispatch submitted alone and waited for, timed on the host: the kernel's time plus a
  submit's and a map's (for adapters without timestamps).
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from jitllm.core.errors import JitllmError

QUERIES = 4096
"""Timestamps one query set holds (wgpu's maximum): two a dispatch."""


class TimestampTimer:
    """Each dispatch between two timestamps of its own compute pass; `entries` resolves them."""

    feature = "timestamp-query"

    def __init__(self, backend) -> None:
        self.backend = backend
        self._sets: list = []
        self._labels: list[tuple[str, tuple[int, int, int]]] = []

    def encode(self, dispatches: list) -> None:
        backend = self.backend
        backend._end_pass()
        encoder = backend._encoding()
        for d in dispatches:
            index = len(self._labels) % (QUERIES // 2)
            if index == 0:
                self._sets.append(backend.device.create_query_set(type="timestamp", count=QUERIES))
            compute = encoder.begin_compute_pass(timestamp_writes={
                "query_set": self._sets[-1], "beginning_of_pass_write_index": 2 * index,
                "end_of_pass_write_index": 2 * index + 1})
            compute.set_pipeline(d.pipeline)
            compute.set_bind_group(0, d.bind_group)
            compute.dispatch_workgroups(*d.groups)
            compute.end()
            self._labels.append((d.kernel, tuple(d.groups)))

    def entries(self) -> list[tuple[str, tuple[int, int, int], float]]:
        """(kernel, workgroups, device seconds) of every dispatch encoded so far, in order (waits for them)."""
        from wgpu.backends.wgpu_native._ffi import lib

        backend, wgpu = self.backend, self.backend.wgpu
        backend.synchronize()
        period = float(lib.wgpuQueueGetTimestampPeriod(backend.device.queue._internal))  # (ns a tick)
        ticks = []
        for i, query_set in enumerate(self._sets):
            count = min(QUERIES, 2 * len(self._labels) - i * QUERIES)
            resolved = backend.device.create_buffer(size=8 * count,
                                                    usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
            encoder = backend._encoding()
            encoder.resolve_query_set(query_set, 0, count, resolved, 0)
            ticks.append(np.frombuffer(backend._read(resolved, 0, 8 * count), np.uint64).astype(np.float64))
            resolved.destroy()
        stamps = np.concatenate(ticks) if ticks else np.zeros(0)
        seconds = (stamps[1::2] - stamps[0::2]) * period * 1e-9
        return [(kernel, groups, float(s)) for (kernel, groups), s in zip(self._labels, seconds)]


class SubmitTimer:
    """Each dispatch in an encoder of its own, submitted and waited for: host seconds, submit and map
    included (the work before it is waited for first)."""

    feature = None

    def __init__(self, backend) -> None:
        self.backend = backend
        self._entries: list[tuple[str, tuple[int, int, int], float]] = []

    def encode(self, dispatches: list) -> None:
        backend = self.backend
        backend.synchronize()
        for d in dispatches:
            start = time.perf_counter()
            compute = backend._encoding().begin_compute_pass()
            compute.set_pipeline(d.pipeline)
            compute.set_bind_group(0, d.bind_group)
            compute.dispatch_workgroups(*d.groups)
            compute.end()
            backend.synchronize()
            self._entries.append((d.kernel, tuple(d.groups), time.perf_counter() - start))

    def entries(self) -> list[tuple[str, tuple[int, int, int], float]]:
        return list(self._entries)


TIMERS = {"timestamps": TimestampTimer, "submit": SubmitTimer}
"""-profile's modes (the module docstring)."""


def timer(mode: str, backend):
    """A timer of `mode` for `backend`, or one clear error where its adapter lacks what the mode needs."""
    kind = TIMERS.get(mode)
    if kind is None:
        raise JitllmError(f"unknown profile mode {mode!r} (one of {', '.join(TIMERS)})")
    if kind.feature is not None and kind.feature not in backend.device.features:
        raise JitllmError(f"{backend.device_name}: the adapter lacks {kind.feature}, so dispatches cannot be timed "
                          f"on the device; -profile submit times each alone (its submit and wait included)")
    return kind(backend)


def table(entries: list[tuple[str, tuple[int, int, int], float]], steps: int) -> list[tuple[str, float, float, float]]:
    """(kernel and its workgroups, dispatches a step, microseconds a step, share of the total), most time first."""
    count: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for kernel, (x, y, z), seconds in entries:
        label = f"{kernel} [{x}x{y}x{z}]"
        count[label] += 1
        total[label] += seconds
    whole = sum(total.values()) or 1.0
    rows = [(label, count[label] / steps, total[label] / steps * 1e6, total[label] / whole) for label in total]
    return sorted(rows, key=lambda row: -row[2])
