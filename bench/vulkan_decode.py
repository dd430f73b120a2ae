"""Decode and prefill through Vulkan (the webgpu target on wgpu) beside the host's exact kernels in the same
run, with what the issue's lever is: dispatches and host encode time per decode token, submits per token,
and the cold cost of creating the pipelines.

    python bench/vulkan_decode.py [MODEL.jlm] [-device vulkan:0] [-n 16] [-prompt 32]

Without MODEL, a random `tiny` q4_1 model. On lavapipe (Mesa's CPU Vulkan) the figures are CPU-emulated
Vulkan, a correctness vehicle, not a GPU's speed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

def decode(model, prompt: list[int], steps: int, stats: dict | None = None) -> tuple[float, float, list[int], dict]:
    """(prefill seconds, decode tokens/s, tokens, what `stats` counted over the decode steps) of greedy
    steps picked by the executor."""
    ex = model.executor
    session = ex.new_session()
    start = time.perf_counter()
    token = ex.next_token(session, prompt)
    prefill = time.perf_counter() - start
    tokens = [token, ex.next_token(session, [token])]  # (the session's first step records its dispatches)
    before = dict(stats or {})
    start = time.perf_counter()
    for _ in range(steps):
        tokens.append(ex.next_token(session, [tokens[-1]]))
    rate = steps / (time.perf_counter() - start)
    return prefill, rate, tokens, {k: v - before[k] for k, v in (stats or {}).items()}

def main() -> None:
    from jitllm.model import load
    from jitllm.random_model import write_random_model

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("-device", default="vulkan:0")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("-prompt", type=int, default=32)
    ap.add_argument("-cache", default=None)
    args = ap.parse_args()
    path = Path(args.model) if args.model else Path(tempfile.mkdtemp()) / "tiny.jlm"
    if not args.model:
        write_random_model(path, "tiny", "q4_1", seed=1)
    prompt = list(range(4, 4 + args.prompt))
    start = time.perf_counter()
    vk = load(path, devices=args.device, cache_dir=args.cache, no_gpu_fallback=True, ctx=512)
    load_s = time.perf_counter() - start
    stats = vk.devices[args.device].backend.stats
    print(f"load on {args.device}: {load_s:.1f}s, of which {stats['pipelines']} pipelines created in "
          f"{stats['pipeline_seconds']:.2f}s (cold: wgpu offers no pipeline cache)")
    host = load(path, devices="cpu", cpu_kernels="exact", cache_dir=args.cache, ctx=512)
    vk_prefill, vk_tps, vk_tokens, counted = decode(vk, prompt, args.n, stats)
    host_prefill, host_tps, host_tokens, _ = decode(host, prompt, args.n)
    dispatches = counted["dispatches"]
    print(f"prefill {args.prompt} tokens: {args.device} {vk_prefill * 1e3:.0f} ms, host {host_prefill * 1e3:.0f} ms")
    print(f"decode: {args.device} {vk_tps:.1f} tok/s, host exact {host_tps:.1f} tok/s, ratio {vk_tps / host_tps:.2f}")
    print(f"per decode token: {counted['submits'] / args.n:.2f} submits, {dispatches / args.n:.0f} dispatches, "
          f"{counted['encode_seconds'] / args.n * 1e6:.0f} us encoding them "
          f"({counted['encode_seconds'] / max(dispatches, 1) * 1e6:.1f} us per dispatch), "
          f"{counted['bind_groups'] + counted['pipelines']} bind groups or pipelines created in all")
    print(f"tokens identical to the host's: {vk_tokens == host_tokens}"
          + ("" if vk_tokens == host_tokens else f" ({vk_tokens} vs {host_tokens})"))

if __name__ == "__main__":
    main()
