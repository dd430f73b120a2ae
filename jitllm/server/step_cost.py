"""What a batched step costs, learnt while serving: a running least-squares fit of each step's seconds against
its rows (seconds = fixed + per_row * rows; on the CPU the fixed part is reading every block's weights once,
the per-row part the rows' arithmetic). The engine uses it to size the prompt chunks that ride beside decoding
slots, so that a step carrying a prompt takes at most `stretch` times a decode-only step: a decoding stream's
inter-token latency then never jumps by a whole prompt's prefill (chunked prefill as Sarathi-Serve and vLLM
bound it, with the bound in time rather than in tokens)."""

from __future__ import annotations

DECAY = 0.99
"""Weight kept by the past at each new step (the fit follows a machine whose load changes)."""


class StepCost:
    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        self._n = DECAY * self._n + 1.0
        self._x = DECAY * self._x + rows
        self._y = DECAY * self._y + seconds
        self._xx = DECAY * self._xx + rows * rows
        self._xy = DECAY * self._xy + rows * seconds

    def fixed_rows(self) -> float:
        """The fixed part of a step in rows' worth (fixed / per_row): 0 until steps of different sizes have
        been seen, or where the fit says the fixed part is nil or the rows cost nothing (0 is the cautious
        answer: it gives the smallest prompt chunks)."""
        if self._n < 2:
            return 0.0
        spread = self._n * self._xx - self._x * self._x
        if spread <= 1e-9 * max(self._n * self._xx, 1.0):
            return 0.0
        per_row = (self._n * self._xy - self._x * self._y) / spread
        fixed = (self._y - per_row * self._x) / self._n
        return fixed / per_row if per_row > 0 and fixed > 0 else 0.0

    def prompt_room(self, decoding: int, stretch: float, page: int) -> int:
        """Prompt tokens that may join `decoding` decode rows while the step stays within `stretch` times a
        decode-only step: (stretch - 1) * (fixed_rows + decoding), cut down to whole pages (a prompt split
        at a page boundary gives the same KV as one fed whole) and at least one page, so prompts progress."""
        room = int((stretch - 1.0) * (self.fixed_rows() + decoding))
        return max(page, room - room % page)
