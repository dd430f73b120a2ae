"""The ONNX reference bodies of `Linear_<wtype>` (jitllm/ir/dequant.py), run by ONNX Runtime on the
identity, against gguf.quants.dequantize of the GGML bytes the parts were repacked from."""

from __future__ import annotations

import gguf
import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper
from reference import random_ggml

from jitllm.core.layouts import WEIGHT_TYPES, weight_parts
from jitllm.core.quant import dequantize, parts_from_float, parts_from_ggml
from jitllm.ir.graph import DOMAIN, OPSET, tensor_info
from jitllm.ir.ops import functions_for, linear_op

N, K = 16, 512


def _ort_weight(wtype: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """W [N, K] as the ONNX function computes it: x @ W.T for x = I."""
    specs = weight_parts(wtype, N, K)
    node = helper.make_node(linear_op(wtype), ["x", *[name for name, _, _ in specs]], ["y"], domain=DOMAIN)
    graph = helper.make_graph([node], "dequant", [tensor_info("x", "float32", (K, K))]
                              + [tensor_info(name, dtype, shape) for name, shape, dtype in specs],
                              [tensor_info("y", "float32", (K, N))])
    model = helper.make_model(graph, functions=functions_for([node]),
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)])
    session = ort.InferenceSession(model.SerializeToString())
    return session.run(None, {"x": np.eye(K, dtype=np.float32), **parts})[0].T


@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
def test_onnx_dequantization_matches_gguf(wtype):
    rng = np.random.default_rng(0)
    if wtype in ("f32", "f16"):
        parts = parts_from_float(wtype, rng.standard_normal((N, K)).astype(np.float32))
        expected = dequantize(wtype, parts)
    else:
        raw = random_ggml(wtype, N, K, rng)
        parts = parts_from_ggml(wtype, raw, N, K)
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[wtype.upper()])
    np.testing.assert_array_equal(_ort_weight(wtype, parts), expected)
