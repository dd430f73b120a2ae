"""Seconds from starting `jitllm run` to the first byte of its answer on stdout, cold (an empty compile
cache of its own) and warm (that cache, filled by the cold run), and to the end of the process.

    python bench/first_token.py [-r RUNS] [-- EXTRA jitllm run ARGS]

Each round: one cold run into a fresh temporary cache (removed after), then RUNS warm runs on it. The
model is the built-in SmolLM2 unless EXTRA names one. Prints one line per run and the median per mode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "What is the capital of France?"


def timed(args: list[str], cache: str) -> tuple[float, float, str]:
    """(seconds to the first stdout byte, seconds to exit, the last stderr line)."""
    env = {**os.environ, "JITLLM_CACHE_DIR": cache}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # (an installed jitllm has its bytecode: so does this one)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jitllm", "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.stdout.read()
    err = proc.stderr.read().decode(errors="replace").strip().splitlines()
    proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"jitllm run failed ({proc.returncode}): {err[-1] if err else ''}")
    return first, time.perf_counter() - start, next((l for l in reversed(err) if "prefill" in l), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-r", "--runs", type=int, default=3, help="warm runs per round")
    parser.add_argument("--rounds", type=int, default=1, help="cold runs (each with its warm runs)")
    parser.add_argument("-n", type=int, default=16, help="tokens to generate")
    parser.add_argument("extra", nargs="*", help="more `jitllm run` arguments (after --)")
    args = parser.parse_args()
    run_args = ["-n", str(args.n), "-temp", "0", *args.extra, PROMPT]
    results: dict[str, list[float]] = {"cold": [], "warm": []}
    for _ in range(args.rounds):
        cache = tempfile.mkdtemp(prefix="jitllm-first-token-")
        try:
            for mode in ["cold"] + ["warm"] * args.runs:
                first, total, decode = timed(run_args, cache)
                results[mode].append(first)
                print(f"{mode}: first token {first:.2f} s, exit {total:.2f} s  [{decode}]", flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    for mode, values in results.items():
        if values:
            print(f"{mode} median first token: {statistics.median(values):.2f} s over {len(values)} run(s) "
                  f"(min {min(values):.2f})")


if __name__ == "__main__":
    main()
