"""jitllmd's RSS under desynchronised traffic: C clients, each request a new prompt (no prefix-cache hits) of
20-60 random words and a max_tokens of 8-64 drawn at random (temperature 0, ignore_eos), so streams start and
end at different steps and the batched steps take ever new row counts; the server's RSS every 10 s.

    python bench/serve_rss.py [-c 16] [-seconds 100] [-root DIR] [-cache DIR]

`-root` is the checkout whose jitllm serves (default: this one), to compare two versions on one machine.
bench/serve_load.py's soak sends 16 prompts in a loop with one max_tokens, which keeps its streams in step:
few new row counts come once it is warm, so it hides a memory that grows with them (docs/server.md, memory).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
WORDS = "time river stone light house garden window morning paper music voice city ocean forest story bread".split()


def start(root: Path, clients: int, cache: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(root), TVM_NUM_THREADS=os.environ.get("TVM_NUM_THREADS", "1"),
               JITLLM_CACHE_DIR=cache)
    process = subprocess.Popen([sys.executable, "-c", "from jitllm.cli import jitllmd; jitllmd()", "serve", "-port",
                                "0", "-parallel", str(clients), "-cache-sessions", str(max(32, clients))],
                               stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    for line in process.stderr:
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
            return process, found.group(1)
    sys.exit(f"serve_rss: jitllmd did not start (exit code {process.wait()})")


async def load(url: str, pid: int, clients: int, seconds: float) -> tuple[int, list[tuple[int, int]]]:
    rng, done, rss = random.Random(1), [0], []
    server = psutil.Process(pid)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        while (await client.get(url + "/health")).status_code != 200:
            await asyncio.sleep(0.5)
        began = time.perf_counter()

        async def stream() -> None:
            while time.perf_counter() - began < seconds:
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
                answer = await client.post(url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": rng.randint(8, 64), "temperature": 0, "ignore_eos": True})
                if answer.status_code != 200:
                    sys.exit(f"serve_rss: a request failed: {answer.status_code} {answer.text[:200]}")
                done[0] += 1

        async def sample() -> None:
            while time.perf_counter() - began < seconds:
                rss.append((round(time.perf_counter() - began), round(server.memory_info().rss / 2**20)))
                await asyncio.sleep(10)

        await asyncio.gather(sample(), *(stream() for _ in range(clients)))
        rss.append((round(time.perf_counter() - began), round(server.memory_info().rss / 2**20)))
    return done[0], rss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", type=int, default=16, help="concurrent clients (jitllmd -parallel)")
    p.add_argument("-seconds", type=float, default=100.0)
    p.add_argument("-root", type=Path, default=ROOT, help="the checkout whose jitllm serves")
    p.add_argument("-cache", default=str(ROOT / "cache"), help="the compiled-artifact cache")
    a = p.parse_args()
    if a.c < 1 or a.seconds <= 0 or not (a.root / "jitllm").is_dir():
        p.error("-c must be >= 1, -seconds > 0, and -root a checkout of jitllm")
    process, url = start(a.root.resolve(), a.c, a.cache)
    try:
        requests, rss = asyncio.run(load(url, process.pid, a.c, a.seconds))
    finally:
        process.terminate()
        process.wait(30)
    print(f"{a.root}: {a.c} clients, {a.seconds:.0f} s, {requests} requests; RSS MiB at (s, MiB): "
          + ", ".join(f"{s} {m}" for s, m in rss) + f"; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
