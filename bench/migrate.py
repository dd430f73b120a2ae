"""Migration latency: move one block with 1k/4k/16k tokens of KV history between the host and a
device (and back), against a plain copy of the same bytes measured in the same run.

    python3 bench/migrate.py [-device cuda:0] [-presets smollm2-135m,llama-3.2-3b] [-wtype f16]
    python3 bench/migrate.py -source cuda:0 -device cuda:1     # two GPUs: device-to-device moves
    python3 bench/migrate.py -kv f32                            # the KV cache type (default f16, as `run -ctk`)

Two baselines: a plain copy from (or into a fresh allocation of) ordinary host memory, and the same
copy between the memory a move itself uses (page-locked host memory while a CUDA device is in use,
`JITLLM_PINNED_HOST=0` turns that off), destination allocated per copy as in a move.
Without a GPU, -device sim runs the same code between the host and a simulated device (both in host
memory). The model is a 2-block random model of the preset's block shape; the KV history is allocated
page by page as a real session would hold it (its values are irrelevant to the copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _median_seconds(copy, source, dest, reps: int, unmeasured: int = 0) -> float:
    """Median time of `copy()` over `reps` calls after `unmeasured` ones (which may allocate or lock
    memory the later calls reuse), waiting for both sides around each (a copy with page-locked memory
    runs asynchronously on the GPU's stream)."""
    times = []
    for _ in range(reps + unmeasured):
        source.synchronize()
        dest.synchronize()
        start = time.perf_counter()
        moved = copy()
        source.synchronize()
        dest.synchronize()
        times.append(time.perf_counter() - start)
        del moved
    return statistics.median(times[unmeasured:])


def plain_copy_seconds(nbytes: int, source, dest, reps: int = 5) -> float:
    """Time to copy `nbytes` as one contiguous tensor from `source` to `dest` (TVM copy from ordinary
    host memory, or into a fresh ordinary allocation)."""
    src = source.upload(np.zeros(nbytes // 4, np.float32))
    return _median_seconds(lambda: src.copyto(dest.backend.tvm_device), source, dest, reps)


def locked_copy_seconds(nbytes: int, source, dest, reps: int = 5) -> float:
    """The same copy between the memory a move uses: each side's `empty` (on the host, page-locked
    memory from the pool while a CUDA device is in use), the destination allocated per copy as a move does."""
    src = source.empty((nbytes,), "uint8")
    src.copyfrom(np.zeros(nbytes, np.uint8))

    def copy():
        moved = dest.empty((nbytes,), "uint8")
        moved.copyfrom(src)
        return moved

    return _median_seconds(copy, source, dest, reps, unmeasured=1)  # the pool serves all but the first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-device", default="cuda:0")
    ap.add_argument("-source", default="host",
                    help="where the block starts and comes back to: host, or another device (cuda:1 for two GPUs)")
    ap.add_argument("-presets", default="smollm2-135m,llama-3.2-3b")
    ap.add_argument("-wtype", default="f16")
    ap.add_argument("-history", default="1024,4096,16384")
    ap.add_argument("-cache", default="cache")
    ap.add_argument("-reps", type=int, default=3)
    ap.add_argument("-kv", default="f16", help="KV cache type (f32, f16 or q8_0)")
    ap.add_argument("-phases", action="store_true",
                    help="after each row, the median milliseconds of each phase of the move")
    args = ap.parse_args()

    from jitllm.model import load
    from jitllm.random_model import PRESETS, write_random_model
    from jitllm.runtime.backends.fake import simulated_device
    from jitllm.runtime.engine.kv_pages import PageTable

    histories = [int(h) for h in args.history.split(",")]
    print(f"{'shape':<14} {'history':>7} {'direction':<18} {'weights MiB':>11} {'KV MiB':>8} "
          f"{'move ms':>8} {'copy ms':>8} {'ratio':>6} {'locked copy ms':>14} {'ratio':>6}")
    for preset in args.presets.split(","):
        cfg = dataclasses.replace(PRESETS[preset], num_blocks=2, context=max(histories) + 64)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "m.jlm"
            write_random_model(path, cfg, args.wtype)
            extra = [simulated_device("sim")] if args.device == "sim" else []
            if args.device == "sim":
                devices = "cpu"
            else:
                devices = args.device if args.source == "host" else f"{args.source},{args.device}"
            model = load(path, devices=devices, placement=f"*={args.source},head={args.source}",
                         ctx=max(histories) + 64, cache_dir=args.cache, extra_devices=extra, cpu_kernels="exact",
                         kv_type=args.kv)
        ex = model.executor
        home, dev = model.devices[args.source], model.devices[args.device]
        for history in histories:
            session = ex.new_session()
            for unit in ex.blocks:
                table = PageTable(ex.pool(unit.device))
                table.ensure(history)
                session.tables[unit.index] = table
            session.length = history
            for direction, target in ((f"{home.name} -> {dev.name}", dev.name),
                                      (f"{dev.name} -> {home.name}", home.name)):
                moves, copies, locked = [], [], []
                phases = []
                for _ in range(args.reps):
                    if direction.startswith(dev.name):
                        model.move("0", dev.name)
                    report = model.move("0", target)[0]
                    phases.append(dict(report.phases))
                    moves.append(report.seconds)
                    src, dst = (home, dev) if target == dev.name else (dev, home)
                    copies.append(plain_copy_seconds(report.weight_bytes + report.kv_bytes, src, dst))
                    locked.append(locked_copy_seconds(report.weight_bytes + report.kv_bytes, src, dst))
                    if target == dev.name:
                        model.move("0", home.name)
                move_ms, copy_ms = 1e3 * statistics.median(moves), 1e3 * statistics.median(copies)
                locked_ms = 1e3 * statistics.median(locked)
                print(f"{preset:<14} {history:>7} {direction:<18} {report.weight_bytes / 2**20:>11.1f} "
                      f"{report.kv_bytes / 2**20:>8.1f} {move_ms:>8.2f} {copy_ms:>8.2f} {move_ms / copy_ms:>6.2f} "
                      f"{locked_ms:>14.2f} {move_ms / locked_ms:>6.2f}")
                if args.phases:
                    print("    phases ms: " + ", ".join(f"{name} {1e3 * statistics.median(p[name] for p in phases):.2f}"
                                                   for name in phases[0]))
            ex.close_session(session)


if __name__ == "__main__":
    main()
