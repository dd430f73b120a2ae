"""Streamed blocks (`~`) on a CUDA device against the copy-bound floor and the resident run, in one process.
Run on the GPU machine:

    python3 bench/stream_decode.py [-preset llama-3.2-3b -wtype f16] [-budget 2G] [-tokens 32] [-cache cache]
                                   [MODEL.jlm]

Decodes `-tokens` greedy tokens with every block resident on cuda:0 (where it fits) and with every block
streamed (`-devices cuda:0=BUDGET -placement '*=cuda:0~'`), checks the tokens are the same, and prints each
run's tokens/s, the bytes a streamed token uploaded, the page-locked host-to-device bandwidth measured
through the same copy queue, and the floor it sets: bandwidth / bytes per token.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from gpu_decode import random_model


def decode(path: str, tokens: int, **options) -> tuple[list[int], float, object]:
    from jitllm.model import load

    model = load(path, ctx=512, **options)  # (the cache holds the kinds' CUDA artifacts, compiled elsewhere)
    ex = model.executor
    session = ex.new_session()
    token = int(np.argmax(ex.forward(session, list(range(4, 36)))))
    out = [token]
    start = time.perf_counter()
    for _ in range(tokens):
        token = ex.next_token(session, [token])
        out.append(token)
    return out, tokens / (time.perf_counter() - start), model


def upload_bandwidth(queue, device, nbytes: int, reps: int = 10) -> float:
    """Bytes/s of page-locked host -> device copies on the copy queue's stream."""
    staging, buffer = queue.staging(nbytes), device.empty((nbytes,), "uint8")
    after, done = queue.marker(), queue.marker()
    queue.upload(buffer, staging, after, done)
    queue.host_waits(done)
    start = time.perf_counter()
    for _ in range(reps):
        queue.upload(buffer, staging, after, done)
    queue.host_waits(done)
    return reps * nbytes / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("-preset", default="llama-3.2-3b")
    parser.add_argument("-wtype", default="f16")
    parser.add_argument("-budget", default="2G")
    parser.add_argument("-tokens", type=int, default=32)
    parser.add_argument("-cache", default="cache")
    parser.add_argument("-no-resident", action="store_true", help="skip the resident run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(random_model(args.preset, args.wtype, tmp)[0])
        streamed, tps, model = decode(path, args.tokens, devices=f"cuda:0={args.budget}", placement="*=cuda:0~",
                                     cache_dir=args.cache)
        pool = model.executor.streams["cuda:0"]
        per_token = model.plan.budgets[0].upload_bytes_per_token
        bandwidth = upload_bandwidth(pool._queue, model.devices["cuda:0"], max(s.padded for s in pool.members.values()))
        print(model.plan.describe().splitlines()[-2])
        print(f"streamed: {tps:.2f} tok/s, {per_token / 2**20:.1f} MiB uploaded per token; "
              f"H2D {bandwidth / 1e9:.1f} GB/s -> floor {bandwidth / per_token:.2f} tok/s "
              f"({tps / (bandwidth / per_token):.0%} of it); {pool.describe()}")
        del model
        if not args.no_resident:
            resident, rtps, _ = decode(path, args.tokens, devices="cuda:0", cache_dir=args.cache)
            print(f"resident: {rtps:.2f} tok/s; tokens identical: {resident == streamed}")


if __name__ == "__main__":
    main()
