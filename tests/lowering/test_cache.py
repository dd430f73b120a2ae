"""The compile cache: hits, misses, policies, corrupted or unloadable artifacts rebuilt, keys that follow the
graph, artifacts written as one directory, unwritable and temporary caches."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jitllm.core.errors import JitllmError
from jitllm.ir.config import ModelConfig
from jitllm.ir.head import head_kind
from jitllm.lowering.cache import (
    artifact_key,
    cache_policy,
    get_artifact,
    load_artifact,
)
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


# --- issue 27: artifacts as one unit, unloadable artifacts, unwritable caches, temporary caches ---

def onnx_target():
    from jitllm.lowering.targets.onnxruntime import OnnxRuntimeTarget

    return OnnxRuntimeTarget()


def test_artifact_and_sidecar_are_one_directory_readable_by_the_group(tmp_path):
    umask = os.umask(0o022)
    try:
        artifact = get_artifact(KIND, onnx_target(), tmp_path)
    finally:
        os.umask(umask)
    directory = artifact.path.parent
    assert directory.name == f"{KIND.kind}-{artifact.key}" and directory.parent == tmp_path / "onnxruntime"
    assert sorted(p.name for p in directory.iterdir()) == sorted([artifact.path.name, f"{directory.name}.json"])
    assert stat.S_IMODE(directory.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o044 == 0o044 for p in directory.iterdir())
    assert list((tmp_path / "onnxruntime").iterdir()) == [directory]


def test_concurrent_writers_leave_one_matching_pair_and_no_temporary_directory(tmp_path):
    def write() -> None:
        for _ in range(10):
            get_artifact(KIND, onnx_target(), tmp_path, policy="redo")

    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    artifact = get_artifact(KIND, onnx_target(), tmp_path)
    assert not artifact.built and os.listdir(tmp_path / "onnxruntime") == [artifact.path.parent.name]


def test_a_killed_compile_s_directory_is_swept_by_the_next_write(tmp_path):
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    name = f"{KIND.kind}-{artifact_key(KIND, onnx_target())}"
    stale = tmp_path / "onnxruntime" / f".{name}.{dead}@{socket.gethostname()}.abcd_123"
    stale.mkdir(parents=True)
    (stale / f"{name}.onnx").write_bytes(b"half")
    get_artifact(KIND, onnx_target(), tmp_path)
    assert not stale.exists()


def test_an_artifact_that_does_not_load_though_its_sidecar_matches_is_rebuilt(tmp_path):
    import tvm

    from jitllm.runtime.backends.tvm_tensors import load_program

    first = get_artifact(KIND, LlvmTarget(), tmp_path)
    first.path.write_bytes(b"not a shared library")
    sidecar = first.path.with_suffix(".json")
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()),
                                   "sha256": hashlib.sha256(b"not a shared library").hexdigest()}))
    log = []
    program = load_artifact(KIND, LlvmTarget(), lambda path: load_program(path, tvm.cpu(), False), tmp_path,
                            log=log.append)
    assert program.main is not None
    assert "cannot load compiled artifact" in log[0] and log[0].endswith("rebuilding it")
    assert log[1].startswith("compiled head") and not get_artifact(KIND, LlvmTarget(), tmp_path).built


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_unwritable_cache_falls_back_to_a_temporary_one_with_one_warning(tmp_path, where):
    (tmp_path / "file").write_text("x")
    root = tmp_path / "file" if where == "a file" else tmp_path / "file" / "cache"
    log = []
    head = get_artifact(KIND, onnx_target(), root, log=log.append)
    other = get_artifact(head_kind(CFG, "q4_1"), onnx_target(), root, log=log.append)
    again = get_artifact(KIND, onnx_target(), root, log=log.append)
    warnings = [line for line in log if line.startswith("cache: cannot write")]
    assert len(warnings) == 1 and "temporary cache" in warnings[0]
    assert not again.built and again.path == head.path and other.path.is_file()  # (the temporary cache is read too)
    assert (tmp_path / "file").read_text() == "x" and tmp_path not in head.path.parents


@pytest.mark.parametrize("case", ["off", "unwritable"])
def test_temporary_caches_do_not_outlive_the_process(tmp_path, case):
    """The CLI: `jitllm compile` into a temporary cache leaves nothing in the system temp folder, and an
    unwritable cache is one warning line, not an error (readonly takes the same temporary cache; each case
    costs a TVM import, ~15 s on the 2-core machine, hence two)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    (tmp_path / "file").write_text("x")
    cache = tmp_path / ("file" if case == "unwritable" else "cache")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "TMPDIR": str(temp),
           "JITLLM_CACHE": "on" if case == "unwritable" else case}
    done = subprocess.run([sys.executable, "-m", "jitllm", "compile", "-preset", "tiny", "-target", "onnxruntime",
                           "-cache", str(cache)], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    if case == "unwritable":
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("jitllm: cache: cannot write"), done.stderr
    assert "compiled" in done.stdout and list(temp.iterdir()) == []
    assert (tmp_path / "file").read_text() == "x" and not (tmp_path / "cache").exists()


def test_two_callers_needing_one_artifact_compile_it_once(tmp_path, monkeypatch):
    """The second to ask waits on the first's compile lock, then finds the artifact (no second compile)."""
    from jitllm.lowering import cache

    builds, real_build = [], cache._build

    def slow_build(*args, **kwargs):  # (long enough that both callers look before either has built)
        builds.append(args[2])
        threading.Event().wait(0.5)
        real_build(*args, **kwargs)

    monkeypatch.setattr(cache, "_build", slow_build)
    start, results = threading.Barrier(2), []

    def ask():
        start.wait()
        results.append(get_artifact(KIND, LlvmTarget(), tmp_path))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(builds) == 1 and sorted(r.built for r in results) == [False, True]
    assert results[0].path == results[1].path


def test_a_kept_key_spares_building_the_graph(tmp_path, monkeypatch):
    import jitllm.lowering.cache as cache

    key = artifact_key(KIND, LlvmTarget(), tmp_path)
    assert len(list((tmp_path / ".keys").iterdir())) == 1 and key == artifact_key(KIND, LlvmTarget())

    def no_graph(kind):
        raise AssertionError("the graph was built")

    monkeypatch.setattr(cache, "build_block_graph", no_graph)
    assert artifact_key(KIND, LlvmTarget(), tmp_path) == key  # (a warm start: no onnx import, no graph)
    assert artifact_key(KIND, LlvmTarget(), tmp_path, policy="readonly") == key
    with pytest.raises(AssertionError, match="the graph was built"):
        artifact_key(KIND, LlvmTarget(), tmp_path, policy="redo")  # (redo trusts nothing it kept)
    with pytest.raises(AssertionError, match="the graph was built"):
        artifact_key(head_kind(CFG, "q4_1"), LlvmTarget(), tmp_path)  # (another kind: another digest)
