"""Perplexity of jitllm's exact and fast CPU kernel families and of llama.cpp, same GGUF, same windows, one run.

    python bench/perplexity.py [-text FILE] [-c 512] [-chunks N] [-threads 2] [-cache DIR] [-transformers]

The built-in SmolLM2-135M-Instruct (Q4_1 GGUF; jitllm runs the .jlm converted from it) over the windows of
`jitllm perplexity` (llama-perplexity's method: non-overlapping windows of -c tokens, each from an empty
context, the second half scored; jitllm.perplexity). The text (default: the fixture tests/fixtures/
newton-opticks.txt, 32 windows of 512) is tokenized once by jitllm; llama.cpp (llama-cpp-python, its
logits_all mode) is fed the very same token ids and its logits are scored by the same code, so the
figures differ only by the logits. It also reports whether llama.cpp's own tokenization of the text
(add_special, no special parsing, as llama-perplexity does it) gives the same ids. `-transformers` adds
transformers' float32 model of the same GGUF (its weights dequantized) as a fourth figure.

`-decode` scores each window's second half one token a step instead (jitllm's and llama.cpp's decode
kernels, what a generation runs; transformers stays a prefill: float32 either way).

Prints each engine's PPL +/- its error, tokens/s (the machine may be shared: the speeds are not the
point), and the ratios fast/exact and fast/llama.cpp. Goal (issue 31, item 9): fast within 1% of exact and
no worse than llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "fixtures" / "newton-opticks.txt"


def jitllm_estimate(path: Path, kernels: str, chunks: list[list[int]], cache: str, decode: bool):
    import jitllm.model as jm
    from jitllm.perplexity import perplexity

    model = jm.load(path, devices="cpu", ctx=len(chunks[0]), cache_dir=cache, cpu_kernels=kernels)
    started = time.perf_counter()
    return perplexity(model.executor, chunks, decode=decode), time.perf_counter() - started


def llamacpp_estimate(gguf: Path, chunks: list[list[int]], threads: int, decode: bool):
    from llama_cpp import Llama

    from jitllm.perplexity import Estimate, scored_nll

    ctx = len(chunks[0])
    llm = Llama(model_path=str(gguf), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    estimate = Estimate()
    started = time.perf_counter()
    for window in chunks:
        llm.reset()  # (n_tokens 0: eval clears the KV cache from position 0)
        if decode:  # (the first half as one batch, then one token an eval; scores[p]: position p's logits)
            llm.eval(window[:ctx // 2])
            for p in range(ctx // 2, ctx - 1):
                llm.eval([window[p]])
        else:
            llm.eval(window)
        estimate.add(scored_nll(np.asarray(llm.scores[:ctx]), window, 0))
        estimate.windows += 1
    return estimate, time.perf_counter() - started, llm


def transformers_estimate(gguf: Path, chunks: list[list[int]], threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    from jitllm.perplexity import Estimate, scored_nll

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    estimate = Estimate()
    started = time.perf_counter()
    with torch.no_grad():
        for window in chunks:
            estimate.add(scored_nll(hf(torch.tensor([window])).logits[0].numpy(), window, 0))
            estimate.windows += 1
    return estimate, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-text", default=str(TEXT))
    ap.add_argument("-c", type=int, default=512)
    ap.add_argument("-chunks", type=int, default=None, help="the first N windows only (default all)")
    ap.add_argument("-threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", "2")))
    ap.add_argument("-cache", default=os.environ.get("JITLLM_CACHE_DIR", "cache"))
    ap.add_argument("-transformers", action="store_true", help="add transformers' float32 model of the GGUF")
    ap.add_argument("-decode", action="store_true",
                    help="score each window's second half one token a step (decode kernels), jitllm and llama.cpp")
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(ROOT))
    from jitllm.checked_model import open_checked
    from jitllm.default_model import default_gguf_path, default_model_path
    from jitllm.perplexity import windows

    gguf, path = default_gguf_path(), default_model_path()
    tok = open_checked(path).tokenizer
    text = Path(args.text).read_text(encoding="utf-8")
    tokens = tok.encode(text, add_special=True, parse_special=False)
    every = windows(tokens, args.c, tok.bos_token_id if tok.add_bos else None)
    chunks = every[:args.chunks] if args.chunks else every
    scored = len(chunks) * (args.c - args.c // 2 - 1)
    print(f"{Path(args.text).name}: {len(tokens)} tokens, {len(chunks)} windows of {args.c}, {scored} scored; "
          f"{args.threads} threads; scored {'by decode steps' if args.decode else 'by prefill'}")

    rows: dict[str, tuple] = {}
    estimate, seconds, llm = llamacpp_estimate(gguf, chunks, args.threads, args.decode)
    rows["llama.cpp"] = (estimate, seconds)
    same = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False) == tokens
    print(f"llama.cpp's own tokenization of the text: {'the same ids' if same else 'DIFFERENT ids'}")
    del llm
    for kernels in ("exact", "fast"):
        rows[f"jitllm {kernels}"] = jitllm_estimate(path, kernels, chunks, args.cache, args.decode)
    if args.transformers:
        rows["transformers f32"] = transformers_estimate(gguf, chunks, args.threads)

    print(f"{'engine':<18} {'PPL':>9} {'+/-':>8} {'tok/s':>8}")
    for name, (estimate, seconds) in rows.items():
        print(f"{name:<18} {estimate.ppl:9.4f} {estimate.error:8.5f} {len(chunks) * args.c / seconds:8.1f}")
    fast, exact, peer = (rows[k][0].ppl for k in ("jitllm fast", "jitllm exact", "llama.cpp"))
    print(f"fast / exact     = {fast / exact:.5f} ({(fast / exact - 1) * 100:+.3f}%)")
    print(f"fast / llama.cpp = {fast / peer:.5f} ({(fast / peer - 1) * 100:+.3f}%)")
    print(f"exact / llama.cpp = {exact / peer:.5f} ({(exact / peer - 1) * 100:+.3f}%)")


if __name__ == "__main__":
    main()
