"""Anonymous memory of one generation, measured inside the process that generates: `jitllm run` (the CLI's
own process: torch kept out, as a command keeps it) and the API's `Model.generate`, each in a subprocess
of its own, reading /proc/self/status at four points: after the imports, after the load, after the
prefill (the first token sampled) and after N decoded tokens; the peak of RssAnon between them is
sampled every 5 ms by a thread.

    python bench/run_rss.py [MODEL] [-n 64] [-ctx 4096] [-prompt-words 0] [-modes cli,api] [-cache DIR] [-breakdown]

The goal (issue 31, item 8): RssAnon after the decode, less RssAnon after the imports, at most the weights
held off the mapped file (what the engine copied into host allocations: jitllm.runtime.engine.memory) +
the KV the session uses (its positions x bytes per position, from the pools) + 64 MiB. `-breakdown` adds
where the load's anonymous memory went: RssAnon deltas around each unit's weights upload, each artifact's
load and the KV pools (the rest of the load is "other").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path.home() / ".cache/jitllm/smollm2-135m-instruct.jlm"
PROMPT = "What is the capital of France?"
MARGIN = 64 << 20
"""The goal's allowance over weights and KV (issue 31, item 8)."""
WORDS = "time river stone light house garden window morning paper music voice city ocean forest story bread".split()
POINTS = ("imports", "load", "prefill", "decode")


def status() -> dict[str, int]:
    """RssAnon, RssFile and VmHWM of this process in bytes (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class PeakSampler(threading.Thread):
    """The highest RssAnon seen, sampled every `period` seconds until `stop`."""

    def __init__(self, period: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.period, self.peak, self._done = period, 0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, status()["RssAnon"])
            self._done.wait(self.period)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, status()["RssAnon"])


class Breakdown:
    """RssAnon deltas summed per category around the engine's load steps (wrapped functions)."""

    def __init__(self) -> None:
        self.deltas: dict[str, int] = {}
        self._depth = 0

    def wrap(self, module, name: str, category: str) -> None:
        inner = getattr(module, name)

        def measured(*args, **kwargs):
            self._depth += 1
            before = status()["RssAnon"]
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:  # (only the outermost wrapped call counts)
                    self.deltas[category] = self.deltas.get(category, 0) + status()["RssAnon"] - before

        setattr(module, name, measured)


def child(mode: str, model: str, prompt: str, tokens: int, ctx: int, cache: str, report: str, breakdown: bool) -> None:
    """One generation in this process, its figures written to `report` (JSON)."""
    sampler = PeakSampler()
    sampler.start()
    points: dict[str, dict[str, int]] = {}
    if mode == "cli":
        from jitllm.core.lean_imports import importing_tvm, own_process

        own_process()  # (what the `jitllm` entry point does before anything else)
        import jitllm.checked_model  # noqa: F401 (the file check's imports, which come before TVM's)
        import jitllm.cli as cli

        with importing_tvm():  # (the CLI's own import of the API, made here so it can be wrapped)
            import jitllm.model as api
    else:
        import jitllm.model as api
    from jitllm.runtime.engine import kv, memory, units
    from jitllm.runtime.sampling import SamplingParams

    points["imports"] = status()

    parts = Breakdown()
    if breakdown:
        parts.wrap(units, "upload_weights", "weights")
        parts.wrap(units, "program", "artifacts")
        parts.wrap(kv, "pool", "kv pools")
    held: dict[str, int] = {}
    loaded = api.load_with

    def load_with(*args, **kwargs):
        model_ = loaded(*args, **kwargs)
        points["load"] = status()
        held.update(memory.host_memory(model_.executor).as_dict())
        return model_

    api.load_with = load_with
    generate_tokens = api.Model.generate_tokens

    def measured_tokens(self, ids, max_tokens, sampling, session=None):
        own = session or self.new_session()
        count = 0
        for token in generate_tokens(self, ids, max_tokens, sampling, own):
            count += 1
            if count == 1:
                points["prefill"] = status()
            yield token
        points["decode"] = status()
        held.update(memory.host_memory(self.executor, [own]).as_dict(), tokens=count, positions=own.length)
        if session is None:
            self.executor.close_session(own)

    api.Model.generate_tokens = measured_tokens
    common = ["-ctx", str(ctx), "-devices", "cpu", "-cache", cache]
    if mode == "cli":
        sys.argv = ["jitllm", "run", "-n", str(tokens), "-temp", "0", "-chat", *common, model, prompt]
        try:
            cli.main()
        except SystemExit as e:
            if e.code:
                raise
    else:
        m = api.load(model, devices="cpu", ctx=ctx, cache_dir=cache)
        text = "".join(m.generate(prompt, tokens, SamplingParams(0.0), chat=True))
        sys.stdout.write(text + "\n")
    peak = sampler.stop()
    result = {"mode": mode, "points": points, "peak_anon": peak, "held": held, "breakdown": parts.deltas,
              "torch": "torch" in sys.modules and sys.modules["torch"] is not None}
    with open(report, "w") as f:
        json.dump(result, f)


