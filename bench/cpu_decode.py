"""CPU prefill/decode speed of jitllm against llama.cpp (llama-cpp-python) on the same GGUF, measured in
the same run, with the memory roofline:

    python bench/cpu_decode.py [-gguf PATH] [-threads 2] [-reps 3] [-kernels fast,exact] [-cache DIR]
    python bench/cpu_decode.py -hog 0,1,2 -pp 64 -tg 32     # decode beside 0, 1 and 2 busy processes

pp512: one forward of a 512-token prompt. tg128: 128 single-token greedy steps after a 1-token prompt
(llama-bench's definition: generation from an empty context). Each side runs in its own subprocess
(its thread pool spins between kernels and would steal CPU from the other side), the sides alternate
per repetition, and each reports its peak RSS. jitllm uses the TVM thread pool with `-threads` threads,
llama.cpp `n_threads = n_threads_batch = -threads`. Without llama-cpp-python only jitllm runs (said so).

Roofline: bytes read per decode step (all weights + the mean KV history of tg128, in the pool's KV type) over the
read bandwidth measured in the same run (numpy sum over 1 GiB, one thread, and a TVM parallel sum
with `-threads` threads; the higher is the roofline). The CPU time other processes used during each
side's run is printed: the numbers mean little on a busy machine. The jitllm process blocks the import
of torch (tvm_ffi imports it eagerly when installed, ~200 MiB of RSS jitllm never uses); -with-torch
measures it as `jitllm run` behaves where torch is installed.

-hog N,M,...: the same measurements with N (then M, ...) competing CPU-bound processes running (bench/cpu_load.py:
each spins for at most -hog-seconds and is killed when its level ends), then a table of each side's speed per
load level, its loaded/unloaded ratio and jitllm against llama.cpp. The jitllm side inherits the environment
(TVM_THREAD_POOL_SPIN_COUNT, TVM_BIND_THREADS); -jitllm-threads gives it its own worker count (a list: one
jitllm side per count, in the same run).

-isas avx2,avx512vnni: one jitllm side per kernel instruction set (JITLLM_CPU_ISA in its environment; each
compiled before the measurements), alternating with the others in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from cpu_load import hogs

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------
# side runners (each in its own process)


def _cpu_busy_sample() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process) now."""
    fields = list(map(int, open("/proc/stat").readline().split()[1:]))
    total_busy = sum(fields) - fields[3] - fields[4]
    t = os.times()
    own = int(round((t.user + t.system) * os.sysconf("SC_CLK_TCK")))
    return total_busy, own


def _others_busy(before: tuple[int, int], after: tuple[int, int], seconds: float) -> float:
    """Mean number of CPUs other processes kept busy between two samples."""
    hz = os.sysconf("SC_CLK_TCK")
    other = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, other / hz / max(seconds, 1e-9))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_jitllm(args) -> dict:
    if not args.with_torch:
        # tvm_ffi imports torch whenever it is installed (+~200 MiB RSS); jitllm never uses it
        sys.modules["torch"] = None
    sys.path.insert(0, str(ROOT))
    import jitllm.model as jm

    model = jm.load(args.jlm, devices="cpu", ctx=args.pp + args.tg + 16, cache_dir=args.cache,
                    cpu_kernels=args.kernels, threads=args.threads)
    ex = model.executor
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(100, 40000, args.pp)]
    # warm-up: page pools, thread pool, caches
    s = ex.new_session()
    ex.forward(s, prompt[:64])
    for _ in range(4):
        ex.forward(s, [prompt[0]])
    ex.close_session(s)
    before, t0 = _cpu_busy_sample(), time.perf_counter()
    s = ex.new_session()
    start = time.perf_counter()
    ex.forward(s, prompt)
    pp = args.pp / (time.perf_counter() - start)
    ex.close_session(s)
    s = ex.new_session()
    token = int(np.argmax(ex.forward(s, [1])))
    start = time.perf_counter()
    for _ in range(args.tg):
        token = int(np.argmax(ex.forward(s, [token])))
    tg = args.tg / (time.perf_counter() - start)
    ex.close_session(s)
    others = _others_busy(before, _cpu_busy_sample(), time.perf_counter() - t0)
    weights = sum(u.nbytes for u in ex.blocks) + ex.head.nbytes
    cfg = model.layout.config
    pool = ex.pools[ex.blocks[0].device.name]  # (f16 KV by default; q8_0 rows carry their scales)
    kv_token = cfg.num_blocks * pool.page_bytes // pool.page_size
    return {"pp": pp, "tg": tg, "rss": _peak_rss(), "others": others,
            "bytes_per_token": weights + kv_token * (args.tg / 2 + 1)}


