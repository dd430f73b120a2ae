"""The compile cache: hits, misses, policies, corrupted artifacts rebuilt, keys that follow the graph."""

from __future__ import annotations

import pytest

from jitllm.core.errors import JitllmError
from jitllm.ir.config import ModelConfig
from jitllm.ir.head import head_kind
from jitllm.lowering.cache import artifact_key, cache_policy, get_artifact
from jitllm.lowering.targets.llvm import LlvmTarget

CFG = ModelConfig("llama", 1, 64, 4, 2, 16, 128, 64, 64, 10000.0, 1e-5)
KIND = head_kind(CFG, "q8_0")


def test_miss_then_hit(tmp_path):
    log = []
    first = get_artifact(KIND, LlvmTarget(), tmp_path, log=log.append)
    second = get_artifact(KIND, LlvmTarget(), tmp_path, log=log.append)
    assert first.built and not second.built and first.path == second.path
    assert len(log) == 1 and log[0].startswith("compiled head")


def test_corrupted_artifact_is_rebuilt(tmp_path):
    first = get_artifact(KIND, LlvmTarget(), tmp_path)
    first.path.write_bytes(b"garbage")
    log = []
    again = get_artifact(KIND, LlvmTarget(), tmp_path, log=log.append)
    assert again.built and "corrupt" in log[0]
    assert get_artifact(KIND, LlvmTarget(), tmp_path).built is False


def test_policies(tmp_path):
    get_artifact(KIND, LlvmTarget(), tmp_path)
    assert get_artifact(KIND, LlvmTarget(), tmp_path, policy="redo").built
    assert not get_artifact(KIND, LlvmTarget(), tmp_path, policy="readonly").built
    off = get_artifact(KIND, LlvmTarget(), tmp_path, policy="off")
    assert off.built and tmp_path not in off.path.parents
    empty = tmp_path / "empty"
    ro = get_artifact(KIND, LlvmTarget(), empty, policy="readonly")
    assert ro.built and not empty.exists()


def test_key_depends_on_shape_and_type():
    keys = {artifact_key(KIND, LlvmTarget()), artifact_key(head_kind(CFG, "q4_1"), LlvmTarget()),
            artifact_key(head_kind(ModelConfig("llama", 1, 64, 4, 2, 16, 128, 128, 64, 10000.0, 1e-5), "q8_0"), LlvmTarget())}
    assert len(keys) == 3
    assert artifact_key(KIND, LlvmTarget()) == artifact_key(head_kind(CFG, "q8_0"), LlvmTarget())


def test_bad_policy(monkeypatch):
    monkeypatch.setenv("JITLLM_CACHE", "sometimes")
    with pytest.raises(JitllmError, match="JITLLM_CACHE"):
        cache_policy()


def test_missing_artifact_error_names_the_compile_flags_of_the_kernel_family():
    from jitllm.lowering.cache import _family_flag
    from jitllm.lowering.targets.cuda import CudaTarget
    from jitllm.lowering.targets.llvm import LlvmTarget

    assert _family_flag(LlvmTarget("fast")) == "" and _family_flag(CudaTarget("sm_90", "fast")) == ""
    assert _family_flag(LlvmTarget("exact")) == " -cpu-kernels exact"
    assert _family_flag(CudaTarget("sm_90", "exact")) == " -gpu-kernels exact"
