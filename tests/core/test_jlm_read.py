"""`JlmFile.read_into`: tensors read from the file (not the map) in pieces on several threads."""

from __future__ import annotations

import numpy as np
import pytest

from jitllm.core import jlm
from jitllm.core.errors import JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.core.jlm_writer import RegionPlan, TensorSpec, write_jlm

A = np.random.default_rng(0).integers(0, 255, (300, 64), dtype=np.uint8)
B = np.arange(1000, dtype=np.float32)


def write(path) -> JlmFile:
    specs = (TensorSpec("a", A.shape, "uint8"), TensorSpec("b", B.shape, "float32"))
    write_jlm(path, {"format": "jitllm-model"}, [RegionPlan("block.0", specs, lambda: [("a", A), ("b", B)])])
    return JlmFile(path)


def test_pieces_on_threads_read_every_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(jlm, "READ_PIECE", 1000)  # (a: 20 pieces, the last one short; b: 4)
    f = write(tmp_path / "m.jlm")
    a, b = np.zeros(A.nbytes, np.uint8), np.zeros(B.nbytes, np.uint8)
    f.read_into([("a", a), ("b", b)])
    np.testing.assert_array_equal(a.reshape(A.shape), A)
    np.testing.assert_array_equal(b.view(np.float32), B)


def test_a_wrong_size_or_a_truncated_file_is_refused(tmp_path):
    f = write(tmp_path / "m.jlm")
    with pytest.raises(ValueError, match="a: 19200 bytes, not 10"):
        f.read_into([("a", np.zeros(10, np.uint8))])
    with open(tmp_path / "m.jlm", "r+b") as w:  # (cut inside b, the region's last tensor)
        w.truncate(f.regions["block.0"].offset + f.tensors["b"].offset + 100)
    with pytest.raises(JitllmError, match="truncated while reading b"):
        f.read_into([("b", np.zeros(B.nbytes, np.uint8))])
