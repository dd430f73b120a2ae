"""Decode steps as captured graphs, one per run of consecutive units on a device (a segment).

A segment's decode step (its blocks' `main` + KV append, and the head when it ends the segment) is
captured once per session and replayed every token: no per-block host round trip. A graph bakes
buffer addresses, so the record keeps every tensor it was captured with and a signature of the
objects the step would use now (weights, page pool, page tables, device); a move, a pool growth or a
page table outgrowing its capacity changes the signature and the segment is captured again. Inputs
that change per token (hidden state, rope row, position) live in the record's own tensors and are
overwritten in place before each replay.

`ReplayRecorder` is the host's stand-in for CUDA graphs: it records the calls with their tensors and
replays them writing results back into the captured outputs, which is what fixed addresses do — so
the capture/invalidation logic is tested on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import tvm

from jitllm.runtime.devices.base import Device


class StepGraph(Protocol):
    def replay(self) -> None: ...


class GraphRecorder(Protocol):
    def capture(self, body: Callable[[Callable], object]) -> tuple[StepGraph, object]: ...


@dataclass
class Segment:
    """Consecutive units on one device: blocks (in order) and, when it ends the model there, the head."""

    device: Device
    blocks: list = field(default_factory=list)
    head: object | None = None

    @property
    def capturable(self) -> bool:
        """Llama blocks and the head only (recurrent blocks keep their state's bookkeeping per step)."""
        return all(unit.kind.kind == "llama" for unit in self.blocks)


def segments(blocks: list, head) -> list[Segment]:
    out: list[Segment] = []
    for unit in blocks:
        if not out or out[-1].device is not unit.device:
            out.append(Segment(unit.device))
        out[-1].blocks.append(unit)
    if out and out[-1].device is head.device:
        out[-1].head = head
    else:
        out.append(Segment(head.device, [], head))
    return out


@dataclass
class StepInputs:
    """A decode step's per-token inputs on one device, rewritten in place every token (no allocation)."""

    x: tvm.runtime.Tensor
    cos: tvm.runtime.Tensor
    sin: tvm.runtime.Tensor
    past: tvm.runtime.Tensor

    @classmethod
    def on(cls, device: Device, hidden: int, half: int) -> "StepInputs":
        return cls(device.empty((1, 1, hidden), "float32"), device.empty((1, 1, half), "float32"),
                   device.empty((1, 1, half), "float32"), device.empty((1,), "int32"))

    def feed(self, x, cos: np.ndarray, sin: np.ndarray, past: int) -> None:
        if isinstance(x, np.ndarray):
            self.x.copyfrom(x)
        else:
            x.copyto(self.x)
        self.cos.copyfrom(cos)
        self.sin.copyfrom(sin)
        self.past.copyfrom(np.array([past], np.int32))


@dataclass
class GraphRecord:
    signature: tuple
    graph: StepGraph | None
    inputs: StepInputs
    output: tvm.runtime.Tensor | None
    keep: list
    """Every object the graph's addresses point into (weights, pages, tables, intermediates)."""


def segment_signature(session, segment: Segment) -> tuple:
    """Identities of what a captured step of `segment` reads and writes; any change needs a new capture."""
    sig: list = [id(segment.device)]
    for unit in segment.blocks:
        table = session.tables[unit.index]
        sig += [unit.index, id(unit.device), id(unit.weights), id(table.pool.pages), id(table.tensor())]
    if segment.head is not None:
        sig += ["head", id(segment.head.device), id(segment.head.weights)]
    return tuple(sig)


def capture_segment(recorder: GraphRecorder, session, segment: Segment, inputs: tuple) -> GraphRecord:
    """Capture one decode step of `segment` for `session` over fresh input tensors holding `inputs`
    (x, cos, sin, past: a recorder may run the step while it captures it)."""
    x_in, cos_in = inputs[0], inputs[1]
    step = StepInputs.on(segment.device, x_in.shape[-1], cos_in.shape[-1])
    step.feed(*inputs)
    x, cos, sin, past = step.x, step.cos, step.sin, step.past
    keep: list = []

    def body(call: Callable) -> tvm.runtime.Tensor:
        h = x
        for unit in segment.blocks:
            table = session.tables[unit.index]
            pages, pt = table.pool.pages, table.tensor()
            program = unit.program_for(1)
            y, k, v = call(program.main, h, cos, sin, pages, pt, past, *unit.weights)
            call(program.append, pages, k, v, pt, past)
            keep.extend([unit.weights, pages, pt, y, k, v])
            h = y
        if segment.head is not None:
            h = call(segment.head.program_for(1).main, h, *segment.head.weights)
            keep.extend([segment.head.weights, h])
        return h

    signature = segment_signature(session, segment)
    graph, output = recorder.capture(body)
    return GraphRecord(signature, graph, step, output, keep)


class ReplayRecorder:
    """Host stand-in for CUDA graphs (see the module docstring)."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, body: Callable[[Callable], object]) -> tuple[StepGraph, object]:
        calls: list[tuple[Callable, tuple, object]] = []

        def call(fn: Callable, *args):
            out = fn(*args)
            calls.append((fn, args, out))
            return out

        output = body(call)
        self.captures += 1
        return _Replay(calls), output


class _Replay:
    def __init__(self, calls: list[tuple[Callable, tuple, object]]) -> None:
        self.calls = calls

    def replay(self) -> None:
        for fn, args, captured in self.calls:
            fresh = fn(*args)
            for old, new in zip(_tensors(captured), _tensors(fresh)):
                old.copyfrom(new)


def _tensors(value) -> list:
    if value is None:
        return []
    if isinstance(value, tvm.runtime.Tensor):
        return [value]
    return list(value)
