"""Batched decode of jitllm against llama.cpp's `llama-batched-bench` on the same GGUF, in the same run:

    python bench/batch.py [-gguf PATH | -random PRESET:WTYPE] [-b 1,2,4,8] [-p 128] [-n 128] [-threads 2]
                          [-reps 3] [-llama-batched-bench PATH] [-devices cpu] [-cache DIR] [-eager]

Each repetition runs, alternately, `jitllm batch -json` (the .jlm converted from the GGUF), `jitllm speed -p 0
-n N` (batch-1 decode through the single-session path, the B=1 reference of the issue's goal) and
`llama-batched-bench --output-format jsonl` with the same -npp/-ntg/-npl and thread count, each in its own
process; the tables print the medians. Goals (issue 23, CPU): jitllm S_TG at B=8 >= 3x `jitllm speed`'s
tg and >= 1.5x llama-batched-bench's S_TG at B=8. Build llama-batched-bench from bench/llamacpp's trimmed
source (CPU: -DGGML_NATIVE=OFF, AVX2 on; AVX-512 only where the CPU has it); without it only jitllm runs.

`-random smollm2-135m:q4_0` measures a random-weight model of that shape instead (no GGUF, so no llama.cpp:
the GPU machine, where the real model does not travel). `-eager` also runs `jitllm batch -eager` (batched
decode steps launched kernel by kernel instead of replayed as a captured graph per batch-size bucket, CUDA)
in each repetition and prints its S_TG and the ratio captured / eager.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def jitllm(*args: str, threads: int) -> str:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # (the GPU machine's TVM is on it)
    env = dict(os.environ, TVM_NUM_THREADS=str(threads), PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-m", "jitllm", *args], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"jitllm {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def jitllm_batch(jlm: Path, a, *extra: str) -> dict[int, dict]:
    out = jitllm("batch", str(jlm), "-devices", a.devices, "-b", a.b, "-p", str(a.p), "-n", str(a.n), "-r", "1",
                 "-json", "-cache", a.cache, *extra, threads=a.threads)
    return {row["pl"]: row for row in map(json.loads, out.splitlines())}


def jitllm_speed(jlm: Path, a) -> float:
    out = jitllm("speed", str(jlm), "-devices", a.devices, "-p", "0", "-n", str(a.n), "-r", "1", "-cache", a.cache,
                 threads=a.threads)
    row = next(line for line in out.splitlines() if f"| tg{a.n} |" in line)
    return float(row.split("|")[-2].split("±")[0])


def llama_batched(a) -> dict[int, dict] | None:
    if not a.llama_batched_bench or a.gguf is None:
        return None
    sizes = [int(b) for b in a.b.split(",")]
    cmd = [a.llama_batched_bench, "-m", str(a.gguf), "-c", str(max(sizes) * (a.p + a.n) + 16), "-b", "2048",
           "-ub", "512", "-npp", str(a.p), "-ntg", str(a.n), "-npl", a.b, "-t", str(a.threads),
           "--output-format", "jsonl"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"llama-batched-bench failed:\n{out.stderr[-2000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {row["pl"]: row for row in rows}


def median_rows(runs: list[dict[int, dict]]) -> dict[int, dict]:
    return {pl: {k: statistics.median(run[pl][k] for run in runs) for k in ("speed_pp", "speed_tg")}
            for pl in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-gguf", type=Path, default=None, help="default: the built-in SmolLM2 Q4_1 GGUF")
    p.add_argument("-random", default=None, metavar="PRESET:WTYPE",
                   help="a random-weight model of this shape instead of a GGUF (jitllm only)")
    p.add_argument("-eager", action="store_true", help="also `jitllm batch -eager`: captured vs eager decode steps")
    p.add_argument("-b", default="1,2,4,8")
    p.add_argument("-p", type=int, default=128)
    p.add_argument("-n", type=int, default=128)
    p.add_argument("-threads", type=int, default=2)
    p.add_argument("-reps", type=int, default=3)
    p.add_argument("-devices", default="cpu")
    p.add_argument("-cache", default=str(ROOT / "cache"))
    p.add_argument("-llama-batched-bench", dest="llama_batched_bench", default=os.environ.get("LLAMA_BATCHED_BENCH"))
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        jlm = Path(tmp) / "model.jlm"
        name = model_file(a, jlm)
        ours, eager, single, theirs = [], [], [], []
        for _ in range(a.reps):
            ours.append(jitllm_batch(jlm, a))
            if a.eager:
                eager.append(jitllm_batch(jlm, a, "-eager"))
            single.append(jitllm_speed(jlm, a))
            if (peer := llama_batched(a)) is not None:
                theirs.append(peer)
    mine = median_rows(ours)
    peer = median_rows(theirs) if theirs else None
    tg1 = statistics.median(single)
    print(f"{name} on {a.devices}: PP {a.p}, TG {a.n}, {a.threads} threads, {a.reps} alternating runs (medians); "
          f"jitllm speed tg{a.n} (batch-1 path) {tg1:.1f} t/s")
    print("|    B | jitllm S_PP | jitllm S_TG | S_TG / speed tg | llama S_PP | llama S_TG | S_TG jitllm/llama |")
    print("|------|-------------|-------------|-----------------|------------|------------|-------------------|")
    for pl, row in sorted(mine.items()):
        theirs_row = peer.get(pl) if peer else None
        llama = (f"{theirs_row['speed_pp']:10.1f} | {theirs_row['speed_tg']:10.1f} | "
                 f"{row['speed_tg'] / theirs_row['speed_tg']:17.2f}x") if theirs_row else \
            f"{'-':>10} | {'-':>10} | {'-':>18}"
        print(f"| {pl:4d} | {row['speed_pp']:11.1f} | {row['speed_tg']:11.1f} | {row['speed_tg'] / tg1:14.2f}x | {llama} |")
    if peer is None:
        print("llama-batched-bench not given (-llama-batched-bench PATH or $LLAMA_BATCHED_BENCH, with a GGUF): "
              "jitllm only")
    if eager:
        slow = median_rows(eager)
        print("|    B | captured S_TG | eager S_TG | captured / eager |")
        print("|------|---------------|------------|------------------|")
        for pl, row in sorted(mine.items()):
            print(f"| {pl:4d} | {row['speed_tg']:13.1f} | {slow[pl]['speed_tg']:10.1f} | "
                  f"{row['speed_tg'] / slow[pl]['speed_tg']:15.2f}x |")


def model_file(a, jlm: Path) -> str:
    """Write the measured model to `jlm` (a random one of `-random`'s shape, else the GGUF converted); its name."""
    if a.random:
        from jitllm.random_model import PRESETS, write_random_model

        preset, _, wtype = a.random.partition(":")
        if preset not in PRESETS:
            sys.exit(f"-random {a.random}: no preset {preset!r} (one of {', '.join(PRESETS)})")
        write_random_model(jlm, preset, wtype or "q4_0")
        a.gguf = None
        return f"random {preset} {wtype or 'q4_0'}"
    if a.gguf is None:
        from jitllm.default_model import default_gguf_path

        a.gguf = default_gguf_path()
    from jitllm.convert import convert

    convert(str(a.gguf), str(jlm), progress=False)
    return a.gguf.name


if __name__ == "__main__":
    main()
