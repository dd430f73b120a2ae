"""Captured decode steps: a segment's step recorded once per session and replayed every token, captured
again when what it baked changed (step_graphs.py has the records and signatures)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.device import Device
from jitllm.runtime.engine import forward
from jitllm.runtime.engine.step_graphs import (
    GraphRecord,
    Segment,
    StepInputs,
    capture_segment,
    segment_objects,
    signature,
)
from jitllm.runtime.model_layout import HEAD


def replay_segment(ex, session, segment: Segment, x, source: Device, past: int,
                   pick: bool = False) -> Tensor | np.ndarray | int:
    """One decode step of the segment as a captured graph (captured again when what it baked changed): its
    hidden state out, or where it ends with the head the logits row (or, `pick`, the token: a graph of its
    own, ending with the head's pick)."""
    step = forward.step_inputs(ex, session, segment, x, source, past)
    key = (session.id, segment.blocks[0].index if segment.blocks else HEAD, pick and segment.head is not None)
    record = ex._graphs.get(key)
    # pages or units may have changed: check what it baked (segment_objects also uploads page-table rows
    # added since)
    if not still_valid(ex, record, lambda: segment_objects(session, segment), step):
        record = capture(ex, key, segment, step, segment_objects(session, segment),
                         lambda call: forward.run_units(ex, session, segment, step, 1, call, pick))
    record.graph.replay()
    return step.output(segment, record.output, pick)


def still_valid(ex, record: GraphRecord | None, objects: Callable[[], list], step: StepInputs) -> bool:
    """Whether `record` may replay now: checked at this epoch, or what it baked (`objects()`, looked at only
    then) is still what the step would use; then it is marked checked at this epoch."""
    if record is None:
        return False
    if record.epoch != ex._epoch and record.signature == signature(objects(), step):
        record.epoch = ex._epoch
    return record.epoch == ex._epoch


def capture(ex, key: tuple, segment: Segment, step: StepInputs, objects: list,
            run: Callable[[Callable], Tensor]) -> GraphRecord:
    """Capture `run` as the record under `key`, checked at this epoch."""
    record = ex._graphs[key] = capture_segment(segment.device.graphs, objects, step, run)
    record.epoch = ex._epoch
    if ex.log:
        what = "pipelined decode graph" if "pipelined" in key else "decode graph"
        ex.log(f"captured {what}: session {key[0]}, {len(segment.blocks)} blocks"
               f"{' + head' if segment.head is not None else ''} on {segment.device.name}")
    return record


def drop(ex, session=None, devices: tuple[str, ...] | None = None) -> None:
    """Forget captured steps (of one session, or all: after a move they would hold freed memory); where no
    session is named, the batched steps captured on `devices` too (all where None: batch_graphs.py)."""
    ex.drain()
    for key in [k for k in ex._graphs if session is None or k[0] == session.id]:
        del ex._graphs[key]
    if session is None:
        ex._batch_graphs.drop(devices)
    ex._epoch += 1
