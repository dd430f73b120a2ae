"""The webgpu target's artifact, a kernel package (no Vulkan adapter needed): `jitllm compile -target webgpu`
fills the cache with WGSL for every kernel and a launch plan whose every launch names a kernel of the
package with as many storage bindings as the kernel declares, with no 8- or 64-bit integer in the WGSL
(WebGPU has neither), and decode matvecs that load their weights as 16-byte vectors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from jitllm.lowering import KERNEL_PACKAGE_FORMAT
from jitllm.random_model import write_random_model
from jitllm.runtime.backends.wgpu_plan import evaluate

NARROW_OR_WIDE = re.compile(r"\b(u8|i8|u64|i64|f64)\b")


def _compile(model: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jitllm", "compile", "-target", "webgpu", "-cache", str(cache),
                           str(model)], capture_output=True, text=True, timeout=600)


def test_compile_fills_the_cache_with_kernel_packages(tiny_model, tmp_path):
    first, second = _compile(tiny_model, tmp_path), _compile(tiny_model, tmp_path)
    assert first.returncode == 0, first.stderr
    # (each kind and its batch-1 decode variant, whose head picks the greedy token: the argmax function)
    assert "4 kinds: 4 compiled, 0 already cached" in first.stdout, first.stdout
    assert "0 compiled, 4 already cached" in second.stdout, second.stdout
    packages = sorted((tmp_path / "webgpu").glob("*/*.kernels"))
    assert [p.name.split("-")[0] for p in packages] == ["head", "head", "llama", "llama"]
    assert sum("argmax" in json.loads(p.read_text())["functions"] for p in packages) == 1
    for path in packages:
        package = json.loads(path.read_text())
        assert package["format"] == KERNEL_PACKAGE_FORMAT and set(package["programs"]) == {"main"}
        kernels, functions = package["kernels"], package["functions"]
        for name, kernel in kernels.items():
            assert f"fn {name}(" in kernel["wgsl"] and "@compute" in kernel["wgsl"]
            assert not NARROW_OR_WIDE.search(kernel["wgsl"]), name
            assert len(re.findall(r"var<storage", kernel["wgsl"])) == kernel["storage"]
            if name.startswith("jl_wgsl_gemv_"):  # (decode matvecs read weights 16 bytes at a time)
                assert re.search(r"\bw_ptr : array<vec4<[iuf]32>>", kernel["wgsl"]), name
        launched = set()
        for function in functions.values():
            scratch = sum(step[0] == "scratch" for step in function["steps"])
            for step in function["steps"]:
                if step[0] == "launch":
                    _, kernel, bound, pods, grid = step
                    launched.add(kernel)
                    assert len(bound) == kernels[kernel]["storage"] and max(bound) < len(function["params"]) + scratch
                    assert len(pods) == len(kernels[kernel]["pods"])
                    assert len(grid) == len(kernels[kernel]["launch"])
        assert launched == set(kernels)  # (every kernel is launched by some function)
        called = {b["function"] for b in package["programs"]["main"]["bindings"] if b["op"] == "call"}
        assert called <= set(functions)


def test_a_weight_type_without_wgsl_kernels_is_one_line(tmp_path):
    model = tmp_path / "tiny-q5_0.jlm"
    write_random_model(model, "tiny", "q5_0")
    out = _compile(model, tmp_path / "cache")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == \
        "jitllm: error: target webgpu has no kernel for q5_0 weights yet (f32, f16, q8_0, q4_0, q4_1 only)"


def test_plan_expressions_are_int32_arithmetic_as_tir_means_it():
    env = {"m": 5, "n": -7}
    assert evaluate(["//", ["+", "m", 31], 32], env) == 1
    assert evaluate(["//", "n", 2], env) == -4 and evaluate(["%", "n", 2], env) == 1  # floor division
    assert evaluate(["/", "n", 2], env) == -3 and evaluate(["rem", "n", 2], env) == -1  # truncating
    assert evaluate(["select", ["<", "n", 0], ["max", "m", 9], ["min", "m", 1]], env) == 9
    assert evaluate(["cast", "int32", ["*", "m", "m"]], env) == 25
