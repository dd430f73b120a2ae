"""One step of one session over the model's segments (runs of consecutive units on one device): the
prompt's embedding rows in, each segment's units called in turn (or its captured step replayed), the
logits of the last position (or the greedy token the head picked on its device) out. The hidden state
crosses devices only at seams."""

from __future__ import annotations

from typing import Callable

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.block_type import RECURRENT
from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.engine import captured
from jitllm.runtime.engine.faults import device_faults
from jitllm.runtime.engine.recurrent import recurrent_step
from jitllm.runtime.engine.step_graphs import Segment, StepInputs, segments


def forward(ex, session, ids: list[int], pick: bool) -> np.ndarray | int:
    """`ids` appended after the session's history, through every block: the last position's logits, or
    (`pick`) the greedy token the head's program picked."""
    ex.drain()
    n, past = len(ids), session.length
    check_context(ex, past + n)
    ex.ensure_room(session, past + n)
    found = current_segments(ex)
    source = found[0].device
    x: Tensor | np.ndarray | None = device_embedding(ex, ids, source)
    if x is None:
        x = ex.embed(ids)[None]
    for segment in found:
        with device_faults(segment.device):
            if n == 1 and ex.graphs and segment.device.graphs is not None and segment.capturable:
                x = captured.replay_segment(ex, session, segment, x, source, past, pick)
            else:
                x = run_segment(ex, session, segment, x, source, past, n, pick)
        source = segment.device
    session.length = past + n
    session.tokens += ids
    if n == 1 and isinstance(x, (np.ndarray, int)):  # (what a decode step brought back through host arrays)
        return x
    out = x if isinstance(x, np.ndarray) else source.download(x)  # (ONNX Runtime's outputs are host arrays)
    return int(out[0]) if pick else out[0, -1]


def check_context(ex, positions: int) -> None:
    if positions > ex.ctx:
        raise JitllmError(f"context full: {positions} positions do not fit the context of {ex.ctx}")


def current_segments(ex) -> list[Segment]:
    """The model's segments, found again only when the epoch moved on (a move, new pages)."""
    if ex._segments[0] != ex._epoch:
        ex._segments = (ex._epoch, segments(ex.blocks, ex.head))
    return ex._segments[1]


def device_embedding(ex, ids: list[int], device: Device) -> Tensor | None:
    """A prompt's embedding rows gathered on `device` from the tied head's weights there, [1, n, hidden]
    (the host lookup gathers each row with a 16-byte stride and then uploads it: ~10% of a 3B-shape
    512-token prefill on the H200); None for single tokens (decode steps feed captured graphs from the
    host), untied heads, a head elsewhere or without the gather (the CPU), ids out of range."""
    head, n = ex.head, len(ids)
    embed = head.program.embed
    if n < 2 or embed is None or head.device is not device or not ex.layout.config.tied_head:
        return None
    rows = np.asarray(ids, np.int32)[None]
    if rows.min() < 0 or rows.max() >= ex.layout.config.vocab:
        return None
    with device_faults(device):
        x = device.empty((1, n, ex.layout.config.hidden), "float32")
        embed(device.upload(rows), *head.weights[1:], x)  # (weights[0]: the final norm's)
    return x


def run_segment(ex, session, segment: Segment, x, source: Device, past: int, n: int, pick: bool = False):
    """Call each unit of the segment in turn (prefill, and devices without captured graphs); `x` comes
    from the host (an array) or from `source`."""
    dev = segment.device
    if n == 1:
        step = step_inputs(ex, session, segment, x, source, past)
        return step.output(segment, run_units(ex, session, segment, step, 1, pick=pick), pick)
    h = dev.upload(x) if isinstance(x, np.ndarray) else dev.receive(x, source)
    cos, sin = ex.rope
    step = StepInputs(h, dev.upload(cos[past:past + n][None]), dev.upload(sin[past:past + n][None]),
                      dev.upload(np.array([past], np.int32)))
    return run_units(ex, session, segment, step, n, pick=pick)


def run_units(ex, session, segment: Segment, step: StepInputs, n: int,
              call: Callable = lambda fn, *args: fn(*args), pick: bool = False):
    """The segment's units over `step`'s inputs, their functions launched through `call` (directly, or
    recorded into a graph). A decode step's inputs come from, and its logits (or, `pick`, the token the
    head's program picked) go to, host arrays (StepInputs.staging) by transfers launched through `call`
    too."""
    if step.staging is not None:
        call(step.upload)
    h = step.x
    for unit in segment.blocks:
        if unit.state == RECURRENT:
            h = recurrent_step(session, unit, h, n)
            continue
        table = session.tables[unit.index]
        pages, pt = table.pool.pages, table.tensor()
        program = unit.program_for(n)
        h, k, v = unit.outputs(call(program.main, h, step.cos, step.sin, pages, pt, step.past, *unit.call_weights()))
        if program.append is not None:  # (a GPU decode variant's main appends itself)
            call(program.append, pages, k, v, pt, step.past)
        unit.launched()
    if segment.head is None:
        return h
    if n > 1:
        h = segment.device.last_rows(h)
    head = segment.head.program_for(1)
    logits = call(head.main, h, *segment.head.weights)
    if pick:
        token = step.token if step.staging is not None else segment.device.empty((1,), "int32")
        call(head.argmax, logits, token)
        if step.staging is not None:
            call(step.download_token, token)
        return token
    if step.staging is not None:
        call(step.download, logits)
    return logits


def step_inputs(ex, session, segment: Segment, x, source: Device, past: int) -> StepInputs:
    """The session's decode inputs on the segment's device (made once), holding this token's values."""
    device = segment.device
    step = session.step_inputs.get(device.name)
    if step is None or (segment.head is not None and step.staging.logits is None):
        cfg = ex.layout.config
        if step is not None:  # a step captured over the inputs this replaces (another segment here) must not replay
            ex._epoch += 1
        vocab = cfg.vocab if ex.head.device is device else None
        step = session.step_inputs[device.name] = StepInputs.on(device, cfg.hidden, cfg.head_dim // 2, vocab)
    cos, sin = ex.rope
    step.feed(x, cos[past:past + 1][None], sin[past:past + 1][None], past, device, source)
    return step
