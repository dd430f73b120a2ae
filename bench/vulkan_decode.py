"""Decode and prefill through Vulkan (the webgpu target on wgpu) beside a peer device (the host's exact
kernels, or CUDA on the same card) in the same run, with what a decode token costs the host: dispatches,
submits, queue writes, reads (and their wait for the device), buffers and bind groups created, and the
host microseconds per token spent encoding, submitting, writing and outside the device wait.

    python3 bench/vulkan_decode.py [MODEL.jlm] [-preset smollm2-135m -wtype q4_1] [-device vulkan:0]
                                   [-peer cpu|cuda:0] [-n 128] [-prompt 32] [-reps 3] [-cache DIR] [-cprofile]
                                   [-profile [timestamps|submit]] [-pipeline-threads N]

Without MODEL, a random-weight model of `-preset`/`-wtype` (default: tiny q4_1). tg is `jitllm speed`'s
code path (Executor.greedy_tokens, median of -reps); the counts come from -n further greedy steps. On
lavapipe the device runs inside the submit (so "submit" holds the device time there, not "wait").
Greedy tokens are compared with the host's exact kernels (the first 16). On lavapipe (Mesa's CPU Vulkan)
kernel times are CPU emulation; the host-side counts and microseconds are real.

-profile times each dispatch of -n further decode steps (backends/wgpu_profile.py; a slower, profiling-only
encoding: the rates and counts above are measured without it) and prints, per kernel and workgroup grid,
its dispatches, microseconds and share of a token: `timestamps` (the default) on the device, from
timestamp queries; `submit` (where the adapter has no timestamps) on the host, each dispatch submitted
alone and waited for, so its submit and map are included.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

COUNTED = ("dispatches", "submits", "writes", "reads", "buffers", "bind_groups", "pipelines")
TIMED = ("encode_seconds", "submit_seconds", "write_seconds", "read_seconds", "wait_seconds")


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    ex = model.executor
    session = ex.new_session()
    token = ex.next_token(session, prompt)
    tokens = [token, *ex.greedy_tokens(session, token, steps - 1)]
    ex.close_session(session)
    return tokens


def rates(model, prompt: int, n: int, reps: int) -> tuple[float, float]:
    """(pp tokens/s, tg tokens/s) as `jitllm speed` measures them (medians of `reps`)."""
    from jitllm.speed import decode_speed, prefill_speed

    return prefill_speed(model, prompt, reps).median, decode_speed(model, n, reps).median


def warm_session(model):
    """A session past its prompt and first greedy steps (those record and capture), and its last token."""
    ex = model.executor
    session = ex.new_session()
    token = ex.next_token(session, list(range(4, 20)))
    *_, token = ex.greedy_tokens(session, token, 4)
    return session, token


def profiled_steps(model, backend, mode: str, n: int) -> list[tuple[str, float, float, float]]:
    """wgpu_profile.table of `n` greedy decode steps (tg's code path) timed by a `mode` timer."""
    from jitllm.runtime.backends.wgpu_profile import table, timer

    session, token = warm_session(model)
    backend.timer = timer(mode, backend)
    try:
        for _ in model.executor.greedy_tokens(session, token, n):
            pass
        entries = backend.timer.entries()
    finally:
        backend.timer = None
    model.executor.close_session(session)
    return table(entries, n)


def counted_steps(model, stats: dict, n: int, profile: bool) -> tuple[float, dict]:
    """(seconds per step, what `stats` counted per step) over `n` greedy decode steps (tg's code path,
    pipelined where the model allows), after a warm run that captures the steps."""
    ex = model.executor
    session, token = warm_session(model)
    before = dict(stats)
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    for _ in ex.greedy_tokens(session, token, n):
        pass
    if profiler:
        profiler.disable()
    wall = (time.perf_counter() - start) / n
    ex.close_session(session)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    return wall, {k: (stats[k] - before[k]) / n for k in COUNTED + TIMED}


def main() -> None:
    from jitllm.model import load
    from jitllm.random_model import write_random_model

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("-preset", default="tiny")
    ap.add_argument("-wtype", default="q4_1")
    ap.add_argument("-device", default="vulkan:0")
    ap.add_argument("-peer", default="cpu", help="cpu (the host's exact kernels) or a GPU, e.g. cuda:0")
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("-prompt", type=int, default=32)
    ap.add_argument("-reps", type=int, default=1, help="0: only the counts (no rates, no peer)")
    ap.add_argument("-cache", default=None)
    ap.add_argument("-ctx", type=int, default=1024)
    ap.add_argument("-cprofile", action="store_true", help="cProfile the counted steps (top 18 by own time)")
    ap.add_argument("-profile", nargs="?", const="timestamps", default=None, metavar="MODE",
                    help="time each dispatch of -n decode steps: timestamps (on the device) or submit")
    ap.add_argument("-pipeline-threads", type=int, default=None,
                    help="pipelines created at once at load (default: the backend's PIPELINE_THREADS)")
    args = ap.parse_args()
    if args.pipeline_threads:
        from jitllm.runtime.backends import wgpu as wgpu_backend

        wgpu_backend.PIPELINE_THREADS = args.pipeline_threads
    path = Path(args.model) if args.model else Path(tempfile.mkdtemp()) / f"{args.preset}-{args.wtype}.jlm"
    if not args.model:
        write_random_model(path, args.preset, args.wtype, seed=1)
    common = dict(cache_dir=args.cache, ctx=args.ctx)
    start = time.perf_counter()
    vk = load(path, devices=args.device, no_gpu_fallback=True, **common)
    load_s = time.perf_counter() - start
    stats = vk.devices[args.device].backend.stats
    if args.profile:  # (a mode the adapter cannot do: one line before anything is measured)
        from jitllm.core.errors import JitllmError
        from jitllm.runtime.backends.wgpu_profile import timer

        try:
            timer(args.profile, vk.devices[args.device].backend)
        except JitllmError as e:
            raise SystemExit(str(e)) from None
    from jitllm.runtime.backends.wgpu import PIPELINE_THREADS

    print(f"load on {args.device}: {load_s:.1f}s, of which {stats['pipelines']} pipelines created in "
          f"{stats['pipeline_seconds']:.2f}s, {PIPELINE_THREADS} at a time (wgpu offers no pipeline cache; "
          f"the driver's own disk cache may hold them)")
    if args.reps:
        peer = load(path, devices=args.peer, **common, **({"cpu_kernels": "exact"} if args.peer == "cpu" else {}))
        host = peer if args.peer == "cpu" else load(path, devices="cpu", cpu_kernels="exact", **common)
        prompt = list(range(4, 4 + args.prompt))
        vk_tokens, host_tokens = greedy(vk, prompt, 16), greedy(host, prompt, 16)
        vk_pp, vk_tg = rates(vk, args.prompt, args.n, args.reps)
        peer_pp, peer_tg = rates(peer, args.prompt, args.n, args.reps)
        print(f"pp{args.prompt}: {args.device} {vk_pp:.1f} tok/s, {args.peer} {peer_pp:.1f} tok/s")
        print(f"tg{args.n}: {args.device} {vk_tg:.1f} tok/s ({1e3 / vk_tg:.2f} ms/token), {args.peer} {peer_tg:.1f} "
              f"tok/s ({1e3 / peer_tg:.2f} ms/token), ratio {vk_tg / peer_tg:.3f}")
        print(f"greedy tokens identical to the host's exact kernels (16): {vk_tokens == host_tokens}"
              + ("" if vk_tokens == host_tokens else f" ({vk_tokens} vs {host_tokens})"))
    wall, per = counted_steps(vk, stats, args.n, args.cprofile)
    print(f"per decode token on {args.device} ({wall * 1e3:.2f} ms a step): "
          + ", ".join(f"{per[k]:.2f} {k}" for k in COUNTED))
    print("  host us per token: " + ", ".join(f"{k.replace('_seconds', '')} {per[k] * 1e6:.0f}" for k in TIMED)
          + f"; outside the device wait {(wall - per['wait_seconds']) * 1e6:.0f}"
          + f" ({per['encode_seconds'] / max(per['dispatches'], 1) * 1e6:.2f} us encoding a dispatch)")
    if args.profile:
        print_profile(profiled_steps(vk, vk.devices[args.device].backend, args.profile, args.n), args.profile,
                      per["wait_seconds"])


def print_profile(rows: list[tuple[str, float, float, float]], mode: str, wait: float) -> None:
    what = "device us (timestamps)" if mode == "timestamps" else "host us (each submitted alone and waited for)"
    width = max([len(row[0]) for row in rows] + [6])
    print(f"profile per decode token, {what}:")
    print(f"  {'kernel':<{width}}  {'dispatches':>10}  {'us':>9}  {'share':>6}")
    for label, count, micros, share in rows:
        print(f"  {label:<{width}}  {count:>10.2f}  {micros:>9.1f}  {share:>6.1%}")
    print(f"  {'total':<{width}}  {sum(r[1] for r in rows):>10.2f}  {sum(r[2] for r in rows):>9.1f}"
          f"  (the unprofiled steps waited {wait * 1e6:.0f} us a token for the device)")


if __name__ == "__main__":
    main()
