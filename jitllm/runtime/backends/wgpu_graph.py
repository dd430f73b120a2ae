"""Captured decode steps on wgpu (the engine's GraphRecorder, step_graphs.py): WebGPU has no reusable
command buffers, so a captured step is the flat list of what the step does to the queue, in order: its
host arrays written into its input tensors, its dispatches (every block's and the head's, recorded once
by wgpu_plan and now one list: replaying it is one tight encoding loop, with no Python per block or call),
buffer copies, and its outputs copied into mappable buffers kept per host array. A launch encodes and
submits all of it and returns; the fence of the launch maps those buffers into the arrays (the wait).
So a pipelined greedy decode (engine/pipelined.py) encodes step k + 1 while the device runs step k.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

_WRITE, _ENCODE, _COPY, _READ = range(4)


class WgpuStep:
    """A captured step (StepGraph): `launch` submits it, `replay` submits it and waits for its outputs."""

    def __init__(self, backend, ops: list[tuple]) -> None:
        self.backend, self.ops = backend, ops

    def launch(self) -> None:
        backend = self.backend
        for op, a, b in self.ops:
            if op == _WRITE:
                backend.write(a, b)
            elif op == _ENCODE:
                backend.encode(a)
            elif op == _COPY:
                backend.copy(a, b)
            else:
                backend.read_later(a, b)
        backend.flush()

    def replay(self) -> None:
        self.launch()
        self.backend.finish_reads(self.backend.take_reads())


class WgpuFence:
    """`record`: the reads launched since the last record are this fence's (and the work is submitted);
    `wait`: map them into their arrays (after the device ran everything before them)."""

    def __init__(self, backend) -> None:
        self.backend, self.reads = backend, []

    def record(self) -> None:
        self.backend.flush()
        self.reads = self.backend.take_reads()

    def wait(self) -> None:
        reads, self.reads = self.reads, []
        self.backend.finish_reads(reads)


class WgpuRecorder:
    """The GraphRecorder of one wgpu device (Transfers too: plain numpy host arrays)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._ops: list[tuple] | None = None
        self.captures = 0

    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype)

    def copy_in(self, tensor, array: np.ndarray) -> None:
        """Host array -> tensor: a write of the array as it is at each launch while capturing, else now."""
        if self._ops is None:
            self.backend.write(tensor, array)
        else:
            self._ops.append((_WRITE, tensor, array))

    def copy_out(self, array: np.ndarray, tensor) -> None:
        """Tensor -> host array: filled by the launch's fence (or `replay`) while capturing, else now."""
        if self._ops is None:
            array[...] = self.backend.download(tensor)
        else:
            self._ops.append((_READ, array, tensor))

    def fence(self) -> WgpuFence:
        return WgpuFence(self.backend)

    def capture(self, body: Callable[[Callable], object]) -> tuple[WgpuStep, object]:
        """Record `body(call)`: its calls record their dispatches (wgpu_plan) into the step instead of
        encoding them; nothing runs until the step is launched."""
        ops = self._ops = []
        self.backend.capturing = lambda op, a, b=None: ops.append((op, a, b))
        try:
            outputs = body(lambda fn, *args: fn(*args))
        finally:
            self._ops = None
            self.backend.capturing = None
        self.captures += 1
        return WgpuStep(self.backend, _merged(ops)), outputs


def _merged(ops: list[tuple]) -> list[tuple]:
    """The writes first where no dispatch before them binds what they write (a write submits the work
    encoded before it, as the queue would run the write first), then consecutive dispatch lists as one
    list: a pipelined step's embedding gather comes before its inputs are written."""
    bound: set = set()
    writes, rest = [], []
    hoisting = True  # (while only dispatches not binding the written buffers came before)
    for op in ops:
        if op[0] == _ENCODE:
            bound.update(*(d.buffers for d in op[1]))
        hoisting = hoisting and op[0] in (_ENCODE, _WRITE) and (op[0] == _ENCODE or op[1].buffer.uid not in bound)
        (writes if hoisting and op[0] == _WRITE else rest).append(op)
    out: list[tuple] = []
    for op in writes + rest:
        if op[0] == _ENCODE and out and out[-1][0] == _ENCODE:
            out[-1] = (_ENCODE, out[-1][1] + op[1], None)
        else:
            out.append(op)
    return out


ENCODE, COPY = _ENCODE, _COPY
"""The ops the backend hands a capture (`WgpuBackend.capturing`)."""
