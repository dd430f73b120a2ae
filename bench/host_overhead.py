"""Host work per decode token: everything `Executor.forward` does around a captured step, with the
step itself stubbed out (a recorder whose replay does nothing), so what is left is the Python, the
page bookkeeping, the input staging and the logits copy that a GPU decode step pays on the host.

    python bench/host_overhead.py [-preset llama-3.2-3b] [-tokens 400] [-reps 3]

The model has the preset's block count and vocabulary with tiny blocks (the cost does not depend on
their size); it runs on a simulated device. Prints the median microseconds per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-preset", default="llama-3.2-3b")
    ap.add_argument("-tokens", type=int, default=400)
    ap.add_argument("-reps", type=int, default=3)
    ap.add_argument("-cache", default="cache")
    args = ap.parse_args()

    from jitllm.model import load
    from jitllm.random_model import PRESETS, write_random_model
    from jitllm.runtime.backends.fake import ReplayRecorder, simulated_device

    class Stubbed(ReplayRecorder):
        def capture(self, body):
            graph, output = super().capture(body)
            graph.replay = lambda: None
            return graph, output

    shape = PRESETS[args.preset]
    ctx = 4 * (args.tokens + 64)  # page pools sized for a quarter of it: no pool growth while timing
    cfg = dataclasses.replace(PRESETS["tiny"], num_blocks=shape.num_blocks, vocab=shape.vocab, context=ctx)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.jlm"
        write_random_model(path, cfg, "f16")
        sim = simulated_device("sim")
        sim.graphs = Stubbed()
        model = load(path, devices="cpu", ctx=ctx, cache_dir=args.cache, extra_devices=[sim], cpu_kernels="exact")
    model.move("*", "sim")
    model.move("head", "sim")
    ex = model.executor
    rates = []
    for _ in range(args.reps):
        session = ex.new_session()
        ex.forward(session, [5, 6, 7])
        start = time.perf_counter()
        for _ in range(args.tokens):
            ex.forward(session, [8])
        rates.append((time.perf_counter() - start) / args.tokens)
        ex.close_session(session)
    print(f"host work per decode token, {cfg.num_blocks} blocks, vocab {cfg.vocab} ({args.preset}): "
          f"median {1e6 * statistics.median(rates):.1f} us (spread {1e6 * min(rates):.1f}-{1e6 * max(rates):.1f})")


if __name__ == "__main__":
    main()
