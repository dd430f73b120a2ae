"""Decode steps as captured graphs, one per run of consecutive units on a device (a segment).

A segment's decode step (its blocks' `main` + KV append, and the head when it ends the segment) is
captured once per session and replayed every token: no per-block host round trip. A graph bakes
buffer addresses, so the record keeps every tensor it was captured with and a signature of the
objects the step would use now (weights, page pool, page tables, device); a move, a pool growth or a
page table outgrowing its capacity changes the signature and the segment is captured again. Inputs
that change per token (hidden state, rope row, position) live in the session's per-device
`StepInputs`: the host writes them into host arrays, and the step itself (eager or replayed) begins
by copying them to the device (the rope row and the position are views of one buffer: one copy) and, where it ends with the head, ends by copying the logits back (or,
for a greedy step where the head's program picks the token on the device, the token alone). On
CUDA those arrays are pinned and both copies are nodes of the captured graph, so a decode step is
one graph launch and one wait: no other call into the driver per token.

The host's stand-in for CUDA graphs, ReplayRecorder, lives with the simulated devices
(backends/fake.py), so the capture/invalidation logic is tested on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from jitllm.ir.block_type import KV_PAGES
from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.engine.packed_weights import pack_layout


class StepGraph(Protocol):
    def replay(self) -> None: ...
    def launch(self) -> None: ...


class StepFence(Protocol):
    """Marks the work queued on a recorder's stream (`record`) and waits until it ran (`wait`)."""

    def record(self) -> None: ...
    def wait(self) -> None: ...


class Transfers(Protocol):
    """How a device's decode inputs and logits cross between host arrays and device tensors."""

    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray: ...
    def copy_in(self, tensor: Tensor, array: np.ndarray) -> None: ...
    def copy_out(self, array: np.ndarray, tensor: Tensor) -> None: ...


class PlainTransfers:
    """Ordinary host arrays and the device's synchronous copies (devices without captured graphs)."""

    def __init__(self, device: Device) -> None:
        self.device = device

    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype)

    def copy_in(self, tensor: Tensor, array: np.ndarray) -> None:
        self.device.write(tensor, array)

    def copy_out(self, array: np.ndarray, tensor: Tensor) -> None:
        array[...] = self.device.download(tensor)


class GraphRecorder(Transfers, Protocol):
    def capture(self, body: Callable[[Callable], object]) -> tuple[StepGraph, object]: ...
    def fence(self) -> StepFence: ...


@dataclass
class Segment:
    """Consecutive units on one device: blocks (in order) and, when it ends the model there, the head."""

    device: Device
    blocks: list = field(default_factory=list)
    head: object | None = None

    @property
    def capturable(self) -> bool:
        """Blocks with KV pages and the head only (recurrent blocks keep their state's bookkeeping per step),
        none streamed (a graph would bake the slot contents of one token's upload order: streaming.py), none
        streaming its experts (the host reads each step's picks between its two programs)."""
        return all(unit.state == KV_PAGES and unit.stream is None and unit.experts is None for unit in self.blocks)


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
    """A step's inputs on one device. Decode steps keep theirs per session (`on`): device tensors
    rewritten in place every token from `staging` (no allocation, fixed addresses)."""

    x: Tensor
    cos: Tensor
    sin: Tensor
    past: Tensor
    staging: "HostStaging | None" = None
    token: Tensor | None = None
    """Where the step ends with the head: the greedy pick's [1] int32 on the device."""
    rope: Tensor | None = None
    """The bytes `cos`, `sin` and `past` are views of (decode steps: one copy a token writes them all)."""

    @classmethod
    def on(cls, device: Device, hidden: int, half: int, vocab: int | None,
           token: Tensor | None = None) -> "StepInputs":
        """Decode inputs on `device`; `vocab` where the step ends with the head there (its logits come back
        through a host array too, and the pick lands in `token`, a new [1] int32 unless given)."""
        transfers = device.graphs if device.graphs is not None else PlainTransfers(device)
        layout, nbytes = rope_layout(half)
        rope = device.empty((nbytes,), "uint8")
        x = device.empty((1, 1, hidden), "float32")
        if vocab and token is None:
            token = device.empty((1,), "int32")
        return cls(x, *device.aliases(rope, layout), staging=HostStaging(transfers, x, layout, nbytes, vocab),
                   token=token if vocab else None, rope=rope)

    def feed(self, x, cos: np.ndarray, sin: np.ndarray, past: int, device: Device,
             source: Device | None = None) -> None:
        """This token's values into the host arrays; a hidden state already on a device (`source`: from the
        segment before) is copied into `x` (on `device`) directly, and None leaves `x` to the step (a
        pipelined greedy step gathers it on the device: Executor.greedy_tokens)."""
        host = self.staging
        host.x_staged = isinstance(x, np.ndarray)
        if host.x_staged:
            host.x[...] = x
        elif x is not None:  # a copy with page-locked host memory on either side runs asynchronously: wait for it
            device.copy_from(self.x, x, source)
            source.synchronize()
            device.synchronize()
        host.cos[...], host.sin[...], host.past[0] = cos, sin, past

    def upload(self) -> None:
        """The host arrays into the device tensors (the first thing a decode step does)."""
        host = self.staging
        if host.x_staged:
            host.transfers.copy_in(self.x, host.x)
        host.transfers.copy_in(self.rope, host.rope)

    def output(self, segment: Segment, out: Tensor, pick: bool) -> Tensor | np.ndarray | int:
        """What a decode step of `segment` hands on: its hidden state (`out`, on the device), or where it
        ends with the head, the token it picked (`pick`) or the logits row it downloaded (a copy: the
        array is rewritten next step)."""
        if segment.head is None:
            return out
        return int(self.staging.token[0]) if pick else self.staging.logits[0, -1].copy()

    def download(self, logits: Tensor) -> None:
        """The head's logits into the host array (the last thing a decode step ending with the head does)."""
        self.staging.transfers.copy_out(self.staging.logits, logits)

    def download_token(self, token: Tensor) -> None:
        """The greedy pick into the host array (instead of the logits, where the device picked it)."""
        self.staging.transfers.copy_out(self.staging.token, token)