def long_prompt(words: int) -> str:
    """The question after `words` words of filler (a few words a token)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(words)) + ("\n\n" if words else "") + PROMPT


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def show(r: dict) -> bool:
    """Print one mode's figures; whether the goal holds."""
    p, h = r["points"], r["held"]
    base = p["imports"]["RssAnon"]
    print(f"\n== {r['mode']} (torch imported: {r['torch']}; {h['tokens']} tokens generated, "
          f"{h['positions']} positions held)")
    print(f"{'point':10s} {'RssAnon':>9s} {'growth':>9s} {'RssFile':>9s} {'VmHWM':>9s}  (MiB)")
    for name in POINTS:
        s = p[name]
        print(f"{name:10s} {mib(s['RssAnon']):>9s} {mib(s['RssAnon'] - base):>9s} {mib(s['RssFile']):>9s} "
              f"{mib(s['VmHWM']):>9s}")
    print(f"{'peak':10s} {mib(r['peak_anon']):>9s} {mib(r['peak_anon'] - base):>9s}  (RssAnon sampled every 5 ms)")
    budget = h["weights"] + h["kv_used"] + MARGIN
    grown = p["decode"]["RssAnon"] - base
    print(f"budget: weights held off the map {mib(h['weights'])} + KV used {mib(h['kv_used'])} "
          f"({h['positions']} positions x {h['kv_position_bytes']} B) + {mib(MARGIN)} = {mib(budget)} MiB; "
          f"KV pools: pages {mib(h['kv_pool'])} MiB, tensors {mib(h['kv_reserved'])} MiB")
    ok = grown <= budget
    print(f"goal: growth after the imports {mib(grown)} <= {mib(budget)} MiB: {'holds' if ok else 'MISSED'} "
          f"(peak growth {mib(r['peak_anon'] - base)})")
    if r["breakdown"]:
        load = p["load"]["RssAnon"] - base
        parts = "; ".join(f"{k} {mib(v)}" for k, v in r["breakdown"].items())
        rest = load - sum(r["breakdown"].values())
        print(f"load's growth {mib(load)} MiB: {parts}; other {mib(rest)}")
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    p.add_argument("-n", type=int, default=64, help="tokens to decode")
    p.add_argument("-ctx", type=int, default=4096)
    p.add_argument("-modes", default="cli,api", help="cli, api or both (comma-separated)")
    p.add_argument("-cache", default=str(ROOT / "cache"), help="the compiled-artifact cache")
    p.add_argument("-prompt-words", type=int, default=0,
                   help="words of filler before the question (a long prompt: the KV pool's growth)")
    p.add_argument("-breakdown", action="store_true", help="where the load's anonymous memory went")
    p.add_argument("-child", choices=("cli", "api"), help=argparse.SUPPRESS)
    p.add_argument("-report", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.model, long_prompt(a.prompt_words), a.n, a.ctx, a.cache, a.report, a.breakdown)
        return
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in ("cli", "api") for m in modes):
        sys.exit(f"run_rss: -modes {a.modes!r}: expected cli, api or both")
    if a.n < 1 or a.ctx < 1 or a.prompt_words < 0 or not Path(a.model).is_file():
        sys.exit(f"run_rss: need -n >= 1, -ctx >= 1 and an existing model file (got {a.model})")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    held = True
    for mode in modes:
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "report.json")
            began = time.perf_counter()
            cmd = [sys.executable, __file__, a.model, "-n", str(a.n), "-ctx", str(a.ctx), "-cache", a.cache,
                   "-prompt-words", str(a.prompt_words),
                   "-child", mode, "-report", report] + (["-breakdown"] if a.breakdown else [])
            done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0 or not os.path.exists(report):
                sys.exit(f"run_rss: the {mode} run failed (exit code {done.returncode})")
            with open(report) as f:
                result = json.load(f)
        print(f"[{mode}: {time.perf_counter() - began:.1f} s] {done.stdout.strip()[:120]!r}")
        held = show(result) and held
    sys.exit(0 if held else 1)


if __name__ == "__main__":
    main()
