"""The gated linear-attention block kind: TVM (llvm) vs ONNX Runtime on the same graph vs numpy, and the
recurrent state carried from step to step (prefill then decode equals one pass)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from reference import gla_block_forward, random_weights

from jitllm.ir.blocks import activation_inputs, build_block_graph, weight_inputs
from jitllm.ir.config import ModelConfig
from jitllm.ir.gla import GLA_LINEARS, gla_block_kind, state_shape
from jitllm.lowering.cache import get_artifact
from jitllm.lowering.targets.llvm import LlvmTarget
from jitllm.runtime.backends.tvm_tensors import load_program

CFG = ModelConfig("llama", 2, 64, 4, 2, 16, 128, 256, 512, 10000.0, 1e-5)
SHAPES = [(1, 1), (2, 5), (3, 40)]  # (batch, tokens); the last runs the kernel's parallel path
TOL = 2e-5


def _program(kind, cache_dir):
    return load_program(get_artifact(kind, LlvmTarget(), cache_dir).path, tvm.cpu(), False)


def _call(program, kind, feeds, state: tvm.runtime.Tensor):
    names = [n for n, _, _ in activation_inputs(kind) + weight_inputs(kind)]
    args = [state if n == "state" else tvm.runtime.tensor(feeds[n]) for n in names]
    y, state_out = program.main(*args)
    return y.numpy(), state_out.numpy()


@pytest.mark.parametrize("wtype", ["q4_1", "f16"])
def test_gla_block_tvm_onnxruntime_numpy(wtype, cache_dir):
    kind = gla_block_kind(CFG, {n: wtype for n in GLA_LINEARS})
    rng = np.random.default_rng(5)
    weights = random_weights(kind, rng)
    session = ort.InferenceSession(build_block_graph(kind).SerializeToString())
    program = _program(kind, cache_dir)
    for batch, seq in SHAPES:
        x = rng.standard_normal((batch, seq, CFG.hidden)).astype(np.float32)
        state0 = (0.3 * rng.standard_normal(state_shape(CFG, batch))).astype(np.float32)
        feeds = {"x": x, "state": state0, **weights}
        ref_y, ref_state = gla_block_forward(kind, weights, x, state0)
        ort_y, ort_state = session.run(None, feeds)
        state = tvm.runtime.tensor(state0)
        tvm_y, tvm_state = _call(program, kind, feeds, state)
        for name, got, ref in [("ort y", ort_y, ref_y), ("ort state", ort_state, ref_state),
                               ("tvm y", tvm_y, ref_y), ("tvm state", tvm_state, ref_state)]:
            assert np.abs(got - ref).max() < TOL * max(1.0, np.abs(ref).max()), (wtype, batch, seq, name)
        assert np.array_equal(state.numpy(), tvm_state), "the state is updated in place"


def test_prefill_then_decode_equals_one_pass(cache_dir):
    kind = gla_block_kind(CFG, {n: "q4_1" for n in GLA_LINEARS})  # the tiny-hybrid model's kind: compiled once
    general, decode = _program(kind, cache_dir), _program(kind.decode_variant(), cache_dir)
    rng = np.random.default_rng(9)
    weights = random_weights(kind, rng)
    x = rng.standard_normal((1, 12, CFG.hidden)).astype(np.float32)
    whole = tvm.runtime.tensor(np.zeros(state_shape(CFG), np.float32))
    y_whole, _ = _call(general, kind, {"x": x, **weights}, whole)
    stepped = tvm.runtime.tensor(np.zeros(state_shape(CFG), np.float32))
    ys = [_call(general, kind, {"x": x[:, :7], **weights}, stepped)[0]]
    for t in range(7, 12):
        ys.append(_call(decode, kind.decode_variant(), {"x": x[:, t:t + 1], **weights}, stepped)[0])
    assert np.abs(np.concatenate(ys, axis=1) - y_whole).max() < 1e-5
    assert np.abs(stepped.numpy() - whole.numpy()).max() < 1e-5
    assert np.abs(whole.numpy()).max() > 0.1  # the state really accumulated something


def test_a_target_without_the_recurrence_kernel_refuses_clearly():
    from jitllm.core.errors import JitllmError
    from jitllm.lowering.onnx_import import to_relax
    from jitllm.lowering.targets.cuda import CudaTarget

    kind = gla_block_kind(CFG, {n: "f16" for n in GLA_LINEARS})
    with pytest.raises(JitllmError, match="target cuda has no kernel for gla blocks"):
        to_relax(kind, build_block_graph(kind), CudaTarget())


def test_unknown_or_miscounted_block_types_are_one_line_errors(tmp_path):
    from dataclasses import replace

    from jitllm.core.errors import JitllmError
    from jitllm.random_model import PRESETS, write_random_model

    hybrid = PRESETS["tiny-hybrid"]
    with pytest.raises(JitllmError, match="block 1 has unknown type 'mamba' \\(known: llama, moe, gla\\)"):
        write_random_model(tmp_path / "m.jlm", replace(hybrid, block_types=("llama", "mamba", "llama", "gla")))
    with pytest.raises(JitllmError, match="config lists 2 block types for 4 blocks"):
        write_random_model(tmp_path / "m.jlm", replace(hybrid, block_types=("llama", "gla")))
    assert not (tmp_path / "m.jlm").exists()
