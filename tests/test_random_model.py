"""Random-weight models (jitllm/random_model.py) in every weight type, and the shapes a type cannot hold."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from jitllm.core.errors import JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.core.layouts import WEIGHT_TYPES, weight_parts
from jitllm.core.quant import dequantize
from jitllm.random_model import PRESETS, preset_layout, write_random_model

WIDE = replace(PRESETS["tiny"], num_blocks=1, hidden=256, head_dim=64, ffn=256)
"""tiny with inputs in multiples of 256 (K-quants)."""


@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
def test_every_weight_type_is_written_as_its_layout(tmp_path, wtype):
    write_random_model(tmp_path / "m.jlm", WIDE, wtype)
    f = JlmFile(tmp_path / "m.jlm")
    assert f.header["weights"]["token_embd"] == wtype
    assert set(f.header["weights"]["blocks"][0].values()) == {wtype}
    n, k = WIDE.ffn, WIDE.hidden
    specs = weight_parts(wtype, n, k)
    parts = {name: f.tensor(f"blk.0.ffn_up.{name}") for name, _, _ in specs}
    assert all(parts[name].shape == shape and parts[name].dtype == dtype for name, shape, dtype in specs)
    w = dequantize(wtype, parts)
    assert np.isfinite(w).all() and 0.8 < w.std() * np.sqrt(k) < 1.2  # N(0, 1/fan_in), quantized


def test_a_type_the_shape_cannot_hold_is_one_line(tmp_path):
    with pytest.raises(JitllmError, match=r"^tiny: token_embd: 64 inputs is not a multiple of 256 \(q6_k\)$"):
        write_random_model(tmp_path / "m.jlm", "tiny", "q6_k")
    with pytest.raises(JitllmError, match=r"^tiny: token_embd: 64 inputs is not a multiple of 256 \(q5_k\)$"):
        preset_layout("tiny", "q5_k")
    with pytest.raises(JitllmError, match=r"^unknown weight type 'q3_k' \(known: f32, "):
        write_random_model(tmp_path / "m.jlm", "tiny", "q3_k")
    assert not (tmp_path / "m.jlm").exists()
