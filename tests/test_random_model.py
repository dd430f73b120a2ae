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


@pytest.mark.parametrize("preset", ["tiny-qwen3moe", "tiny-mixtral"])
def test_moe_presets_write_each_expert_as_a_page_and_route_tokens(tmp_path, preset, cache_dir):
    """The MoE shapes (the GPU tests' models): each expert one aligned page of its block's tensors, q/k norms
    where the shape has them, a random router (not a norm's near-1 values); the llvm exact kernels run it."""
    from jitllm.core.jlm import ALIGN
    from jitllm.model import load

    cfg = PRESETS[preset]
    write_random_model(tmp_path / "m.jlm", preset, "q4_0", seed=1)
    f = JlmFile(tmp_path / "m.jlm")
    for i in range(cfg.num_blocks):
        region = f.regions[f"block.{i}"]
        assert [p.name for p in region.pages] == [f"expert.{e}" for e in range(cfg.experts)]
        for e, page in enumerate(region.pages):
            inside = sorted(n for n, t in f.tensors.items()
                            if t.region == region.name and page.offset <= t.offset < page.offset + page.size)
            assert page.offset % ALIGN == 0
            assert inside == sorted(f"blk.{i}.{p}_exps.{e}.{q}" for p in ("ffn_gate", "ffn_up", "ffn_down")
                                    for q in ("qs", "d"))
    assert ("blk.0.attn_q_norm" in f.tensors) == cfg.qk_norm
    router = f.tensor("blk.0.ffn_gate_inp")
    assert router.shape == (cfg.experts, cfg.hidden) and 0.8 < router.std() * np.sqrt(cfg.hidden) < 1.2
    model = load(tmp_path / "m.jlm", devices="cpu", cpu_kernels="exact", cache_dir=cache_dir)
    session = model.new_session()
    assert np.isfinite(model.executor.forward(session, list(range(4, 20)))).all()
