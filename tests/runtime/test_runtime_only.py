"""A runtime-only TVM (TVM_USE_RUNTIME_LIB=1, as the GPU machine's install runs) runs what the full TVM
compiled: the MoE router's top-k calls `tvm.contrib.sort.topk`, a packed function of libtvm_runtime_extra,
which `import tvm` loads only beside the compiler (runtime/backends/tvm_tensors.py loads it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jitllm.random_model import write_random_model

ROOT = Path(__file__).resolve().parents[2]


def _run(model: Path, cache: Path, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "jitllm", "run", str(model), "-devices", "cpu", "-n", "6",
                           "-temp", "0", "-cpu-kernels", "exact", "hello"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path, JITLLM_CACHE_DIR=str(cache), **env), timeout=600)


def test_a_moe_model_runs_on_a_runtime_only_tvm(tmp_path):
    model = tmp_path / "moe.jlm"
    write_random_model(model, "tiny-qwen3moe", "q4_0")
    full = _run(model, tmp_path / "cache", JITLLM_CACHE="on")  # compiles every artifact (full TVM)
    assert full.returncode == 0, full.stderr
    lean = _run(model, tmp_path / "cache", TVM_USE_RUNTIME_LIB="1", JITLLM_CACHE="readonly")
    assert lean.returncode == 0, lean.stderr
    assert lean.stdout == full.stdout and lean.stdout.strip()
