"""The KV cache types against f32 (-ctk/-ctv f16, q8_0): a decode step at a long history, and a move of one
block with that history (host -> a simulated device and back), every KV type measured in the same run.

    python3 bench/kv_types.py [-model PATH] [-kv f32,f16,q8_0] [-history 8064] [-steps 8] [-reps 3]
                              [-kernels exact] [-cache DIR]
    python3 bench/kv_types.py -devices cuda:0 -move-to cuda:0     # on a GPU

The history is allocated page by page as a real session holds it (its values, zeros, are irrelevant to
the time), so no 8k-token prefill runs. Decode: the median of `-steps` single-token steps, after one
unmeasured. Move: the median over `-reps` round trips of the one-way time each way. Without a GPU the
move is host memory to host memory (a simulated device), i.e. the page export / copy / import cost.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _decode_ms(model, history: int, steps: int) -> float:
    from jitllm.runtime.engine.kv_pages import PageTable

    ex = model.executor
    session = ex.new_session()
    for unit in ex.blocks:
        table = PageTable(ex.pool(unit.device), arena=session.arena(unit.device))
        table.ensure(history + steps + 1)
        session.tables[unit.index] = table
    session.length, session.tokens = history, [0] * history
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        ex.forward(session, [1 + i])
        times.append(time.perf_counter() - start)
    ex.close_session(session)
    return 1e3 * statistics.median(times[1:])


def _move_ms(model, history: int, dest: str, reps: int) -> tuple[float, float, float]:
    """(to dest ms, back ms, KV MiB moved) of block 0 with `history` positions of one session."""
    from jitllm.runtime.engine.kv_pages import PageTable

    ex = model.executor
    home = ex.blocks[0].device.name
    session = ex.new_session()
    for unit in ex.blocks:
        table = PageTable(ex.pool(unit.device), arena=session.arena(unit.device))
        table.ensure(history)
        session.tables[unit.index] = table
    session.length = history
    there, back, kv = [], [], 0
    for _ in range(reps):
        report = model.move("0", dest)[0]
        there.append(report.seconds)
        kv = report.kv_bytes
        back.append(model.move("0", home)[0].seconds)
    ex.close_session(session)
    return 1e3 * statistics.median(there), 1e3 * statistics.median(back), kv / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-model", default=None, help="a .jlm (default: the built-in SmolLM2-135M)")
    ap.add_argument("-kv", default="f32,f16,q8_0", help="KV types, the first the base of the ratios")
    ap.add_argument("-history", type=int, default=8064)
    ap.add_argument("-steps", type=int, default=8)
    ap.add_argument("-reps", type=int, default=3)
    ap.add_argument("-kernels", default="exact", help="the host's kernel family")
    ap.add_argument("-devices", default="cpu")
    ap.add_argument("-move-to", dest="move_to", default="sim")
    ap.add_argument("-cache", default="cache")
    args = ap.parse_args()

    from jitllm.default_model import default_model_path
    from jitllm.model import load
    from jitllm.runtime.backends.fake import simulated_device

    path = args.model or str(default_model_path())
    rows = {}
    for kv_type in args.kv.split(","):
        extra = [simulated_device("sim")] if args.move_to == "sim" else []
        model = load(path, devices=args.devices, ctx=args.history + args.steps + 8, cache_dir=args.cache,
                     cpu_kernels=args.kernels, kv_type=kv_type, extra_devices=extra)
        decode = _decode_ms(model, args.history, args.steps)
        there, back, kv = _move_ms(model, args.history, args.move_to, args.reps)
        rows[kv_type] = (decode, there, back, kv)
        print(f"kv {kv_type}: decode at {args.history} history {decode:.2f} ms/token; move of block 0 "
              f"({kv:.1f} MiB KV) -> {args.move_to} {there:.2f} ms, back {back:.2f} ms", flush=True)
        del model
    base = next(iter(rows))
    d0, t0, b0, _ = rows[base]
    for kv_type, (d, t, b, _) in list(rows.items())[1:]:
        print(f"{base} / {kv_type}: decode {d0 / d:.2f}x, move there {t0 / t:.2f}x, back {b0 / b:.2f}x")


if __name__ == "__main__":
    main()
