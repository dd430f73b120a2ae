"""CPU workers from the CLI: any worker count (-threads, TVM_NUM_THREADS, a narrower CPU mask) runs the same
artifacts (nothing recompiles) and gives the same tokens; -v says how many workers and why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_cli import assert_one_line_error


def run(model: Path, cache: Path, *flags: str, env: dict | None = None, cpus: set[int] | None = None
        ) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    environ.update(env or {}, JITLLM_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "jitllm", "run", "-v", "-n", "6", "-temp", "0", "-devices", "cpu",
                           *flags, str(model), "hello"], capture_output=True, text=True, env=environ, timeout=600, check=False,
                          preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def artifacts(cache: Path) -> set[Path]:
    return set((cache / "llvm").rglob("*.so"))


def test_any_worker_count_runs_the_same_artifacts_and_tokens(tiny_model, cache_dir):
    first = run(tiny_model, cache_dir, "-threads", "1")
    assert first.returncode == 0, first.stderr
    assert "CPU workers: 1 (-threads;" in first.stderr
    built = artifacts(cache_dir)
    second = run(tiny_model, cache_dir, env={"TVM_NUM_THREADS": "2"})
    masked = run(tiny_model, cache_dir, cpus={min(os.sched_getaffinity(0))})  # as under `taskset -c N`
    for other in (second, masked):
        assert other.returncode == 0, other.stderr
        assert "compiled" not in other.stderr, other.stderr
        assert other.stdout == first.stdout
    assert artifacts(cache_dir) == built
    assert "CPU workers: 2 (TVM_NUM_THREADS;" in second.stderr
    assert "CPU workers: 1 (one per physical performance core in the CPU mask;" in masked.stderr


def test_bad_worker_counts_are_one_line(tiny_model, cache_dir):
    assert_one_line_error(run(tiny_model, cache_dir, "-threads", "0"), "-threads")
    bad_env = run(tiny_model, cache_dir, env={"TVM_NUM_THREADS": "many"})
    assert bad_env.returncode != 0 and "Traceback" not in bad_env.stderr
    assert bad_env.stderr.strip().splitlines()[-1] == (
        "jitllm: error: TVM_NUM_THREADS='many': expected a positive whole number of CPU workers")
