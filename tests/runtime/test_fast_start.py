"""A fast first run (runtime/engine/fast_start.py): with an empty cache the host's units start on ONNX Runtime,
move to their llvm artifacts as the background compiles land (between decode steps, from the generation
loop), and the tokens are those of a run that found every artifact cached; a compile that fails leaves
its units on ONNX Runtime; SIGTERM while compiles run leaves no process and no half-written artifact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitllm.core.errors import JitllmError
from jitllm.lowering.compile_child import FORKS
from jitllm.model import load
from jitllm.runtime.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not FORKS, reason="background compiles fork (Linux)")
PROMPT = list(range(4, 20))
ROOT = Path(__file__).resolve().parents[2]


def _generate(model, tokens: int) -> list[int]:
    """Greedy tokens; after each, the compiles running are waited for (a tiny model's step takes
    milliseconds, a compile seconds), so that the loop's own poll finds them landed and moves the units."""
    out = []
    for token in model.generate_tokens(PROMPT, tokens, SamplingParams(0.0)):
        out.append(token)
        for compile_ in list(model.fast_start.running if model.fast_start else []):
            try:
                compile_.child.wait()
            except JitllmError:
                pass
    return out


def _where(model) -> list[str]:
    return [u.device.name for u in [*model.executor.blocks, model.executor.head]]


def test_units_start_on_onnx_runtime_and_end_on_their_compiled_artifacts(tiny_model, tmp_path, cache_dir):
    log: list[str] = []
    cold = load(tiny_model, devices="cpu", ctx=128, cache_dir=tmp_path, cpu_kernels="exact", fast_start=True,
                log=log.append)
    assert _where(cold) == ["ort"] * 3 and cold.fast_start.running  # (compiling while the blocks are loaded)
    got = _generate(cold, 12)
    assert _where(cold) == ["host"] * 3 and cold.fast_start.done
    assert any(m.startswith("moved blocks 0-1 and the head ort -> host") or m.startswith("moved blocks 0-1 ort")
               for m in log), log
    warm = load(tiny_model, devices="cpu", ctx=128, cache_dir=tmp_path, cpu_kernels="exact", fast_start=True)
    assert warm.fast_start is None and _where(warm) == ["host"] * 3  # (everything cached: nothing to wait for)
    assert got == warm.generate_ids(PROMPT, 12)


def test_a_failed_background_compile_leaves_its_units_on_onnx_runtime(tiny_model, tmp_path, monkeypatch):
    import jitllm.lowering.cache as cache

    imported = cache._imported

    def failing(kind, target):  # (in the forked compile process, which inherits the patch)
        if kind.kind == "llama":
            raise JitllmError("injected failure")
        return imported(kind, target)

    monkeypatch.setattr(cache, "_imported", failing)
    log: list[str] = []
    model = load(tiny_model, devices="cpu", ctx=128, cache_dir=tmp_path, cpu_kernels="exact", fast_start=True,
                 log=log.append)
    got = _generate(model, 10)
    assert _where(model) == ["ort", "ort", "host"] and model.fast_start.done
    failed = [m for m in log if m.startswith("warning:")]
    assert len(failed) == 1 and "compile of llama (decode) failed (injected failure)" in failed[0], log
    assert failed[0].endswith("; blocks 0-1 stay on ONNX Runtime")
    assert not any(m.startswith("compiling llama for") for m in log)  # (nothing else needed the general kind)
    monkeypatch.setattr(cache, "_imported", imported)
    reference = load(tiny_model, devices="ort", placement="*=ort,head=ort", ctx=128, cache_dir=tmp_path)
    assert got == reference.generate_ids(PROMPT, 10)


def test_sigterm_while_compiling_in_the_background_leaves_nothing(tiny_model, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TVM_NUM_THREADS": "1", "JITLLM_CACHE_DIR": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "jitllm", "run", "-devices", "cpu", "-n", "2", str(tiny_model), "x"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = f"/proc/{proc.pid}/task/{proc.pid}/children"
    deadline = time.monotonic() + 120
    try:
        while not (os.path.exists(children) and open(children).read().split()):
            assert time.monotonic() < deadline and proc.poll() is None, "no background compile started"
            time.sleep(0.02)
        child = int(open(children).read().split()[0])
    finally:
        proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and stderr.endswith("jitllm: error: terminated\n"), (proc.returncode, stderr)
    with pytest.raises(ProcessLookupError):
        os.killpg(child, 0)
    llvm = cache / "llvm"
    left = [p.name for p in llvm.iterdir()] if llvm.exists() else []
    assert not [name for name in left if name.startswith(".")], left  # (no half-written directory)
    for name in left:  # (an artifact that landed before the signal is whole)
        assert {p.suffix for p in (llvm / name).iterdir()} == {".so", ".json"}
