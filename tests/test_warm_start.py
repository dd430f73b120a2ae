"""What a warm start (every artifact cached) does not do before its first token: import torch (tvm_ffi's
eager import), ml_dtypes or onnx (no ONNX graph is built: the artifact keys are kept in the cache), or
ask wgpu for adapters (tests/runtime/test_inventory.py); docs/performance.md has the figures."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import onnx

from jitllm.ir.graph import DTYPES

ROOT = Path(__file__).resolve().parents[1]


def test_the_element_type_numbers_are_onnx_s():
    names = {"float32": "FLOAT", "float16": "FLOAT16", "int8": "INT8", "uint8": "UINT8", "uint16": "UINT16",
             "int32": "INT32", "int64": "INT64"}
    assert DTYPES == {dtype: getattr(onnx.TensorProto, name) for dtype, name in names.items()}


def _imported(model: Path, cache: Path) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TVM_NUM_THREADS": "1", "JITLLM_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "jitllm", "run", "-devices", "cpu", "-n", "2",
                           str(model), "x"], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|") for line in done.stderr.splitlines() if line.startswith("import time:")]
    # (a refused import, None in sys.modules, is listed too, taking microseconds)
    return {name.strip() for _, cumulative, name in rows if cumulative.strip().isdigit() and int(cumulative) > 100}


def test_a_warm_run_imports_neither_torch_nor_ml_dtypes_nor_onnx(tiny_model, cache_dir):
    _imported(tiny_model, cache_dir)  # (where the session's cache lacks them: compiles, keeps the keys)
    warm = _imported(tiny_model, cache_dir)
    assert "onnx" not in warm and "ml_dtypes" not in warm and "tvm" in warm
    if importlib.util.find_spec("torch") is not None:
        assert "torch" not in warm
