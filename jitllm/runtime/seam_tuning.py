"""-tune-seam: time runs of tokens with different numbers of blocks on the device, then keep the fastest.

More device blocks is not always faster (an integrated GPU shares the CPU's memory bus; a slow card can
lose to the host). The tuner tries seams while generation goes on — the trial tokens are real output —
moving blocks with the normal migration path, and settles on the seam with the best tokens/s.
Pinned blocks are never part of a trial.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SeamTuner:
    device: str
    blocks: list[int]
    """The device's movable blocks in order; a seam k keeps blocks[:k] on the device."""
    tokens_per_trial: int = 4
    results: dict[int, float] = field(default_factory=dict)
    _pending: list[int] = field(default_factory=list)
    _current: int | None = None
    _count: int = 0
    _started: float = 0.0
    done: bool = False

    def __post_init__(self) -> None:
        n = len(self.blocks)
        self._pending = sorted({n, (3 * n) // 4, n // 2, n // 4, 0}, reverse=True)

    def after_token(self, model) -> list:
        """Advance the trials by one generated token; returns the moves made (MoveReports)."""
        if self.done:
            return []
        reports = []
        if self._current is not None:
            self._count += 1
            if self._count < self.tokens_per_trial:
                return []
            self.results[self._current] = self._count / (time.perf_counter() - self._started)
        if self._pending:
            self._current = self._pending.pop(0)
        else:
            self._current = max(self.results, key=self.results.get)
            self.done = True
            model._log("tune-seam: " + ", ".join(f"{k} blocks on {self.device}: {v:.1f} tok/s"
                                                 for k, v in sorted(self.results.items(), reverse=True))
                       + f"; keeping {self._current}")
        reports += self._apply(model, self._current)
        self._count, self._started = 0, time.perf_counter()
        return reports

    def _apply(self, model, k: int) -> list:
        from jitllm.runtime.engine.migration import move_units

        spec = ",".join([f"{i}={self.device}" for i in self.blocks[:k]] + [f"{i}=host" for i in self.blocks[k:]])
        return move_units(model, spec) if spec else []
