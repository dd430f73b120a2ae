"""GPU decode/prefill speed of jitllm on random-weight models of named shapes, with the bandwidth
roofline and HF transformers (eager) measured in the same run. Run on the GPU machine:

    python3 bench/gpu_decode.py [-preset smollm2-135m -wtype q4_1] [-device cuda:0] [-reps 3]

Prints pp512 and tg128 tokens/s (median and spread of the repetitions), bytes read per token, the copy
bandwidth and roofline tokens/s, and the ratios. (llama.cpp's llama-bench is measured separately.)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB through TVM (read + write counted once each)."""
    import tvm

    dev = tvm.cuda(int(device.split(":")[1]))
    n = 1 << 28
    a = tvm.runtime.empty((n,), "float32", dev)
    b = tvm.runtime.empty((n,), "float32", dev)
    a.copyto(b)
    dev.sync()
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        a.copyto(b)
    dev.sync()
    return 2 * 4 * n * reps / (time.perf_counter() - start)


def measure(model, prompt_len: int, gen: int, reps: int) -> tuple[list[float], list[float]]:
    ex = model.executor
    pp, tg = [], []
    rng = np.random.default_rng(0)
    for _ in range(reps):
        ids = [int(t) for t in rng.integers(4, 259, prompt_len)]
        session = ex.new_session()
        start = time.perf_counter()
        logits = ex.forward(session, ids)
        pp.append(prompt_len / (time.perf_counter() - start))
        token = int(np.argmax(logits))
        start = time.perf_counter()
        for _ in range(gen):
            token = int(np.argmax(ex.forward(session, [token])))
        tg.append(gen / (time.perf_counter() - start))
        ex.close_session(session)
    return pp, tg


def hf_eager(cfg, device: str, gen: int) -> float | None:
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn,
                         num_hidden_layers=cfg.num_blocks, num_attention_heads=cfg.heads,
                         num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                         tie_word_embeddings=cfg.tied_head)
    model = LlamaForCausalLM(hf_cfg).to(device=device.replace("cuda", "cuda"), dtype=torch.float16).eval()
    ids = torch.randint(4, 259, (1, 16), device=device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=gen, do_sample=False, min_new_tokens=gen)
        torch.cuda.synchronize()
    return gen / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-preset", default="smollm2-135m")
    ap.add_argument("-wtype", default="q4_1")
    ap.add_argument("-device", default="cuda:0")
    ap.add_argument("-reps", type=int, default=3)
    ap.add_argument("-pp", type=int, default=512)
    ap.add_argument("-tg", type=int, default=128)
    ap.add_argument("-cache", default="cache")
    ap.add_argument("-hf", action="store_true", help="also time HF transformers eager (f16)")
    args = ap.parse_args()

    from jitllm.model import load
    from jitllm.random_model import write_random_model

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.jlm"
        start = time.perf_counter()
        cfg = write_random_model(path, args.preset, args.wtype)
        print(f"wrote random {args.preset} {args.wtype} in {time.perf_counter() - start:.1f}s")
        model = load(path, devices=args.device, ctx=args.pp + args.tg + 16, cache_dir=args.cache)
        weight_bytes = sum(u.nbytes for u in model.executor.blocks) + model.executor.head.nbytes
        pp, tg = measure(model, args.pp, args.tg, args.reps)
    bw = copy_bandwidth(args.device)
    roofline = bw / weight_bytes
    med_tg = statistics.median(tg)
    print(f"jitllm {args.preset} {args.wtype} on {args.device}: pp{args.pp} {statistics.median(pp):.1f} t/s "
          f"(spread {min(pp):.1f}-{max(pp):.1f}), tg{args.tg} {med_tg:.1f} t/s (spread {min(tg):.1f}-{max(tg):.1f})")
    print(f"bytes read per token {weight_bytes / 2**20:.1f} MiB, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"roofline {roofline:.0f} t/s, decode at {100 * med_tg / roofline:.1f}% of roofline")
    if args.hf:
        hf = hf_eager(cfg, args.device, args.tg)
        if hf is not None:
            print(f"HF transformers eager f16 tg{args.tg}: {hf:.1f} t/s; jitllm / HF = {med_tg / hf:.2f}x")


if __name__ == "__main__":
    main()
