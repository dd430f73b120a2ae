"""Logit differences of jitllm's CPU kernels against transformers in float32 on the real model.

    python bench/cpu_fast_vs_f32.py [-kernels fast,exact] [-n 32] [-cache DIR]

Needs torch and transformers (the reference dequantizes the same GGUF to f32). For each prompt of
tests/test_real_model_fast.py: transformers' greedy continuation of `-n` tokens is the shared history;
jitllm is fed the same tokens (teacher forcing) and its logits are compared with transformers' at every
position (prompt's last position and each generated one): the largest |logit difference| and every
position whose argmax differs, with transformers' margin between the two tokens there (a near-tie when
it is small). Then jitllm's own free-running greedy tokens are compared with transformers': the first
step where they part, and the margin there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [("The capital of France is", False), ("Why is the sky blue?", True),
           ("List three primary colors.", True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-kernels", default="fast,exact")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-cache", default="cache")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM

    import jitllm.model as jm
    from jitllm.default_model import default_gguf_path, default_model_path
    from jitllm.runtime.engine.generation import GenerationStats, generate_ids
    from jitllm.runtime.sampling import Sampler, SamplingParams

    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    for kernels in [k.strip() for k in args.kernels.split(",") if k.strip()]:
        model = jm.load(default_model_path(), devices="cpu", ctx=512, cache_dir=args.cache, cpu_kernels=kernels)
        print(f"== jitllm {kernels} kernels vs transformers f32 ({args.n} greedy tokens)")
        for text, chat in PROMPTS:
            ids = model.encode_prompt(text, chat=chat)
            with torch.no_grad():
                theirs = hf.generate(torch.tensor([ids]), max_new_tokens=args.n, do_sample=False, eos_token_id=None,
                                     pad_token_id=2)[0, len(ids):].tolist()
                ref = hf(torch.tensor([ids + theirs])).logits[0, len(ids) - 1:].numpy()
            ex = model.executor
            s = ex.new_session()
            ours = [ex.forward(s, ids)] + [ex.forward(s, [t]) for t in theirs[:-1]]
            ex.close_session(s)
            diffs = [float(np.abs(o - r).max()) for o, r in zip(ours, ref)]
            flips = []
            for step, (o, r) in enumerate(zip(ours, ref)):
                a, b = int(np.argmax(r)), int(np.argmax(o))
                if a != b:
                    flips.append(f"step {step}: f32 margin {float(r[a] - r[b]):.3f}")
            greedy = list(generate_ids(ex, ex.new_session(), ids, args.n, Sampler(SamplingParams(0.0)), set(),
                                       GenerationStats()))
            first = next((i for i, (a, b) in enumerate(zip(greedy, theirs)) if a != b), None)
            if first is None:
                parted = f"greedy tokens identical for {args.n} tokens"
            else:
                r = ref[first]
                parted = (f"greedy parts at token {first} (f32 margin there {float(r[theirs[first]] - r[greedy[first]]):.3f}"
                          f"; same history up to it)")
            print(f"{text!r} ({'chat' if chat else 'plain'}, {len(ids)} prompt tokens): max |dlogit| "
                  f"{max(diffs):.3g} (median over positions {np.median(diffs):.3g}); argmax flips under teacher "
                  f"forcing: {', '.join(flips) if flips else 'none'}; {parted}")


if __name__ == "__main__":
    main()
