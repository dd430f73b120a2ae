"""Seconds from starting `jitllm run` to the first byte of its answer on stdout, cold (an empty compile
cache of its own) and warm (that cache, filled by the cold run), and to the end of the process.

    python bench/first_token.py [-r RUNS] [-- EXTRA jitllm run ARGS]

Each round: one cold run into a fresh temporary cache (removed after), then RUNS warm runs on it. The
model is the built-in SmolLM2 unless EXTRA names one. Prints one line per run and the median per mode.

    python bench/first_token.py --full-speed [-n 400]

In-process instead: the built-in model opened with an empty cache (fast start), greedy tokens until every
unit has moved to its compiled artifact, then the decode rate of the next 64 tokens against a model opened
warm on the same cache (same prompt, 64 tokens after as many): "full speed once the compiles finish".
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


def full_speed(tokens: int) -> None:
    from jitllm.default_model import default_model_path
    from jitllm.model import load
    from jitllm.runtime.sampling import SamplingParams

    path = default_model_path()
    cache = tempfile.mkdtemp(prefix="jitllm-first-token-")
    try:
        start = time.perf_counter()
        cold = load(path, devices="cpu", cache_dir=cache, fast_start=True)
        ids = cold.encode_prompt("Write a long story about a lighthouse keeper.", chat=True)
        stamps, moved_at = [], None
        for _ in cold.generate_tokens(ids, tokens, SamplingParams(0.0)):
            stamps.append(time.perf_counter())
            if moved_at is None and cold.fast_start.done and all(
                    u.device.name == "host" for u in [*cold.executor.blocks, cold.executor.head]):
                moved_at = len(stamps)
        if moved_at is None or len(stamps) < moved_at + 65:
            raise SystemExit(f"the moves did not finish with 64 tokens to spare (moved at {moved_at}, {len(stamps)} tokens)")
        after = 64 / (stamps[moved_at + 64] - stamps[moved_at])
        print(f"cold: first token {stamps[0] - start:.2f} s after load() began; every unit on llvm after token "
              f"{moved_at} ({stamps[moved_at - 1] - start:.1f} s); next 64 tokens at {after:.1f} tok/s")
        warm = load(path, devices="cpu", cache_dir=cache, fast_start=True)
        assert warm.fast_start is None
        stamps = []
        for _ in warm.generate_tokens(ids, moved_at + 65, SamplingParams(0.0)):
            stamps.append(time.perf_counter())
        print(f"warm: the same 64 tokens at {64 / (stamps[moved_at + 64] - stamps[moved_at]):.1f} tok/s")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-r", "--runs", type=int, default=3, help="warm runs per round")
    parser.add_argument("--rounds", type=int, default=1, help="cold runs (each with its warm runs)")
    parser.add_argument("-n", type=int, default=16, help="tokens to generate")
    parser.add_argument("--full-speed", action="store_true", help="the decode rate once the moves are done")
    parser.add_argument("extra", nargs="*", help="more `jitllm run` arguments (after --)")
    args = parser.parse_args()
    if args.full_speed:
        full_speed(args.n)
        return
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
