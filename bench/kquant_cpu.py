"""CPU speed of a Q4_K_M model of a named shape: a random-weight GGUF in llama.cpp's Q4_K_M mix
(bench/llamacpp/random_gguf.py -wtype q4_k_m: Q4_K, Q6_K for the head and half the layers' attn_v and
ffn_down), converted by `jitllm convert` (kept Q4_K/Q6_K), measured by `jitllm speed` and, where
`llama-bench` is on PATH, by llama-bench on the same GGUF in the same run, with the ratios.

    python bench/kquant_cpu.py -preset llama-3.2-1b [-threads 2] [-p 512] [-n 128] [-r 3] [-blocks N]

The GGUF and the .jlm are written once into -dir and reused. Random weights quantized by jitllm's plain
encoder (gguf.quants has no K-quant quantizer; llama.cpp's would pick other values in the same layout,
so the same speed). The load average before and after is printed: on a shared machine the figures
mean little without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tests(table: str) -> dict[str, float]:
    """test -> mean t/s of a llama-bench-style markdown table (jitllm speed's)."""
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[-2].startswith(("pp", "tg")):
            out[cells[-2]] = float(cells[-1].split("±")[0])
    return out


def jitllm_speed(jlm: Path, args) -> tuple[str, dict[str, float]]:
    env = dict(os.environ, TVM_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "jitllm", "speed", "-devices", "cpu", "-cpu-kernels", args.kernels, "-p",
           str(args.p), "-n", str(args.n), "-r", str(args.r), "-cache", str(args.cache), str(jlm)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"jitllm speed failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip(), _tests(proc.stdout)


def llama_bench(gguf: Path, args) -> dict[str, float] | None:
    """test -> mean t/s from llama-bench's JSON, or None where llama-bench is not on PATH."""
    exe = shutil.which("llama-bench")
    if exe is None:
        return None
    cmd = [exe, "-m", str(gguf), "-p", str(args.p), "-n", str(args.n), "-r", str(args.r), "-t", str(args.threads),
           "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"llama-bench failed:\n{proc.stderr[-3000:]}")
    out = {}
    for entry in json.loads(proc.stdout):
        test = f"pp{entry['n_prompt']}" if entry["n_prompt"] else f"tg{entry['n_gen']}"
        out[test] = float(entry["avg_ts"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-preset", default="llama-3.2-1b", help="a shape of jitllm.random_model.PRESETS")
    ap.add_argument("-blocks", type=int, default=None, help="fewer blocks than the shape's (quick runs)")
    ap.add_argument("-threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("-p", type=int, default=512, help="prefill test ppN")
    ap.add_argument("-n", type=int, default=128, help="decode test tgN")
    ap.add_argument("-r", type=int, default=3, help="repetitions")
    ap.add_argument("-kernels", default="fast", choices=["fast", "exact"], help="jitllm's CPU kernel family")
    ap.add_argument("-dir", default="/tmp/jitllm-kquant", help="where the GGUF and the .jlm are kept")
    ap.add_argument("-cache", default="cache", help="jitllm's compile cache")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench" / "llamacpp"))
    from random_gguf import write_random_gguf

    from jitllm.convert import convert

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{args.preset}{'-' + str(args.blocks) + 'b' if args.blocks else ''}-q4_k_m"
    gguf, jlm = folder / f"{stem}.gguf", folder / f"{stem}.jlm"
    if not gguf.exists():
        write_random_gguf(gguf, args.preset, "q4_k_m", blocks=args.blocks, jobs=args.threads)
    if not jlm.exists():
        summary = convert(str(gguf), str(jlm), progress=False)
        print(f"converted: {summary['weight_types']}, {summary['bytes'] / 2**20:.1f} MiB")
    print(f"{gguf}: {gguf.stat().st_size / 2**20:.1f} MiB; {args.threads} threads; load average before "
          f"{os.getloadavg()[0]:.2f}")
    table, ours = jitllm_speed(jlm, args)
    print(table)
    peer = llama_bench(gguf, args)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    if peer is None:
        print("llama-bench is not on PATH: jitllm's figures only (DESIGN.md §8 says how to build it for this CPU)")
        return
    for test, rate in ours.items():
        if test in peer:
            print(f"{test}: jitllm {rate:.2f} t/s, llama-bench {peer[test]:.2f} t/s -> {rate / peer[test]:.2f}x")


if __name__ == "__main__":
    main()
