"""Which units' int8 activations move a prompt's first greedy token: jitllm's exact and fast CPU families mixed
unit by unit on the real model.

    python bench/first_token_units.py [-prompt TEXT] [-cache DIR]

The prompt (default: the README's quick start, through the chat template as `jitllm run` sends it) runs as
one prefill through the 30 blocks, each block taken from the exact model (f32 activations) or the fast one
(int8-quantized activations into every linear, the only kernels the families differ in), then the head's
decode program of either family on the last row. Prints the top three tokens and their logits for: all
exact, all fast, each family's blocks with the other's head, and every block alone swapped into the other
family. A first token that one block or the head alone can flip, both ways, is a near-tie of the f32
model, not a fault of one kernel. (Reaches into the engine's units and page tables: a diagnostic.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-prompt", default="What is the capital of France?")
    ap.add_argument("-cache", default="cache")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from jitllm.default_model import default_model_path
    from jitllm.model import load

    models = {k: load(default_model_path(), devices="cpu", ctx=512, cache_dir=args.cache, cpu_kernels=k)
              for k in ("exact", "fast")}
    ids = models["exact"].encode_prompt(args.prompt, chat=True)
    tok = models["exact"].tokenizer
    cos, sin = models["exact"].executor.rope
    n = len(ids)

    def first_tokens(blocks: list[str], head: str) -> list[tuple[str, float]]:
        sessions = {k: m.executor.new_session() for k, m in models.items()}
        for family, model in models.items():
            model.executor.ensure_room(sessions[family], n)
        h = None
        for i, family in enumerate(blocks):
            unit = models[family].executor.blocks[i]
            device, table = unit.device, sessions[family].tables[unit.index]
            h = device.upload(models[family].executor.embed(ids)[None]) if h is None else h
            program, past = unit.program_for(n), device.upload(np.array([0], np.int32))
            h, k, v = program.main(h, device.upload(cos[:n][None]), device.upload(sin[:n][None]), table.pool.pages,
                                   table.tensor(), past, *unit.weights)
            if program.append is not None:
                program.append(table.pool.pages, k, v, table.tensor(), past)
        unit = models[head].executor.head
        logits = unit.device.download(unit.program_for(1).main(unit.device.last_rows(h), *unit.weights))[0, -1]
        for family, model in models.items():
            model.executor.close_session(sessions[family])
        return [(tok.piece(int(t)), round(float(logits[t]), 3)) for t in np.argsort(logits)[::-1][:3]]

    count = len(models["exact"].executor.blocks)

    def one(family: str, other: str, i: int) -> list[str]:
        return [other] * i + [family] + [other] * (count - i - 1)

    exact, fast = ["exact"] * count, ["fast"] * count
    rows = [("all exact", exact, "exact"), ("all fast", fast, "fast"),
            ("exact blocks, fast head", exact, "fast"), ("fast blocks, exact head", fast, "exact")]
    rows += [(f"fast, block {i} exact", one("exact", "fast", i), "fast") for i in range(count)]
    rows += [(f"exact, block {i} fast", one("fast", "exact", i), "exact") for i in range(count)]
    print(f"prompt {args.prompt!r} (chat template, {n} tokens): top 3 first tokens (logit)")
    for name, blocks, head in rows:
        tops = first_tokens(blocks, head)
        print(f"{name:26s} " + "  ".join(f"{piece!r} {logit:.3f}" for piece, logit in tops), flush=True)


if __name__ == "__main__":
    main()