def rope_layout(half: int) -> tuple[tuple, int]:
    """Where a decode step's cos [1, 1, half], sin (float32) and past [1] (int32) lie in their one buffer
    (each aligned, as kernels' bindings need), and its bytes."""
    return pack_layout([[np.zeros((1, 1, half), np.float32)], [np.zeros((1, 1, half), np.float32)],
                        [np.zeros((1,), np.int32)]])


class HostStaging:
    """Host arrays of a device's decode inputs (and logits), from the device's transfers: pinned memory
    on CUDA, so the copies can be nodes of a captured graph. cos, sin and past are views of one array
    laid out as their device tensors are (`rope`)."""

    def __init__(self, transfers: Transfers, x: Tensor, layout: tuple, nbytes: int, vocab: int | None) -> None:
        self.transfers = transfers
        self.x = transfers.host_array(x.shape, x.dtype)
        self.rope = transfers.host_array((nbytes,), "uint8")
        self.cos, self.sin, self.past = (
            self.rope[at:at + int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
            for shape, dtype, at in layout)
        self.logits = transfers.host_array((1, 1, vocab), "float32") if vocab else None
        self.token = transfers.host_array((1,), "int32") if vocab else None
        self.x_staged = True
        """Whether this step's hidden state came from the host (then `upload` copies it), not a device."""


@dataclass
class GraphRecord:
    signature: tuple
    graph: StepGraph
    output: Tensor
    keep: list
    """Every object the graph's addresses point into (what the signature names, the calls' arguments and
    results), so no id in the signature can be reused while the record lives."""
    epoch: int = -1
    """The executor's epoch when the signature was last found to match (Executor._epoch)."""


def segment_objects(session, segment: Segment, step: StepInputs | None = None) -> list:
    """What a captured decode step of `segment` bakes in: the session's input tensors on the device (`step`,
    else its decode inputs there) and, per unit, its device, weights, page pool and page-table tensor.
    Their ids are the record's signature: any change (a move, a pool growth, a table outgrowing its
    room) needs a new capture."""
    objects: list = [segment.device, step or session.step_inputs[segment.device.name]]
    for unit in segment.blocks:
        table = session.tables[unit.index]
        objects += [unit.device, unit.weights, table.pool.pages, table.tensor()]
    if segment.head is not None:
        objects += [segment.head.device, segment.head.weights]
    return objects


def signature(objects: list, step: StepInputs) -> tuple:
    """What a captured step must match to be replayed: the ids of what it baked in, and whether it
    begins by uploading the hidden state (the first segment) or takes it from a device."""
    return tuple(map(id, objects)) + (step.staging.x_staged,)


def capture_segment(recorder: GraphRecorder, objects: list, step: StepInputs,
                    run: Callable[[Callable], Tensor]) -> GraphRecord:
    """Capture `run(call)`, one decode step launching its functions through `call(fn, *args)` (a recorder
    may also run it while capturing, so its inputs must already hold this token's values)."""
    keep = list(objects)

    def body(call: Callable) -> Tensor:
        def keeping(fn: Callable, *args):
            out = call(fn, *args)
            keep.extend(args)
            keep.append(out)
            return out

        return run(keeping)

    graph, output = recorder.capture(body)
    return GraphRecord(signature(objects, step), graph, output, keep)
