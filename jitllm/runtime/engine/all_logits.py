"""Every position's logits of a prompt (perplexity needs them; a generation step needs only the last row's):
the prompt through the blocks as a prefill step does it, then the head's general program over all n rows
of the hidden state instead of the last one."""

from __future__ import annotations

import dataclasses

import numpy as np

from jitllm.runtime.engine import forward
from jitllm.runtime.engine.faults import device_faults


def prompt_logits(ex, session, ids: list[int]) -> np.ndarray:
    """`ids` appended after the session's history, through every block and the head: the logits of each
    of them, [len(ids), vocab] float32 (row i predicts the token after ids[i])."""
    if len(ids) < 2:  # (one position: a decode step's last row is all of it)
        return forward.forward(ex, session, ids, pick=False)[None]
    ex.drain()
    n, past = len(ids), session.length
    forward.check_context(ex, past + n)
    ex.ensure_room(session, past + n)
    found = forward.current_segments(ex)
    source = found[0].device
    x = forward.device_embedding(ex, ids, source)
    if x is None:
        x = ex.embed(ids)[None]
    for segment in found:
        with device_faults(segment.device):  # (the head left out: run_units would keep the last row only)
            x = forward.run_segment(ex, session, dataclasses.replace(segment, head=None), x, source, past, n)
        source = segment.device
    head = ex.head
    with device_faults(head.device):
        logits = head.program.main(x, *head.weights)
        out = head.device.download(logits)
    session.length = past + n
    session.tokens += ids
    return out[0]
