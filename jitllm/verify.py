"""`jitllm verify`: run the same tokens on the host and on a device and report where the logits part.

Both sides see the same token sequence (the prompt, then the host's greedy choices). A position is
reported when the largest logit difference exceeds `tol` or the top-1 token differs. A flipped argmax
where the host's top two are closer than twice the difference is a near-tie (expected: CPU and GPU
sum floats in different orders); a difference over 10 x tol, or any other flip, is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Position:
    index: int
    max_diff: float
    host_top1: int
    device_top1: int
    host_margin: float
    verdict: str  # "ok", "near-tie" or "error"


@dataclass(frozen=True)
class VerifyReport:
    positions: list[Position]
    checked: int
    max_diff: float
    """Largest |logit difference| over every compared position (reported or not)."""

    @property
    def errors(self) -> list[Position]:
        return [p for p in self.positions if p.verdict == "error"]



def compare(host_logits: np.ndarray, dev_logits: np.ndarray, index: int, tol: float) -> Position:
    diff = float(np.abs(host_logits - dev_logits).max())
    top2 = np.argsort(-host_logits)[:2]
    margin = float(host_logits[top2[0]] - host_logits[top2[1]])
    h1, d1 = int(top2[0]), int(np.argmax(dev_logits))
    if diff > 10 * tol:
        verdict = "error"
    elif h1 != d1:
        verdict = "near-tie" if margin <= 2 * diff else "error"
    else:
        verdict = "ok"
    return Position(index, diff, h1, d1, margin, verdict)


def verify(host_model, device_model, prompt_ids: list[int], n: int, tol: float) -> VerifyReport:
    hs, ds = host_model.new_session(), device_model.new_session()
    positions: list[Position] = []
    hl = host_model.executor.forward(hs, prompt_ids)
    dl = device_model.executor.forward(ds, prompt_ids)
    checked, worst = 0, 0.0
    for step in range(n):
        checked += 1
        pos = compare(hl, dl, len(prompt_ids) + step - 1, tol)
        worst = max(worst, pos.max_diff)
        if pos.max_diff > tol or pos.host_top1 != pos.device_top1:
            positions.append(pos)
        token = pos.host_top1
        hl = host_model.executor.forward(hs, [token])
        dl = device_model.executor.forward(ds, [token])
    host_model.executor.close_session(hs)
    device_model.executor.close_session(ds)
    return VerifyReport(positions, checked, worst)