def run_llama(args) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(args.gguf), n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=args.pp + args.tg + 16, n_batch=args.pp + args.tg + 16, n_ubatch=args.pp, verbose=False)
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(100, 40000, args.pp)]
    llm.reset()
    llm.eval(prompt[:64])
    llm.reset()
    before, t0 = _cpu_busy_sample(), time.perf_counter()
    start = time.perf_counter()
    llm.eval(prompt)
    pp = args.pp / (time.perf_counter() - start)
    llm.reset()
    llm.eval([1])
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    start = time.perf_counter()
    for _ in range(args.tg):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    tg = args.tg / (time.perf_counter() - start)
    others = _others_busy(before, _cpu_busy_sample(), time.perf_counter() - t0)
    return {"pp": pp, "tg": tg, "rss": _peak_rss(), "others": others}


# ---------------------------------------------------------------------------------------------------
# orchestration


def run_bandwidth(args) -> dict:
    """Read bandwidth of a TVM parallel sum over 1 GiB with the TVM thread pool."""
    sys.path.insert(0, str(ROOT))
    from jitllm.lowering.targets.llvm import LlvmTarget
    from jitllm.runtime.workers import host_workers

    host_workers(args.threads)
    import tvm
    from tvm.script import tirx as T

    C, L = 4096, 1 << 16

    @T.prim_func
    def psum(a: T.Buffer((C, L), "float32"), out: T.Buffer((C, 8), "float32")):
        T.func_attr({"global_symbol": "psum", "tirx.noalias": True})
        for c in T.parallel(C):
            for r in T.vectorized(8):
                out[c, r] = T.float32(0)
            for i in T.serial(L // 8):
                for r in T.vectorized(8):
                    out[c, r] = out[c, r] + a[c, i * 8 + r]

    f = tvm.compile(tvm.IRModule({"psum": psum}), target=LlvmTarget().tvm_target())["psum"]
    a = tvm.runtime.tensor(np.ones((C, L), np.float32))
    o = tvm.runtime.tensor(np.zeros((C, 8), np.float32))
    f(a, o)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        f(a, o)
        best = max(best, C * L * 4 / (time.perf_counter() - start))
    return {"bandwidth": best}


def read_bandwidth(args) -> tuple[float, float | None]:
    """(numpy sum over 1 GiB, one thread; TVM parallel sum over 1 GiB with the thread pool) in bytes/s."""
    a = np.ones(1 << 28, np.float32)
    a.sum()
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        a.sum()
        best = max(best, a.nbytes / (time.perf_counter() - start))
    del a
    try:
        return best, side(args, "bandwidth")["bandwidth"]
    except RuntimeError:
        return best, None


def side(args, name: str, kernels: str | None = None, threads: int | None = None, isa: str | None = None) -> dict:
    threads = threads or args.threads
    cmd = [sys.executable, __file__, "-side", name, "-gguf", str(args.gguf), "-jlm", str(args.jlm),
           "-threads", str(threads), "-pp", str(args.pp), "-tg", str(args.tg), "-cache", str(args.cache),
           "-seed", str(args.seed)]
    if kernels:
        cmd += ["-kernels", kernels]
    if args.with_torch:
        cmd += ["-with-torch"]
    env = dict(os.environ)
    env.pop("TVM_NUM_THREADS", None)
    if isa:
        env["JITLLM_CPU_ISA"] = isa
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{name} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def measure(args, kernels: list[str], have_llama: bool) -> dict[str, list[dict]]:
    """-reps repetitions of each side, alternating."""
    workers = [int(t) for t in args.jitllm_threads.split(",")] if args.jitllm_threads else [args.threads]
    isas = _isas(args)
    named = {(f"jitllm {k}" + (f" {w}w" if len(workers) > 1 else "") + (f" {i}" if i else "")): (k, w, i)
             for k in kernels for w in workers for i in isas}
    results: dict[str, list[dict]] = {name: [] for name in named}
    if have_llama:
        results["llama.cpp"] = []
    for rep in range(args.reps):
        for name, (k, w, i) in named.items():
            results[name].append(side(args, "jitllm", k, w, i))
        if have_llama:
            results["llama.cpp"].append(side(args, "llama"))
        print(f"  repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    return results


def _isas(args) -> list[str | None]:
    """The -isas list (None: the jitllm side's own choice, JITLLM_CPU_ISA or the host's highest)."""
    return [i.strip() for i in args.isas.split(",") if i.strip()] if args.isas else [None]


def print_load_table(args, by_level: dict[int, dict[str, list[dict]]]) -> None:
    """Medians per load level, each side's loaded/unloaded ratio and jitllm against llama.cpp."""
    base = min(by_level)
    names = list(by_level[base])
    print(f"{'competing':>9s} {'side':24s} {'pp' + str(args.pp) + ' tok/s':>22s} {'tg' + str(args.tg) + ' tok/s':>22s}"
          f" {'tg vs ' + str(base) + ' hogs':>12s} {'others busy':>11s}")
    for level, results in by_level.items():
        for name in names:
            runs = results[name]
            tg = statistics.median(r["tg"] for r in runs)
            tg0 = statistics.median(r["tg"] for r in by_level[base][name])
            print(f"{level:9d} {name:24s} {summary([r['pp'] for r in runs]):>22s} {summary([r['tg'] for r in runs]):>22s}"
                  f" {tg / tg0:11.2f}x {max(r['others'] for r in runs):9.2f}cpu")
    if "llama.cpp" in names:
        for name in (n for n in names if n != "llama.cpp"):
            ratios = [statistics.median(r["tg"] for r in by_level[lv][name])
                      / statistics.median(r["tg"] for r in by_level[lv]["llama.cpp"]) for lv in by_level]
            print(f"{name} / llama.cpp tg{args.tg}: "
                  + ", ".join(f"{lv} competing {x:.2f}x" for lv, x in zip(by_level, ratios)))


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f}  [{min(values):.1f}..{max(values):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-gguf", default=None, help="GGUF file (default: the built-in SmolLM2-135M Q4_1)")
    ap.add_argument("-jlm", default=None, help="converted model (default: converted from -gguf once)")
    ap.add_argument("-threads", type=int, default=None, help="threads for both sides (default: all CPUs)")
    ap.add_argument("-reps", type=int, default=3)
    ap.add_argument("-pp", type=int, default=512)
    ap.add_argument("-tg", type=int, default=128)
    ap.add_argument("-kernels", default="fast", help="jitllm CPU kernels to measure: fast, exact or fast,exact")
    ap.add_argument("-cache", default="cache", help="jitllm compile cache")
    ap.add_argument("-seed", type=int, default=0)
    ap.add_argument("-with-torch", action="store_true",
                    help="let tvm_ffi import torch in the jitllm process (it does whenever torch is installed)")
    ap.add_argument("-hog", default=None, metavar="N,M,...",
                    help="measure beside N, then M, ... competing CPU-bound processes (e.g. 0,1,2)")
    ap.add_argument("-hog-seconds", dest="hog_seconds", type=float, default=1800,
                    help="the most a competing process runs (each is also killed when its level ends)")
    ap.add_argument("-jitllm-threads", dest="jitllm_threads", default=None, metavar="N[,M...]",
                    help="jitllm's worker count (default: -threads); several: one jitllm side per count")
    ap.add_argument("-isas", default=None, metavar="ISA[,ISA...]",
                    help="one jitllm side per CPU kernel instruction set (JITLLM_CPU_ISA), e.g. avx2,avx512vnni")
    ap.add_argument("-side", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.side:
        runner = {"jitllm": run_jitllm, "llama": run_llama, "bandwidth": run_bandwidth}[args.side]
        result = runner(args)
        print(json.dumps(result), flush=True)
        return

    sys.path.insert(0, str(ROOT))
    from jitllm.core.termination import install_termination_handler
    from jitllm.default_model import default_gguf_path, default_model_path

    install_termination_handler("cpu_decode")  # SIGTERM unwinds, so the competing processes are killed
    from jitllm.lowering.targets.llvm import host_target_dict

    args.threads = args.threads or len(os.sched_getaffinity(0))
    if args.gguf is None:
        args.gguf = default_gguf_path()
        args.jlm = args.jlm or default_model_path()
    elif args.jlm is None:
        from jitllm.convert import convert

        args.jlm = Path(args.cache) / (Path(args.gguf).stem + ".jlm")
        if not args.jlm.exists():
            Path(args.cache).mkdir(parents=True, exist_ok=True)
            convert(str(args.gguf), str(args.jlm), progress=False)
    gguf_bytes = Path(args.gguf).stat().st_size
    try:
        import llama_cpp  # noqa: F401

        have_llama = True
    except ImportError:
        have_llama = False

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"machine: {cpu}, {os.cpu_count()} CPUs, target {host_target_dict()}; {args.threads} threads each side")
    print(f"model: {args.gguf} ({gguf_bytes / 2**20:.1f} MiB)")
    if not have_llama:
        print("llama-cpp-python is not installed: measuring jitllm only (pip install llama-cpp-python)")

    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    from jitllm.lowering.targets.llvm import host_isas

    for isa in _isas(args):
        if isa is not None and isa not in host_isas():
            sys.exit(f"cpu_decode: -isas {isa}: this host runs {', '.join(host_isas())}")
        side(args, "jitllm", kernels[0], isa=isa)  # compiles what the cache lacks, outside the measurement
    if args.hog is not None:
        levels = [int(n) for n in args.hog.split(",")]
        by_level = {}
        for level in levels:
            with hogs(level, args.hog_seconds):
                by_level[level] = measure(args, kernels, have_llama)
        print_load_table(args, by_level)
        return
    results = measure(args, kernels, have_llama)
    bw_numpy, bw_tvm = read_bandwidth(args)
    bandwidth = max(bw_numpy, bw_tvm or 0.0)
    per_token = next(iter(results.values()))[0]["bytes_per_token"]
    roofline = bandwidth / per_token

    print(f"read bandwidth: numpy sum 1 GiB {bw_numpy / 1e9:.1f} GB/s (1 thread)"
          + (f", TVM parallel sum 1 GiB {bw_tvm / 1e9:.1f} GB/s ({args.threads} threads)" if bw_tvm else ""))
    print(f"bytes read per decode step {per_token / 2**20:.1f} MiB -> roofline {roofline:.0f} tok/s")
    print(f"{'':24s} {'pp' + str(args.pp) + ' tok/s median [min..max]':>32s} {'tg' + str(args.tg) + ' tok/s':>26s}"
          f" {'tg roofline':>11s} {'peak RSS':>9s} {'others busy':>11s}")
    for name, runs in results.items():
        pp = [r["pp"] for r in runs]
        tg = [r["tg"] for r in runs]
        rss = max(r["rss"] for r in runs)
        others = max(r["others"] for r in runs)
        print(f"{name:24s} {summary(pp):>32s} {summary(tg):>26s} {100 * statistics.median(tg) / roofline:10.0f}%"
              f" {rss / 2**20:7.0f}MiB {others:9.2f}cpu")
    print(f"GGUF size {gguf_bytes / 2**20:.0f} MiB")
    if have_llama:
        lpp = statistics.median(r["pp"] for r in results["llama.cpp"])
        ltg = statistics.median(r["tg"] for r in results["llama.cpp"])
        for name in (n for n in results if n != "llama.cpp"):
            jpp = statistics.median(r["pp"] for r in results[name])
            jtg = statistics.median(r["tg"] for r in results[name])
            print(f"{name} / llama.cpp: pp{args.pp} {jpp / lpp:.2f}x, tg{args.tg} {jtg / ltg:.2f}x")


if __name__ == "__main__":
    main()
