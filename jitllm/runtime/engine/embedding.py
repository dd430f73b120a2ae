"""Token embedding lookups on the host: the embedding table stays in the model file's layout (row-
interleaved, possibly quantized), and the rows a step needs are dequantized to float32.

A long prompt's rows are split over the host's cores: numpy releases the GIL while it gathers and
converts, and one thread took ~3 ms for 512 rows of a 3072-wide f16 table on the H200 machine's host,
a tenth of that model's whole 512-token prefill on the GPU.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jitllm.core.quant import dequantize_rows

VALUES_PER_THREAD = 1 << 18
"""Less work than this per thread is not worth a thread: the threads hand the GIL to each other between
numpy calls (measured on the H200 machine: 512 rows of a 576-wide Q4_0 table in 8 threads made the
SmolLM2-shape prefill ~15% slower, while 512 rows of a 3072-wide f16 table in 6 gained)."""


class TokenEmbedding:
    def __init__(self, wtype: str, parts: dict[str, np.ndarray], hidden: int, threads: int | None = None) -> None:
        """`threads`: at most this many at once (default: the host's cores, up to 16)."""
        self.wtype, self.parts, self.hidden = wtype, parts, hidden
        self._threads = threads or min(os.cpu_count() or 1, 16)
        self._pool: ThreadPoolExecutor | None = None

    def lookup(self, ids: list[int]) -> np.ndarray:
        """float32 [len(ids), hidden]."""
        rows = np.asarray(ids)
        chunks = min(len(rows) * self.hidden // VALUES_PER_THREAD, self._threads)
        if chunks < 2:
            return dequantize_rows(self.wtype, self.parts, rows)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="jitllm-embed")
        out = np.empty((len(rows), self.hidden), np.float32)
        bounds = np.linspace(0, len(rows), chunks + 1).astype(int)

        def fill(i: int) -> None:
            out[bounds[i]:bounds[i + 1]] = dequantize_rows(self.wtype, self.parts, rows[bounds[i]:bounds[i + 1]])

        list(self._pool.map(fill, range(chunks)))
        return out
