"""Pipelined greedy decode: where the whole model is one captured segment whose head picks the token on its
device and gathers embedding rows there (a tied head on a GPU), each step's graph starts from the token
the step before left on the device, so step k + 1 is launched before step k's token is read: the host's
turn (its bookkeeping, the launch) overlaps the device's work instead of leaving it idle between steps."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.engine import captured, forward
from jitllm.runtime.engine.faults import device_faults
from jitllm.runtime.engine.step_graphs import Segment, StepFence, StepInputs, segment_objects
from jitllm.runtime.model_layout import HEAD


@dataclass
class PipelineSlot:
    """One of a pipelined decode's two alternating steps: its own host arrays and captured graph, so the
    host fills one while the device runs the other, and the fence of its last launch."""

    inputs: StepInputs
    fence: StepFence | None = None


@dataclass
class Pipeline:
    """A session's pipelined greedy decode on one device: the token on the device (each step's pick, [1, 1]
    int32, which the next step's graph gathers its embedding row for) and the two slots."""

    device: Device
    token: Tensor
    slots: list[PipelineSlot]


def drain(ex) -> None:
    """Wait for every pipelined step still running. Whatever reads or changes what steps use (a step of any
    session, page bookkeeping, a move, a reset) drains first: one step at a time uses a device's modules
    (the split attention's counters assume it)."""
    fences, ex._inflight = ex._inflight, []  # (a device fault raises once, not at every later drain)
    for fence in fences:
        fence.wait()


def greedy_tokens(ex, session, token: int, steps: int) -> Iterator[int]:
    """`steps` greedy decode steps, the first fed `token`: yields each step's pick, as that many calls of
    `next_token(session, [token])` would, pipelined where the model allows (the module docstring). A
    consumer that stops early leaves the session as if the step still in flight never ran (it is waited
    for and not counted: its KV position is written again by the next step fed there)."""
    ex.drain()
    pending: deque[PipelineSlot] = deque()
    launched = 0
    try:
        for k in range(steps):
            if not pending:
                slot = launch(ex, session, launched % 2, token)
                if slot is None:  # the model cannot pipeline (now): one plain step
                    token = ex.next_token(session, [token])
                    yield token
                    continue
                pending.append(slot)
                launched += 1
            if k + 1 < steps:  # the next step, from the token this one leaves on the device
                ahead = launch(ex, session, launched % 2, None)
                if ahead is not None:
                    pending.append(ahead)
                    launched += 1
            slot = pending.popleft()
            _wait(ex, slot.fence)
            session.tokens.append(token)
            token = int(slot.inputs.staging.token[0])
            yield token
    finally:
        for slot in pending:  # launched ahead, not taken
            _wait(ex, slot.fence)
            session.length -= 1


def _wait(ex, fence: StepFence) -> None:
    if fence in ex._inflight:
        ex._inflight.remove(fence)
    with device_faults(ex.head.device):
        fence.wait()


def pipelined_segment(ex) -> Segment | None:
    """The segment a pipelined step runs: the whole model on one device that captures steps, with a tied
    head that picks the token and gathers embedding rows there; else None."""
    found = forward.current_segments(ex)
    if not ex.graphs or len(found) != 1:
        return None
    segment, head = found[0], ex.head
    if (segment.device.graphs is None or not segment.capturable or segment.head is None
            or head.program.embed is None or head.program_for(1).argmax is None
            or not ex.layout.config.tied_head):
        return None
    return segment


def launch(ex, session, index: int, token: int | None) -> PipelineSlot | None:
    """Launch one pipelined step on slot `index` without waiting for it. `token`: its input, uploaded first
    (nothing is in flight then); None: the input is the pick of the step in flight, and the launch happens
    only where it needs no bookkeeping that must wait for that step (new pages, a capture or a signature
    check), else None (the caller launches it once the step is done)."""
    ahead = token is None
    past = session.length
    if ahead and (past + 1 > min(ex.ctx, session.kv_room) or ex._segments[0] != ex._epoch):
        return None
    forward.check_context(ex, past + 1)
    ex.ensure_room(session, past + 1)
    segment = pipelined_segment(ex)
    if segment is None:
        return None
    first = segment.blocks[0].index if segment.blocks else HEAD
    key = (session.id, first, "pipelined", index)
    record = ex._graphs.get(key)
    if ahead and not (record is not None and record.epoch == ex._epoch):
        return None
    cos, sin = ex.rope
    with device_faults(segment.device):
        pipeline = _pipeline(ex, session, segment.device)
        slot, other = pipeline.slots[index], pipeline.slots[1 - index]

        def baked(inputs: StepInputs) -> Callable[[], list]:
            return lambda: segment_objects(session, segment, inputs) + [pipeline.token]

        slot.inputs.feed(None, cos[past:past + 1][None], sin[past:past + 1][None], past, segment.device)
        if not ahead:  # (the input before any capture: a recorder may run the step while capturing it)
            segment.device.write(pipeline.token, np.array([[token]], np.int32))
            # (the other slot too, now that nothing is in flight: so the next step can go ahead)
            captured.still_valid(ex, ex._graphs.get((session.id, first, "pipelined", 1 - index)), baked(other.inputs),
                                 other.inputs)
            if not captured.still_valid(ex, record, baked(slot.inputs), slot.inputs):
                record = captured.capture(ex, key, segment, slot.inputs, baked(slot.inputs)(),
                                          lambda call: _units(ex, session, segment, slot.inputs, pipeline, call))
                segment.device.write(pipeline.token, np.array([[token]], np.int32))  # (a recorder may have run it)
        slot.fence = slot.fence or segment.device.graphs.fence()
        record.graph.launch()
        slot.fence.record()
    ex._inflight.append(slot.fence)
    session.length = past + 1
    return slot


def _units(ex, session, segment: Segment, step: StepInputs, pipeline: Pipeline, call: Callable) -> Tensor:
    """A pipelined step: the embedding row of the token on the device, then the segment's units, ending with
    the pick written back over that token."""
    head = ex.head
    call(head.program.embed, pipeline.token, *head.weights[1:], step.x)  # (weights[0]: the final norm's)
    return forward.run_units(ex, session, segment, step, 1, call, pick=True)


def _pipeline(ex, session, device: Device) -> Pipeline:
    """The session's pipeline state on `device` (made once)."""
    if session.pipeline is None or session.pipeline.device is not device:
        cfg = ex.layout.config
        token = device.empty((1, 1), "int32")
        pick = device.aliases(token, (((1,), "int32", 0),))[0]  # the pick lands where the next step reads
        slots = [PipelineSlot(StepInputs.on(device, cfg.hidden, cfg.head_dim // 2, cfg.vocab, pick))
                 for _ in range(2)]
        session.pipeline = Pipeline(device, token, slots)
    return session.pipeline
