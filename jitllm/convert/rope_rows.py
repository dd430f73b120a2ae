"""Rows of the q and k projections in the order jitllm's RoPE rotates them: interleaved pairs
(x[2i], x[2i+1]) per head, the order llama.cpp's converter gives llama GGUFs. Hugging Face checkpoints
and GGUFs of archs llama.cpp rotates NeoX-style (halves: x[i], x[i + D/2]; e.g. qwen3) keep the halves'
order, so their q/k rows (and Qwen3's per-head q/k norm weights) are permuted when converted."""

from __future__ import annotations

import numpy as np


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Half-split RoPE rows -> interleaved rows (llama.cpp convert_hf_to_gguf's permute), per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def interleaved_order(rows: int, n_head: int) -> np.ndarray:
    """The source row each row of the permuted matrix comes from (permute_rows as an index)."""
    return permute_rows(np.arange(rows), n_head)
