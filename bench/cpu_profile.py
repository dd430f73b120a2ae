"""Profile of the per-token host path on the CPU: decode steps of the real model as `jitllm run` does them.

    python bench/cpu_profile.py [-jlm PATH] [-threads 2] [-steps 64] [-kernels fast] [-cache DIR] [-dump FILE] [-py-spy]

Loads the model on the host (`jitllm.model.load`, devices=cpu), prefills a short chat prompt, warms up,
then runs decode steps exactly as jitllm/runtime/engine/generation.py does: `token = sampler(logits)` followed by
`logits = executor.forward(session, [token])`, with `jitllm run`'s default sampling (temperature 0.8,
top-k 40, top-p 0.95; seeded). Stop tokens are ignored so every run makes the same number of steps.

Prints: per-step wall time of `-steps` unprofiled steps (median [min..max]), then the same number of
steps under cProfile: the top 15 functions by cumulative and by own (total) time, and the number of
Python-level function calls per step. With -py-spy (and py-spy installed) it also records the unprofiled
steps with py-spy (native frames off) into a speedscope file. The CPU time other processes used during the
measurement is printed: figures mean little on a busy machine.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import os
import pstats
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "What is the capital of France? Answer in one sentence."


def _busy() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process) now."""
    fields = list(map(int, open("/proc/stat").readline().split()[1:]))
    t = os.times()
    return sum(fields) - fields[3] - fields[4], int(round((t.user + t.system) * os.sysconf("SC_CLK_TCK")))


def _others(before: tuple[int, int], after: tuple[int, int], seconds: float) -> float:
    other = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, other / os.sysconf("SC_CLK_TCK") / max(seconds, 1e-9))


def load_model(args):
    """jitllm.model.load on the host; older trees lack the cpu_kernels argument (exact kernels only)."""
    import jitllm.model as jm

    params = inspect.signature(jm.load).parameters
    kwargs = {"devices": "cpu", "ctx": args.ctx, "cache_dir": args.cache}
    if "cpu_kernels" in params:
        kwargs["cpu_kernels"] = args.kernels
        kernels = args.kernels
    else:
        kernels = "exact (this tree has no other CPU kernels)"
    return jm.load(args.jlm, **kwargs), kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-jlm", default=None, help="model (default: the built-in SmolLM2-135M-Instruct)")
    ap.add_argument("-threads", type=int, default=2)
    ap.add_argument("-steps", type=int, default=64)
    ap.add_argument("-warmup", type=int, default=8)
    ap.add_argument("-kernels", default="fast", help="CPU kernel family where the tree has a choice")
    ap.add_argument("-cache", default="cache")
    ap.add_argument("-ctx", type=int, default=512)
    ap.add_argument("-seed", type=int, default=0)
    ap.add_argument("-top", type=int, default=15)
    ap.add_argument("-dump", default=None, help="also write the cProfile statistics to this file (pstats)")
    ap.add_argument("-py-spy", dest="py_spy", action="store_true", help="also record the steps with py-spy")
    args = ap.parse_args()

    sys.modules["torch"] = None  # tvm_ffi imports torch eagerly when installed; jitllm never uses it
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM's pool exists (works on every tree)
    sys.path.insert(0, str(ROOT))
    if args.jlm is None:
        from jitllm.default_model import default_model_path

        args.jlm = default_model_path()
    from jitllm.runtime.sampling import Sampler, SamplingParams

    t0 = time.perf_counter()
    model, kernels = load_model(args)
    print(f"loaded {args.jlm} in {time.perf_counter() - t0:.1f} s (compiles what {args.cache} lacks); "
          f"kernels {kernels}, {args.threads} threads, tree {ROOT}")
    ex = model.executor
    ids = model.encode_prompt(PROMPT, chat=True)
    sampler = Sampler(SamplingParams(0.8, 40, 0.95, args.seed))

    def steps(session, logits, count: int, times: list[float] | None = None):
        for _ in range(count):
            start = time.perf_counter()
            token = sampler(logits)
            logits = ex.forward(session, [token])
            if times is not None:
                times.append(time.perf_counter() - start)
        return logits

    # warm-up (thread pool, page pools, first calls), then the same history for every measured run
    session = ex.new_session()
    steps(session, ex.forward(session, ids), args.warmup)
    ex.close_session(session)

    session = ex.new_session()
    logits = ex.forward(session, ids)
    print(f"prompt {len(ids)} tokens; measuring decode steps {len(ids) + 1}..{len(ids) + args.steps}")
    times: list[float] = []
    before, t0 = _busy(), time.perf_counter()
    steps(session, logits, args.steps, times)
    others = _others(before, _busy(), time.perf_counter() - t0)
    ex.close_session(session)
    ms = [t * 1e3 for t in times]
    print(f"per step (no profiler, {args.steps} steps): median {statistics.median(ms):.2f} ms "
          f"[{min(ms):.2f}..{max(ms):.2f}], {1e3 / statistics.median(ms):.1f} tok/s; "
          f"other processes kept {others:.2f} CPUs busy")

    session = ex.new_session()
    logits = ex.forward(session, ids)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    steps(session, logits, args.steps)
    prof.disable()
    wall = time.perf_counter() - start
    ex.close_session(session)
    stats = pstats.Stats(prof)
    if args.dump:
        stats.dump_stats(args.dump)
    print(f"under cProfile: {wall / args.steps * 1e3:.2f} ms per step; "
          f"{stats.total_calls / args.steps:.0f} Python-level calls per step "
          f"({stats.prim_calls / args.steps:.0f} primitive)")
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats(order).print_stats(args.top)
        text = out.getvalue()
        print(f"\n--- top {args.top} by {order} ({args.steps} steps) ---")
        print(text[text.index("   ncalls"):].rstrip())

    if args.py_spy:
        py_spy(args, ex, ids, steps)


def py_spy(args, ex, ids, steps) -> None:
    """Sample `-steps` x 4 decode steps of this process with py-spy (native frames on: the kernels inside
    TVM's library show up by symbol) and print the top frames by own and by total samples."""
    import collections
    import shutil
    import subprocess

    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy is not installed (pip install py-spy)")
        return
    out = Path(args.cache) / "cpu_profile.pyspy.txt"
    session = ex.new_session()
    logits = ex.forward(session, ids)
    spy = subprocess.Popen([exe, "record", "--native", "-r", "500", "-f", "raw", "-o", str(out), "-p", str(os.getpid())],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)
    steps(session, logits, args.steps * 4)
    spy.send_signal(2)
    err = spy.communicate(timeout=60)[1]
    ex.close_session(session)
    if not out.exists():
        print(f"py-spy failed: {err.strip()[-500:]}")
        return
    own: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    place: collections.Counter = collections.Counter()
    samples = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [re.sub(r" \(.*/", " (", f) for f in stack.split(";")]
        if not any("steps (" in f for f in frames):
            continue  # the sleep before the steps, py-spy's own start-up
        n = int(count)
        samples += n
        own[frames[-1]] += n
        for f in set(frames):
            total[f] += n
        leaf = frames[-1]
        where = "Python code" if re.search(r":\d+\)$", leaf) else leaf.rpartition("(")[2].rstrip(")")
        place[where] += n
    print(f"\n--- py-spy --native: {samples} samples in {args.steps * 4} decode steps ({out}) ---")
    for title, counter in (("own", own), ("total", total), ("own (by library)", place)):
        print(f"top {args.top} by {title} samples:")
        for frame, n in counter.most_common(args.top):
            print(f"  {100 * n / max(samples, 1):5.1f}%  {frame}")


if __name__ == "__main__":
    main()
