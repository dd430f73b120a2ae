"""Host-side pieces of a prefill: the token embedding lookup (threaded for long prompts) and the
last-position slice of the hidden state made on its own device."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from jitllm.core.quant import dequantize_rows, parts_from_float
from jitllm.runtime.backends.host import host_device
from jitllm.runtime.engine.embedding import VALUES_PER_THREAD, TokenEmbedding


@pytest.mark.parametrize("wtype", ["f16", "q4_1", "q8_0"])
def test_lookup_matches_one_dequantization_at_every_length(wtype):
    rng = np.random.default_rng(3)
    parts = parts_from_float(wtype, rng.standard_normal((320, 64)).astype(np.float32))  # ids repeat: fine
    table = TokenEmbedding(wtype, parts, 64, threads=4)  # split even on a machine with fewer cores
    rows_per_thread = VALUES_PER_THREAD // 64
    for n in (1, rows_per_thread - 1, 2 * rows_per_thread, 5 * rows_per_thread + 7):
        ids = rng.integers(0, 320, n).tolist()
        got = table.lookup(ids)
        assert got.dtype == np.float32 and got.shape == (n, 64)
        assert np.array_equal(got, dequantize_rows(wtype, parts, np.asarray(ids)))


def test_last_positions_copies_each_sequences_last_row():
    hidden = np.random.default_rng(4).standard_normal((3, 5, 7)).astype(np.float32)
    for batch in (1, 3):
        got = host_device().last_rows(tvm.runtime.tensor(hidden[:batch], tvm.cpu()))
        assert np.array_equal(got.numpy(), hidden[:batch, -1:])
