"""Expert cache (JITLLM_GPU_STREAM=1) under a scripted skewed router: hit rate against cache size.

    python bench/expert_cache.py                          # the sweep, the engine cross-check, miss-on-CPU
    python bench/expert_cache.py -zipf 1.2 -sticky 0.3 -csv hits.csv
    python bench/expert_cache.py -parts sweep -tokens 512 -shapes qwen3-30b-a3b

Random weights say nothing of a real model's cache, so the sweep feeds a scripted router trace through the
engine's own replacement policies (jitllm/runtime/engine/expert_cache.py ExpertSlots, LRU and frequency with
decay, one `place` per block and token as a decode step calls it). Per block, experts are drawn by a Zipf
law (weight of the expert of rank r ~ 1/r^s, each block its own seeded ranking) without replacement, top-k
a token; each pick of the previous token is kept with probability `sticky` (the others drawn afresh).
Seeded. Real models were not measured: no real MoE model is here.

Parts (-parts, comma-separated):
- `sweep`: per shape (a Qwen3-30B-A3B-like one, a Mixtral-like one) the hit rate of the skewed trace per
  policy, and of a uniform trace (s = 0, not sticky) under LRU beside it, against cache sizes as a
  fraction of all experts; the first -warmup tokens fill the cache and are not counted.
- `engine`: the cross-check. The engine has no hook to replace its router (the picks are the experts-apart
  program's output), so a tiny random Qwen3-MoE model (tests/test_moe.py's, converted as
  tests/test_expert_streaming.py does) runs on a simulated device with a small expert cache, fed seeded
  random tokens one at a time. Its cache's hits and misses stand beside this bench's replay of the picks
  transformers' router makes for the same tokens (the same counts, or the replay is not the engine's) and
  a uniform trace of the same shape (a random router is not uniform: it is skewed too).
- `cpu`: whether a miss is better computed on the host than uploaded: one token through one expert (the
  llvm routed-experts kernel, `moe_experts` over a cache of copies of one expert, at the Qwen3 shape's
  hidden and expert ffn, per expert weight type; cold: each call another expert, hot: the same one), and
  numpy's f32 matvecs over weights already dequantized as a peer, against the upload of that expert's
  bytes: the link at -h2d-gbps (default 55: the page-locked host-to-device rate measured on the H200,
  docs/placement.md) or the file read into staging at -read-gbps (default 25: the same page's read rate
  of streamed blocks, 8 MiB pieces on 8 threads) where slower. The engine computes no miss on the CPU.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Shape:
    """An MoE model's routing shape, and its experts' size (for the bytes of a cache and of a copy)."""

    blocks: int
    experts: int
    top_k: int
    hidden: int
    expert_ffn: int

    @property
    def total(self) -> int:
        return self.blocks * self.experts

    def expert_bytes(self, wtype: str) -> int:
        """One expert's gate, up and down bytes as stored in `wtype` (jitllm.core.layouts)."""
        from jitllm.core.layouts import weight_parts

        shapes = [(self.expert_ffn, self.hidden)] * 2 + [(self.hidden, self.expert_ffn)]
        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
                   for n, k in shapes for _, shape, dtype in weight_parts(wtype, n, k))


SHAPES = {
    "qwen3-30b-a3b": Shape(blocks=48, experts=128, top_k=8, hidden=2048, expert_ffn=768),
    "mixtral": Shape(blocks=32, experts=8, top_k=2, hidden=4096, expert_ffn=14336),
}
FRACTIONS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4)
WTYPES = ("q4_0", "f16")


def router_trace(shape: Shape, tokens: int, s: float, sticky: float, seed: int) -> np.ndarray:
    """[tokens, blocks, top_k] expert ids (each row sorted, distinct): per block a Zipf law of exponent `s`
    over a seeded ranking of its experts, top_k drawn without replacement (Gumbel top-k: the weighted draw
    without replacement), each of the previous token's picks kept with probability `sticky`."""
    rng = np.random.default_rng(seed)
    B, E, k = shape.blocks, shape.experts, shape.top_k
    ranks = np.argsort(rng.random((B, E)), axis=1)  # ranks[b, e]: the Zipf rank of expert e in block b
    log_p = -s * np.log1p(ranks)  # (rank 0 -> weight 1, rank r -> 1/(r+1)^s)
    out = np.empty((tokens, B, k), np.int64)
    previous = None
    for t in range(tokens):
        keys = log_p - np.log(-np.log(rng.random((B, E))))  # (+ Gumbel noise)
        if previous is not None:
            kept = rng.random((B, k)) < sticky
            rows = np.broadcast_to(np.arange(B)[:, None], (B, k))
            keys[rows[kept], previous[kept]] = np.inf
        picks = np.sort(np.argpartition(-keys, k - 1, axis=1)[:, :k], axis=1)
        out[t] = previous = picks
    return out


