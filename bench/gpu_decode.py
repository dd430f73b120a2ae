"""GPU decode/prefill speed of jitllm on random-weight models of named shapes, with the bandwidth
roofline and HF transformers (eager) measured in the same run. Run on the GPU machine:

    python3 bench/gpu_decode.py [-preset smollm2-135m -wtype q4_1] [-device cuda:0] [-reps 3]
                                [-histories 1024,8192,32768] [-llamacpp bench/llamacpp/out.json]

Prints pp512 and tg128 tokens/s (median and spread of the repetitions; the code path of `jitllm speed`),
bytes read per token, the copy bandwidth and roofline tokens/s, decode speed at long histories, and
the ratios, against llama.cpp's llama-bench JSON measured in the same lease when given.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path



def random_model(preset: str, wtype: str, tmp: str):
    """(path, config) of a random-weight model; written once into $JITLLM_BENCH_MODELS when that is set
    (a 3B model takes over a minute to write), else into `tmp`."""
    from jitllm.random_model import PRESETS, write_random_model

    keep = os.environ.get("JITLLM_BENCH_MODELS")
    path = Path(keep or tmp) / f"{preset}-{wtype}.jlm"
    if path.exists():
        return path, PRESETS[preset]
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cfg = write_random_model(path, preset, wtype)
    print(f"wrote random {preset} {wtype} in {time.perf_counter() - start:.1f}s")
    return path, cfg


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


def report_llamacpp(path: str, preset: str, wtype: str, pp: float, tg: float) -> None:
    """Ratios against llama-bench's entries for the same shape and type (JSON written by bench/llamacpp)."""
    import json

    entries = [e for e in json.loads(Path(path).read_text()) if e.get("jitllm_model") == f"{preset}:{wtype}"]
    if not entries:
        print(f"llama.cpp: no {preset}:{wtype} entry in {path}")
    for e in entries:
        gen = e.get("n_gen", 0)
        test, ours = (f"tg{gen}", tg) if gen else (f"pp{e['n_prompt']}", pp)
        print(f"llama.cpp {preset} {wtype} {test}: {e['avg_ts']:.1f} ± {e['stddev_ts']:.1f} t/s; "
              f"jitllm / llama.cpp = {ours / e['avg_ts']:.2f}x")


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
    ap.add_argument("-gpu-kernels", dest="gpu_kernels", default="fast", choices=("fast", "exact"),
                    help="decode matvecs over quantized weights: int8 activations (fast) or f32 (exact)")
    ap.add_argument("-hf", action="store_true", help="also time HF transformers eager (f16)")
    ap.add_argument("-histories", default="", help="also decode at these history lengths, e.g. 1024,8192,32768")
    ap.add_argument("-llamacpp", default=None, help="llama-bench JSON (bench/llamacpp) of the same lease")
    args = ap.parse_args()

    from jitllm.model import load
    from jitllm.speed import decode_speed, prefill_speed, table, weight_bytes

    with tempfile.TemporaryDirectory() as tmp:
        path, cfg = random_model(args.preset, args.wtype, tmp)
        histories = [int(h) for h in args.histories.split(",") if h]
        ctx = max([args.pp + args.tg + 16] + [h + args.tg + 16 for h in histories])
        model = load(path, devices=args.device, ctx=ctx, cache_dir=args.cache, gpu_kernels=args.gpu_kernels)
        wbytes = weight_bytes(model)
        pp = prefill_speed(model, args.pp, args.reps)
        load_before = os.getloadavg()[0]
        tg = decode_speed(model, args.tg, args.reps)
        load_after = os.getloadavg()[0]
        long = [decode_speed(model, 32, args.reps, history=h) for h in histories]
        name = f"{args.preset} {args.wtype}"
        print(table(name, model, [pp, tg, *long]))
        model.executor.graphs = False
        eager = decode_speed(model, args.tg, args.reps)
        model.executor.graphs = True
        print(f"decode without graphs (one VM call per block): tg{args.tg} median {eager.median:.1f} t/s; "
              f"graphs {tg.median / eager.median:.2f}x")
    bw = copy_bandwidth(args.device.split(",")[0])  # a device list (cuda:0,cuda:1) splits the blocks; its first card
    roofline = bw / wbytes
    med_tg = tg.median
    print(f"jitllm {name} on {args.device}: pp{args.pp} median {pp.median:.1f} t/s (spread {min(pp.rates):.1f}-"
          f"{max(pp.rates):.1f}), tg{args.tg} median {med_tg:.1f} t/s (spread {min(tg.rates):.1f}-{max(tg.rates):.1f})")
    print(f"host load average around tg{args.tg}: {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs "
          "(a decode step includes host work: a busy host lowers tg)")
    print(f"bytes read per token {wbytes / 2**20:.1f} MiB, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"roofline {roofline:.0f} t/s, decode at {100 * med_tg / roofline:.1f}% of roofline")
    cfg, ex = model.executor.layout.config, model.executor
    pool = ex.pools[ex.blocks[0].device.name]  # (f16 KV by default)
    kv_dtype = pool.kv_type
    for h, r in zip(histories, long):
        kv = cfg.num_blocks * h * pool.page_bytes // pool.page_size
        print(f"decode at history {h}: median {r.median:.1f} t/s ({1e3 / r.median:.2f} ms/token); roofline with "
              f"{kv / 2**20:.0f} MiB of {kv_dtype} KV {bw / (wbytes + kv):.0f} t/s ({100 * r.median * (wbytes + kv) / bw:.1f}%)")
    if args.llamacpp:
        report_llamacpp(args.llamacpp, args.preset, args.wtype, pp.median, med_tg)
    if args.hf:
        hf = hf_eager(cfg, args.device, args.tg)
        if hf is not None:
            print(f"HF transformers eager f16 tg{args.tg}: {hf:.1f} t/s; jitllm / HF = {med_tg / hf:.2f}x")


if __name__ == "__main__":
    main()
