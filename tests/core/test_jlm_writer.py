"""The .jlm writer takes a tensor whole or in runs of its leading rows, and refuses pieces that do not fit."""

from __future__ import annotations

import numpy as np
import pytest

from jitllm.core.errors import JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.core.jlm_writer import RegionPlan, TensorSpec, write_jlm

META = {"format": "jitllm-model", "note": "caf\u00e9 \"quoted\" " * 50}
A = np.arange(48, dtype=np.float32).reshape(12, 4)
B = np.arange(6, dtype=np.float16)


def plan(arrays) -> list[RegionPlan]:
    return [RegionPlan("globals", (TensorSpec("a", (12, 4), "float32"), TensorSpec("b", (6,), "float16")), arrays)]


def test_pieces_write_the_same_file_as_whole_tensors(tmp_path):
    write_jlm(tmp_path / "whole.jlm", META, plan(lambda: [("a", A), ("b", B)]))
    write_jlm(tmp_path / "pieces.jlm", META, plan(lambda: [("a", A[:5]), ("b", B[:2]), ("a", A[5:8]), ("b", B[2:]),
                                                            ("a", A[8:])]))
    assert (tmp_path / "whole.jlm").read_bytes() == (tmp_path / "pieces.jlm").read_bytes()
    f = JlmFile(tmp_path / "pieces.jlm")
    assert f.header["note"] == META["note"]
    np.testing.assert_array_equal(f.region_tensors("globals")["a"], A)


@pytest.mark.parametrize("arrays, words", [
    (lambda: [("a", A), ("a", A[:1]), ("b", B)], "tensor a came out as [1, 4]"),  # past its rows
    (lambda: [("a", A[:6, :2]), ("b", B)], "tensor a came out as [6, 2]"),  # wrong trailing shape
    (lambda: [("a", A.astype(np.float64)), ("b", B)], "float64"),
    (lambda: [("a", A[:11]), ("b", B)], "region globals lacks a"),  # incomplete
    (lambda: [("a", A), ("b", B), ("c", B)], "tensor c came out"),  # not planned
])
def test_pieces_that_do_not_fit_the_plan_write_nothing(tmp_path, arrays, words):
    with pytest.raises(JitllmError, match=words.replace("[", r"\[")):
        write_jlm(tmp_path / "m.jlm", META, plan(arrays))
    assert list(tmp_path.iterdir()) == []