def replay(trace: np.ndarray, capacity: int, policy: str, warmup: int) -> tuple[int, int]:
    """(hits, misses) of the engine's expert cache policy over `trace`, one place() per block and token,
    the first `warmup` tokens not counted."""
    from jitllm.runtime.engine.expert_cache import ExpertSlots

    slots = ExpertSlots(capacity, policy)
    blocks = range(trace.shape[1])
    for t, token in enumerate(trace):
        if t == warmup:
            slots.hits = slots.misses = 0
        for b in blocks:
            slots.place([(b, int(e)) for e in token[b]])
    return slots.hits, slots.misses


def _rate(hits: int, misses: int) -> float:
    return 100.0 * hits / max(1, hits + misses)


def sweep(shapes: list[str], tokens: int, warmup: int, s: float, sticky: float, seed: int) -> list[dict]:
    """One row per shape and cache size: the hit rates of the skewed trace per policy and of a uniform trace
    under LRU."""
    from jitllm.runtime.engine.expert_cache import POLICIES

    rows = []
    for name in shapes:
        shape = SHAPES[name]
        skewed = router_trace(shape, tokens + warmup, s, sticky, seed)
        uniform = router_trace(shape, tokens + warmup, 0.0, 0.0, seed)
        for fraction in FRACTIONS:
            capacity = max(shape.top_k, round(fraction * shape.total))
            row = {"shape": name, "slots": capacity, "fraction": capacity / shape.total,
                   "tokens_picks": capacity / (shape.blocks * shape.top_k),
                   "gib_q4_0": capacity * shape.expert_bytes("q4_0") / 2**30}
            for policy in POLICIES:
                row[policy] = _rate(*replay(skewed, capacity, policy, warmup))
            row["uniform_lru"] = _rate(*replay(uniform, capacity, "lru", warmup))
            rows.append(row)
    return rows


def print_sweep(rows: list[dict], s: float, sticky: float, tokens: int, warmup: int) -> None:
    print(f"hit rate (%) of a scripted router (Zipf s={s}, sticky {sticky}; {tokens} tokens counted after "
          f"{warmup} of warm-up) against cache size; uniform = s 0, not sticky; not a real model")
    print("(tokens: the slots over one token's picks, blocks x top-k)")
    print(f"{'shape':<14} {'slots':>6} {'of all':>7} {'tokens':>7} {'GiB q4_0':>9} {'lru':>6} {'decay':>6} "
          f"{'uniform lru':>12}")
    for r in rows:
        print(f"{r['shape']:<14} {r['slots']:>6} {r['fraction']:>7.1%} {r['tokens_picks']:>7.2f} "
              f"{r['gib_q4_0']:>9.2f} {r['lru']:>6.1f} "
              f"{r['decay']:>6.1f} {r['uniform_lru']:>12.1f}")


def write_csv(rows: list[dict], path: Path) -> None:
    """The sweep's rows, written atomically."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def write_plot(rows: list[dict], path: Path) -> None:
    """Hit rate against the cache's fraction of all experts, one panel per shape, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        mine = [r for r in rows if r["shape"] == name]
        for column in ("lru", "decay", "uniform_lru"):
            ax.plot([r["fraction"] for r in mine], [r[column] for r in mine], marker="o", label=column)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{name} (scripted router)", xlabel="cache / all experts", ylabel="hit rate %", ylim=(0, 100))
        ax.legend()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    fig.savefig(tmp)
    os.replace(tmp, path)


