"""The CLI as a user meets it: real runs, and every bad input answered by one line and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def jitllm(*args: str, cache: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JITLLM_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "jitllm", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("jitllm: error:")]
    # Only informational lines (compile/cache events) may come before the one error line.
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert all(line.startswith("jitllm: ") for line in lines), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_help_lists_the_verbs(cache_dir):
    out = jitllm("--help", cache=cache_dir)
    assert out.returncode == 0
    for verb in ("run", "convert", "compile", "verify", "speed", "hardware", "tokenize"):
        assert verb in out.stdout


def test_run_greedy_is_reproducible_and_reports_speed(tiny_model, cache_dir):
    args = ("run", "-n", "8", "-temp", "0", "--devices", "cpu", str(tiny_model), "hello")
    first, second = jitllm(*args, cache=cache_dir), jitllm(*args, cache=cache_dir)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert "decode" in first.stderr and "tok/s" in first.stderr


def test_run_seeded_sampling_is_reproducible(tiny_model, cache_dir):
    args = ("run", "-n", "8", "-temp", "1.0", "-top-k", "0", "-seed", "3", "-devices", "cpu", str(tiny_model), "hi")
    assert jitllm(*args, cache=cache_dir).stdout == jitllm(*args, cache=cache_dir).stdout


def test_compile_reports_compiled_then_cached(tiny_model, tmp_path):
    first = jitllm("compile", str(tiny_model), cache=tmp_path)
    second = jitllm("compile", str(tiny_model), "-cache", str(tmp_path), cache=tmp_path / "unused")
    import re

    kinds = re.search(r"(\d+) kinds: (\d+) compiled, 0 already cached", first.stdout)
    assert first.returncode == 0 and kinds and kinds.group(1) == kinds.group(2), first.stdout
    assert second.returncode == 0 and f"0 compiled, {kinds.group(1)} already cached" in second.stdout
    assert not (tmp_path / "unused").exists()
    run = jitllm("run", "-n", "2", "-devices", "cpu", str(tiny_model), "x", cache=tmp_path)  # default kernels
    assert run.returncode == 0 and "compiled" not in run.stderr, run.stderr  # all of them compiled ahead
    assert " ragged (blocks 0-" in first.stdout and " ragged (head)" in first.stdout, first.stdout
    batch = jitllm("batch", "-devices", "cpu", "-b", "2", "-p", "4", "-n", "2", "-r", "1", str(tiny_model),
                   cache=tmp_path)  # (batched steps: the ragged variants)
    assert batch.returncode == 0 and "compiled" not in batch.stderr, batch.stderr


def test_run_compiles_missing_artifacts_and_says_so(tiny_model, tmp_path):
    out = jitllm("run", "-n", "2", "-devices", "cpu", str(tiny_model), "x", cache=tmp_path)
    assert out.returncode == 0
    assert "compiled llama for llvm in" in out.stderr


@pytest.mark.parametrize("content,needle", [
    (None, "model file not found"),
    (b"", "too short"),
    (b"GGUF\x03\x00\x00\x00" + b"\x00" * 40, "not a .jlm"),
    (b"PK\x03\x04 something else entirely", "bad magic"),
])
def test_bad_model_files(tmp_path, cache_dir, content, needle):
    path = tmp_path / "m.jlm"
    if content is not None:
        path.write_bytes(content)
    assert_one_line_error(jitllm("run", "-devices", "cpu", str(path), "hi", cache=cache_dir), needle)


def test_truncated_and_wrong_version_model(tiny_model, tmp_path, cache_dir):
    data = tiny_model.read_bytes()
    cut = tmp_path / "cut.jlm"
    cut.write_bytes(data[: len(data) // 2])
    assert_one_line_error(jitllm("run", "-devices", "cpu", str(cut), "hi", cache=cache_dir), "truncated")
    newer = tmp_path / "v9.jlm"
    newer.write_bytes(data[:8] + (9).to_bytes(4, "little") + data[12:])
    assert_one_line_error(jitllm("run", "-devices", "cpu", str(newer), "hi", cache=cache_dir), "version 9")


@pytest.mark.parametrize("args,needle", [
    (("-temp", "hot"), "hot"),
    (("-n", "-5"), "-5"),
    (("-top-p", "2"), "2"),
    (("-devices", "cpu=3Q"), "3Q"),
    (("-devices", "gpu:7"), "gpu"),
    (("-placement", "3-1=host"), "backwards"),
    (("-placement", "99=host"), "99"),
    (("-bogus",), "bogus"),
    (("-ctk", "q8_0", "-ctv", "f16"), "differ"),
    (("-ctk", "q8_0", "-ctv", "q8_0"), "q8_0 needs a head dim that is a multiple of 32 (this model's is 16)"),
    (("-ctk", "q4_0"), "q4_0"),
])
def test_bad_flags(tiny_model, cache_dir, args, needle):
    assert_one_line_error(jitllm("run", *args, str(tiny_model), "hi", cache=cache_dir), needle)


def test_run_with_a_q8_0_kv_cache(tiny_d32, cache_dir):
    """-ctk/-ctv q8_0 (llama.cpp's flags) load and run where the head dim is a multiple of 32."""
    out = jitllm("run", "-n", "6", "-temp", "0", "-devices", "cpu", "-ctk", "q8_0", "-ctv", "q8_0", str(tiny_d32),
                 "hello", cache=cache_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "decode" in out.stderr


def test_prompt_longer_than_context(tiny_model, cache_dir):
    out = jitllm("run", "-devices", "cpu", "-ctx", "8", str(tiny_model), "a long prompt " * 10, cache=cache_dir)
    assert_one_line_error(out, "longer than the context")


def test_bad_cache_policy(tiny_model, cache_dir):
    env_out = subprocess.run([sys.executable, "-m", "jitllm", "compile", str(tiny_model)], capture_output=True,
                             text=True, env=dict(os.environ, JITLLM_CACHE="sometimes", JITLLM_CACHE_DIR=str(cache_dir)))
    assert_one_line_error(env_out, "JITLLM_CACHE")


def test_speed_prints_a_llama_bench_table(tiny_model, cache_dir):
    out = jitllm("speed", "-devices", "cpu", "-p", "16", "-n", "4", "-r", "2", str(tiny_model), cache=cache_dir)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| tiny")]
    assert [row.split("|")[4].strip() for row in rows] == ["pp16", "tg4"]
    for row in rows:
        mean, sd = row.split("|")[5].split("±")
        assert float(mean) > 0 and float(sd) >= 0


def test_speed_refuses_an_unknown_shape(cache_dir):
    assert_one_line_error(jitllm("speed", "-devices", "cpu", "-preset", "llama-9000", cache=cache_dir), "llama-9000")


def test_speed_refuses_a_weight_type_the_shape_cannot_hold(cache_dir):
    assert_one_line_error(jitllm("speed", "-devices", "cpu", "-preset", "tiny", "-wtype", "q4_k", cache=cache_dir),
                          "tiny: token_embd: 64 inputs is not a multiple of 256 (q4_k)")


def test_simulated_devices_from_the_cli_run_like_the_host(tiny_model, cache_dir):
    """`-devices sim:N` (JITLLM_SIM_DEVICES=1) places blocks on simulated devices running the host's kernel
    family: the same tokens as the host alone; without the switch, one clear line."""
    args = ("run", "-n", "8", "-temp", "0", str(tiny_model), "hello")
    host = jitllm(*args, "-devices", "cpu", cache=cache_dir)
    env = dict(os.environ, JITLLM_CACHE_DIR=str(cache_dir), JITLLM_SIM_DEVICES="1")
    sim = subprocess.run([sys.executable, "-m", "jitllm", *args, "-devices", "sim:0,sim:1", "-placement", "0=sim:0,1=sim:1",
                          "-v"], capture_output=True, text=True, env=env, timeout=600)
    assert sim.returncode == 0, sim.stderr
    assert sim.stdout == host.stdout and "sim:1" in sim.stderr
    assert_one_line_error(jitllm(*args, "-devices", "sim:0", cache=cache_dir), "set JITLLM_SIM_DEVICES=1")


def test_speed_compares_targets_in_one_table(tiny_model, cache_dir):
    """`jitllm speed -targets llvm,ort`: one llama-bench table, a row per target and test, each rate against
    the first target's; `-targets list` names the presets; an unknown one is one clear line."""
    out = jitllm("speed", "-targets", "llvm,ort", "-p", "8", "-n", "2", "-r", "1", str(tiny_model), cache=cache_dir)
    assert out.returncode == 0, out.stderr
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.stdout.splitlines()
            if line.startswith("| tiny")]
    assert [(r[2], r[3], r[4]) for r in rows] == [("llvm", "host", "pp8"), ("llvm", "host", "tg2"),
                                                   ("ort", "ort", "pp8"), ("ort", "ort", "tg2")]
    assert [r[6] for r in rows[:2]] == ["1.00x", "1.00x"] and all(float(r[6].rstrip("x")) > 0 for r in rows)
    listed = jitllm("speed", "-targets", "list", cache=cache_dir)
    assert listed.returncode == 0 and [line.split()[0] for line in listed.stdout.splitlines()] == [
        "llvm", "ort", "cuda", "ort:cuda", "vulkan"]
    assert_one_line_error(jitllm("speed", "-targets", "llvm,tpu", str(tiny_model), cache=cache_dir), "unknown tpu")


def test_run_reads_the_prompt_from_a_file_or_standard_input(tiny_model, cache_dir, tmp_path):
    prompt = "hello there,\nsecond line"
    (tmp_path / "p.txt").write_text(prompt)
    args = ("run", "-n", "6", "-temp", "0", "-devices", "cpu")
    inline = jitllm(*args, str(tiny_model), prompt, cache=cache_dir)
    from_file = jitllm(*args, "-f", str(tmp_path / "p.txt"), str(tiny_model), cache=cache_dir)
    env = dict(os.environ, JITLLM_CACHE_DIR=str(cache_dir))
    from_stdin = subprocess.run([sys.executable, "-m", "jitllm", *args, "-f", "-", str(tiny_model)], input=prompt,
                                capture_output=True, text=True, env=env, timeout=600)
    assert inline.returncode == from_file.returncode == from_stdin.returncode == 0, from_file.stderr
    assert inline.stdout == from_file.stdout == from_stdin.stdout
    assert_one_line_error(jitllm(*args, "-f", str(tmp_path / "none.txt"), str(tiny_model), cache=cache_dir),
                          "none.txt: No such file")
    assert_one_line_error(jitllm(*args, "-f", str(tmp_path / "p.txt"), str(tiny_model), "x", cache=cache_dir),
                          "expected [MODEL] with -f")