def engine_check(tokens: int, seed: int, cache_dir: Path) -> None:
    """The engine's expert cache counters on a tiny random Qwen3-MoE model beside replays of the same tokens'
    picks as transformers' router computes them, and of a uniform trace of the same shape."""
    import torch

    os.environ["JITLLM_SIM_DEVICES"] = "1"
    sys.path.insert(0, str(ROOT / "tests"))
    from test_convert import write_hf_tokenizer
    from test_moe import hf_model

    from jitllm.convert import convert
    from jitllm.model import load
    from jitllm.runtime.engine.expert_cache import POLICIES, POLICY_ENV

    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model("qwen3moe")
        hf.save_pretrained(Path(tmp) / "hf")
        write_hf_tokenizer(Path(tmp) / "hf")
        path = Path(tmp) / "m.jlm"
        convert(str(Path(tmp) / "hf"), str(path), progress=False)
        opts = dict(ctx=tokens + 8, cache_dir=cache_dir, cpu_kernels="exact", stream_experts=True)
        probe = load(path, devices="sim:0", **opts)
        rest = sum(u.nbytes for u in probe.executor.blocks) + probe.executor.head.nbytes
        expert = probe.executor.streams["sim:0"].experts.expert_bytes
        cfg = probe.executor.layout.config
        shape = Shape(cfg.num_blocks, cfg.experts, cfg.experts_used, cfg.hidden, cfg.expert_ffn)
        feed = np.random.default_rng(seed).integers(3, cfg.vocab, tokens).tolist()
        with torch.no_grad():
            logits = hf(torch.tensor([feed]), output_router_logits=True).router_logits
        theirs = np.stack([np.sort(torch.topk(b, shape.top_k).indices.numpy(), axis=1) for b in logits], axis=1)
        uniform = router_trace(shape, tokens, 0.0, 0.0, seed)
        print(f"\nengine cross-check: tiny random Qwen3-MoE ({shape.blocks} blocks, {shape.experts} experts, "
              f"top-{shape.top_k}) on sim:0, {tokens} seeded random tokens one at a time; hit rates (%) from cold "
              "of the engine's cache, of this bench's replay of transformers' router picks for the same tokens, "
              "and of a uniform trace")
        print(f"{'policy':<7} {'slots':>6} {'of all':>7} {'engine hits/misses':>19} {'replay hits/misses':>19} "
              f"{'hit %':>6} {'uniform %':>10}")
        for policy in POLICIES:
            os.environ[POLICY_ENV] = policy
            for capacity in (shape.top_k + 1, shape.total // 4, shape.total // 2):
                model = load(path, devices=f"sim:0={rest + capacity * expert + expert // 2}", **opts)
                ex = model.executor
                cache = ex.streams["sim:0"].experts
                session = ex.new_session()
                for token in feed:
                    ex.forward(session, [token])
                hits, misses = replay(theirs, cache.count, policy, 0)
                print(f"{policy:<7} {cache.count:>6} {cache.count / shape.total:>7.1%} "
                      f"{f'{cache.slots.hits}/{cache.slots.misses}':>19} {f'{hits}/{misses}':>19} "
                      f"{_rate(cache.slots.hits, cache.slots.misses):>6.1f} "
                      f"{_rate(*replay(uniform, cache.count, policy, 0)):>10.1f}")
        os.environ.pop(POLICY_ENV)


def _times_us(call, reps: int, rotate: int = 1) -> tuple[float, float]:
    """(best, median) microseconds of `call(i)` over `reps` calls after three unmeasured ones, i running
    through 0 .. rotate - 1 (each a different expert's memory, untouched since it was written: a cold one)."""
    times = []
    for n in range(reps + 3):
        start = time.perf_counter()
        call(n % rotate)
        times.append(time.perf_counter() - start)
    return min(times[3:]) * 1e6, statistics.median(times[3:]) * 1e6


def expert_kernel_us(shape: Shape, wtype: str, cache_dir: Path, reps: int, cold_bytes: int) -> dict[str, tuple]:
    """One token through one expert on the host, the llvm moe_experts program over a cache of experts whose
    bytes exceed `cold_bytes` (copies of one expert: the bytes, not the values, matter): "cold" runs each
    call on another slot, "hot" on one slot over and over (in the CPU's caches)."""
    import tvm

    from jitllm.core.quant import parts_from_float
    from jitllm.ir.blocks import activation_inputs, block_kind, weight_inputs
    from jitllm.ir.config import ModelConfig
    from jitllm.ir.moe import cache_kind
    from jitllm.lowering.cache import get_artifact
    from jitllm.lowering.target import kind_for_target
    from jitllm.lowering.targets.llvm import LlvmTarget
    from jitllm.runtime.backends.tvm_tensors import load_program

    cfg = ModelConfig("qwen3moe", 1, shape.hidden, 32, 4, 128, shape.expert_ffn, 1024, 4096, 1e6, 1e-6,
                      qk_norm=True, block_types=("moe",), experts=shape.experts, experts_used=1,
                      expert_ffn=shape.expert_ffn)
    wtypes = {"attn_q": "f32", "attn_k": "f32", "attn_v": "f32", "attn_output": "f32",
              "ffn_gate_exps": wtype, "ffn_up_exps": wtype, "ffn_down_exps": wtype}
    slots = max(reps + 3, -(-cold_bytes // shape.expert_bytes(wtype)))
    kind = kind_for_target(cache_kind(block_kind(cfg, 0, wtypes), slots), LlvmTarget()).decode_variant()
    rng = np.random.default_rng(0)
    args = {}
    for spec in kind.linears:
        rows = spec.out_features // slots
        w = rng.standard_normal((rows, spec.in_features)).astype(np.float32) / np.sqrt(spec.in_features)
        for part, one in parts_from_float(spec.wtype, w).items():
            args[f"{spec.name}_{part}"] = tvm.runtime.tensor(np.concatenate([one] * slots))  # (axis 0: row groups)
    maps = []
    for slot in range(reps + 3):
        slot_map = np.full(shape.experts, -1, np.int64)
        slot_map[0] = slot
        maps.append(tvm.runtime.tensor(slot_map))
    fixed = {"x": np.zeros((1, 1, shape.hidden), np.float32),
             "ffn_h": rng.standard_normal((1, 1, shape.hidden)).astype(np.float32),
             "expert_ids": np.zeros((1, 1, 1), np.int64), "expert_weights": np.ones((1, 1, 1), np.float32)}
    args |= {name: tvm.runtime.tensor(value) for name, value in fixed.items()}
    names = [n for n, _, _ in activation_inputs(kind) + weight_inputs(kind)]
    program = load_program(get_artifact(kind, LlvmTarget(), cache_dir).path, tvm.cpu(), False)

    def call(slot: int) -> None:
        program.main(*[maps[slot] if n == "slot_map" else args[n] for n in names])

    return {"cold": _times_us(call, reps, reps + 3), "hot": _times_us(call, reps)}


def numpy_f32_us(shape: Shape, reps: int, cold_bytes: int) -> dict[str, tuple]:
    """The same SwiGLU with numpy over f32 weights already dequantized (4 bytes a weight: more than the
    upload moves), cold (each call another copy of the weights) and hot, as expert_kernel_us."""
    rng = np.random.default_rng(0)
    count = max(reps + 3, -(-cold_bytes // shape.expert_bytes("f32")))
    F, K = shape.expert_ffn, shape.hidden
    gate, up = (np.repeat(rng.standard_normal((1, F, K), np.float32) / np.float32(K ** 0.5), count, axis=0)
                for _ in range(2))
    down = np.repeat(rng.standard_normal((1, K, F), np.float32) / np.float32(F ** 0.5), count, axis=0)
    h = rng.standard_normal(K, np.float32)

    def call(i: int) -> None:
        g = gate[i] @ h
        down[i] @ (g / (1 + np.exp(-g)) * (up[i] @ h))

    return {"cold": _times_us(call, reps, reps + 3), "hot": _times_us(call, reps)}


def miss_on_cpu(shape_name: str, h2d_gbps: float, read_gbps: float, cache_dir: Path, reps: int,
                cold_bytes: int) -> None:
    """Per expert weight type: one token's expert computed on the host against the upload of its bytes."""
    from jitllm.runtime.workers import host_workers

    shape = SHAPES[shape_name]
    workers = host_workers()  # (the engine's CPU workers, set before the first kernel starts TVM's pool)
    print(f"\nmiss on the CPU or an upload: one token through one expert of {shape_name} (hidden {shape.hidden}, "
          f"expert ffn {shape.expert_ffn}) on this host ({workers.count} CPU workers, {workers.source}), best / "
          f"median us of {reps} calls, cold (each call another expert, of {cold_bytes / 2**20:.0f} MiB written "
          f"before) and hot (one expert again); the upload: the link at {h2d_gbps:g} GB/s, or the file read "
          f"into staging at {read_gbps:g} GB/s where slower (the two pipelined)")
    f32 = numpy_f32_us(shape, reps, cold_bytes)
    print(f"{'experts':<8} {'bytes':>9} {'llvm cold':>11} {'llvm hot':>11} {'numpy f32 cold':>15} {'link':>6} "
          f"{'upload':>7}  faster (cold best against the upload)")
    for wtype in WTYPES:
        nbytes = shape.expert_bytes(wtype)
        kernel = expert_kernel_us(shape, wtype, cache_dir, reps, cold_bytes)
        link = nbytes / (h2d_gbps * 1e9) * 1e6
        upload = max(link, nbytes / (read_gbps * 1e9) * 1e6)
        best = kernel["cold"][0]
        faster = "cpu" if best < upload else "upload"
        cells = [f"{b:.0f} / {m:.0f}" for b, m in (kernel["cold"], kernel["hot"], f32["cold"])]
        print(f"{wtype:<8} {nbytes:>9} {cells[0]:>11} {cells[1]:>11} {cells[2]:>15} {link:>6.0f} {upload:>7.0f}  "
              f"{faster} ({best / upload:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-parts", default="sweep,engine,cpu", help="comma-separated: sweep, engine, cpu")
    ap.add_argument("-shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("-zipf", type=float, default=1.0, help="Zipf exponent s over each block's experts")
    ap.add_argument("-sticky", type=float, default=0.5, help="probability a pick of the previous token is kept")
    ap.add_argument("-tokens", type=int, default=256, help="tokens counted (sweep), fed (engine)")
    ap.add_argument("-warmup", type=int, default=64, help="tokens before the counted ones (sweep)")
    ap.add_argument("-seed", type=int, default=0)
    ap.add_argument("-h2d-gbps", dest="gbps", type=float, default=55.0,
                    help="host-to-device bandwidth of a miss's copy (default: the H200's page-locked rate)")
    ap.add_argument("-read-gbps", dest="read_gbps", type=float, default=25.0,
                    help="file (page cache) to staging read rate (default: the H200 host's, 8 threads)")
    ap.add_argument("-reps", type=int, default=50, help="timed calls per figure (cpu)")
    ap.add_argument("-cold-mib", dest="cold_mib", type=int, default=768,
                    help="weights written before the cold calls (cpu: more than the CPU's last-level cache)")
    ap.add_argument("-cache", type=Path, default=Path("cache"), help="compile cache (engine, cpu)")
    ap.add_argument("-csv", type=Path, help="write the sweep's table there")
    ap.add_argument("-plot", type=Path, help="write the sweep's plot there (PNG, needs matplotlib)")
    a = ap.parse_args()
    parts = a.parts.split(",")
    shapes = a.shapes.split(",")
    problems = [f"-parts: unknown {p!r} (known: sweep, engine, cpu)" for p in parts
                if p not in ("sweep", "engine", "cpu")]
    problems += [f"-shapes: unknown {s!r} (known: {', '.join(SHAPES)})" for s in shapes if s not in SHAPES]
    problems += ["-zipf must be >= 0"] * (a.zipf < 0) + ["-sticky must be in [0, 1]"] * (not 0 <= a.sticky <= 1)
    problems += ["-tokens must be >= 1 and -warmup >= 0"] * (a.tokens < 1 or a.warmup < 0)
    problems += ["-h2d-gbps and -read-gbps must be > 0"] * (a.gbps <= 0 or a.read_gbps <= 0) + ["-reps and -cold-mib must be >= 1"] * (a.reps < 1 or a.cold_mib < 1)
    if (a.csv or a.plot) and "sweep" not in parts:
        problems.append("-csv and -plot write the sweep: add it to -parts")
    for out in (a.csv, a.plot):
        if out is not None and not out.resolve().parent.is_dir():
            problems.append(f"{out}: no such directory {out.resolve().parent}")
    if a.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            problems.append("-plot: matplotlib is not installed (the table, or -csv, is the result)")
    if problems:
        sys.exit(f"expert_cache.py: {problems[0]}")
    if "sweep" in parts:
        start = time.perf_counter()
        rows = sweep(shapes, a.tokens, a.warmup, a.zipf, a.sticky, a.seed)
        print_sweep(rows, a.zipf, a.sticky, a.tokens, a.warmup)
        print(f"(sweep: {time.perf_counter() - start:.1f} s)")
        if a.csv:
            write_csv(rows, a.csv)
        if a.plot:
            write_plot(rows, a.plot)
    if "engine" in parts:
        engine_check(a.tokens, a.seed, a.cache)
    if "cpu" in parts:
        miss_on_cpu("qwen3-30b-a3b", a.gbps, a.read_gbps, a.cache, a.reps, a.cold_mib * 2**20)


if __name__ == "__main__":
    main()
