"""Serving load on `jitllmd` against llama.cpp's `llama-server` on the same GGUF, in the same run:

    python bench/serve_load.py [-c 8] [-prompts 32] [-p 64] [-n 128] [-rate inf] [-rounds 2] [-threads 2]
                               [-gguf PATH] [-jlm PATH] [-llama-server PATH] [-jitllmd-args ARGS]
                               [-move SPEC;SPEC... [-move-every S]] [-soak SECONDS] [-json OUT] [-cache DIR]

Both servers are started here (jitllmd with `-parallel C`, llama-server with `-np C` and C times jitllmd's
context), warmed with C concurrent requests, and then measured alternately, `-rounds` times each, the order
swapped every round. Each measured run streams `-prompts` distinct prompts (~P tokens of random words)
through the OpenAI-compatible `/v1/completions` with `temperature 0`, `max_tokens N` and `ignore_eos`, so both
sides generate the same lengths; at most C requests are in flight (`-rate inf`, vLLM's default), or requests
arrive as a Poisson process of `-rate` per second (still at most C in flight). Per run, as `vllm bench serve`
computes them: TTFT, TPOT (per request, after its first token), ITL (between streamed chunks), end-to-end
latency (mean, median, std, p50/p90/p99 in ms) and request / output / total token throughput; the JSON
(`-json`) holds one `vllm bench serve`-shaped result per run, the load average and the command.

`-move A;B;...`: one more jitllmd run per round during which the moves are POSTed to /v1/placement in turn,
every `-move-every` seconds (e.g. `-jitllmd-args "-devices cpu,sim:0" -move "0-14=sim:0;*=host"`; simulated
devices are enabled when a `sim:` device is named); it reports the moves' milliseconds and what they add to
p99 ITL over the run without moves of the same round (the goal: less than one decode step, the median ITL).

`-soak SECONDS`: jitllmd alone, C concurrent streams (e.g. -c 64) looping over the prompts until the time is
up; every answer must equal that prompt's temp-0 answer, and the server's RSS is sampled (psutil) every few
seconds. Each prompt has two expected answers, computed first: its solo answer (one request at a time:
batch-1 steps) and its answer with all the prompts sent at once (batched steps). On SmolLM2 they differ for
some prompts (the batch-1 decode kernels and the ragged ones differ at float level, docs/server.md), so a
stream is corrupted when its text is neither; one that is the other path's answer is counted apart
(`path_variants`). Lost streams (errors), corrupted ones and the RSS curve are printed and written to the
JSON; exit code 1 when a stream was lost or corrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 900  # (a cold compile cache compiles SmolLM2's kinds first)
WORDS = ("time river stone light house garden window morning paper music voice city ocean forest story bread "
         "winter summer road bridge market teacher letter mountain cloud engine silver table friend question "
         "answer color animal station number evening kitchen planet signal harbor lantern meadow").split()


# -- the servers -------------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    process: subprocess.Popen
    url: str = ""
    model: str = ""
    log: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _drain(server: Server, found: threading.Event, pattern: str | None) -> None:
    for line in server.process.stderr:
        server.log.append(line)
        match = re.search(pattern, line) if pattern else None
        if match and not server.url:
            server.url = match.group(1)
            found.set()
    found.set()


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    sys.exit(f"{server.name} did not become ready:\n{''.join(server.log[-30:])}")


def start_jitllmd(a) -> Server:
    model = [str(a.jlm)] if a.jlm else []
    extra = shlex.split(a.jitllmd_args)
    env = dict(os.environ, TVM_NUM_THREADS=str(a.threads), PYTHONPATH=str(ROOT), JITLLM_CACHE_DIR=a.cache)
    if any("sim:" in arg for arg in extra):
        env["JITLLM_SIM_DEVICES"] = "1"
    cmd = [sys.executable, "-c", "from jitllm.cli import jitllmd; jitllmd()", "serve", *model, "-port", "0",
           "-parallel", str(a.parallel or a.c), "-queue", str(max(64, a.c)), "-ctx", str(a.ctx),
           "-cache-sessions", str(max(32, a.parallel or a.c)), *extra]
    server = Server("jitllmd", subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env))
    found = threading.Event()
    threading.Thread(target=_drain, args=(server, found, r"on (http://127\.0\.0\.1:\d+)"), daemon=True).start()
    if not found.wait(120) or not server.url:
        server.stop()
        sys.exit(f"jitllmd did not start:\n{''.join(server.log[-30:])}")
    _wait_ready(server)
    server.model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(a) -> Server:
    port = _free_port()
    cmd = [a.llama_server, "-m", str(a.gguf), "-np", str(a.c), "-c", str(a.c * a.ctx), "-t", str(a.threads),
           "-tb", str(a.threads), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    server = Server("llama.cpp", subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True),
                    url=f"http://127.0.0.1:{port}", model=Path(a.gguf).stem)
    threading.Thread(target=_drain, args=(server, threading.Event(), None), daemon=True).start()
    _wait_ready(server)
    return server


# -- one request, one run ----------------------------------------------------------------------------
@dataclass
class Output:
    prompt: str
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    """Arrival (perf_counter) of each streamed chunk that carried text."""
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def itl(self) -> list[float]:
        return list(np.diff(self.chunk_times)) if len(self.chunk_times) > 1 else []


async def stream_one(client: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int) -> Output:
    out = Output(prompt, start=time.perf_counter())
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", server.url + "/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                out.error = f"HTTP {answer.status_code}: {(await answer.aread())[:200]!r}"
                return out
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    out.prompt_tokens = data["usage"].get("prompt_tokens", 0)
                    out.output_tokens = data["usage"].get("completion_tokens", 0)
                for choice in data.get("choices") or []:
                    if choice.get("text"):
                        now = time.perf_counter()
                        if not out.chunk_times:
                            out.ttft = now - out.start
                        out.chunk_times.append(now)
                        out.text += choice["text"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.latency = time.perf_counter() - out.start
    out.output_tokens = out.output_tokens or len(out.chunk_times)
    if not out.chunk_times:
        out.error = "no text streamed"
    return out


@dataclass
class Move:
    spec: str
    posted: float
    answered: float
    ms: float
    """The server's own figure for the move (its answer's moves' ms, summed)."""
    error: str = ""


async def mover(server: Server, specs: list[str], every: float, done: asyncio.Event, moves: list[Move]) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        i = 0
        while not done.is_set():
            try:
                await asyncio.wait_for(done.wait(), every)
                return
            except asyncio.TimeoutError:
                pass
            spec, posted = specs[i % len(specs)], time.perf_counter()
            answer = await client.post(server.url + "/v1/placement", json={"moves": spec})
            answered = time.perf_counter()
            body = answer.json()
            ms = sum(m.get("ms", 0.0) for m in body.get("moves", [])) if answer.status_code == 200 else 0.0
            error = "" if answer.status_code == 200 else f"HTTP {answer.status_code}: {body}"
            moves.append(Move(spec, posted, answered, ms, error))
            i += 1


def placement_spec(server: Server) -> str:
    """The server's placement as moves that restore it (`0=host,1=host,...,head=host`)."""
    units = httpx.get(server.url + "/v1/placement", timeout=60).json()["units"]
    return ",".join(f"{u['unit']}={u['device']}" for u in units)


async def run_load(server: Server, prompts: list[str], a, moves: list[str] | None = None) -> dict:
    """One measured run: every prompt once, at most `a.c` in flight, arrivals by `a.rate`; with `moves`, the
    placement is put back as it was afterwards."""
    restore = placement_spec(server) if moves else None
    limit = asyncio.Semaphore(a.c)
    rng = np.random.default_rng(a.seed)
    done, moved = asyncio.Event(), []
    limits = httpx.Limits(max_connections=a.c + 4, max_keepalive_connections=a.c + 4)

    async def one(client: httpx.AsyncClient, prompt: str) -> Output:
        async with limit:
            return await stream_one(client, server, prompt, a.n)

    load_before, logged = os.getloadavg(), len(server.log)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        start = time.perf_counter()
        moving = asyncio.create_task(mover(server, moves, a.move_every, done, moved)) if moves else None
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(client, prompt)))
            if math.isfinite(a.rate):
                await asyncio.sleep(rng.exponential(1.0 / a.rate))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        done.set()
        if moving:
            await moving
            await client.post(server.url + "/v1/placement", json={"moves": restore})
    result = metrics(server.name, outputs, duration, a)
    result["load_average"] = [load_before, os.getloadavg()]
    result["server_log"] = [line.rstrip() for line in server.log[logged:]][-50:]
    if moves is not None:
        result["moves"] = [{"spec": m.spec, "at_s": round(m.posted - start, 3), "ms": round(m.ms, 1),
                            "round_trip_ms": round(1e3 * (m.answered - m.posted), 1), "error": m.error}
                           for m in moved]
        spans = [t for o in outputs for t0, t in zip(o.chunk_times, o.itl)
                 if any(m.posted <= t0 + t and t0 <= m.answered for m in moved)]
        result["max_itl_across_a_move_ms"] = 1e3 * max(spans, default=0.0)
    return result


def _stats(name: str, values_s: list[float], result: dict) -> None:
    ms = [1e3 * v for v in values_s] or [0.0]
    result[f"mean_{name}_ms"] = float(np.mean(ms))
    result[f"median_{name}_ms"] = float(np.median(ms))
    result[f"std_{name}_ms"] = float(np.std(ms))
    for p in (50, 90, 99):
        result[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))


def metrics(backend: str, outputs: list[Output], duration: float, a) -> dict:
    """`vllm bench serve`'s result fields (its calculate_metrics: TPOT per request excludes the first token)."""
    ok = [o for o in outputs if not o.error]
    total_in, total_out = sum(o.prompt_tokens for o in ok), sum(o.output_tokens for o in ok)
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"), "backend": backend, "endpoint_type": "openai",
        "label": None, "model_id": str(a.gguf), "tokenizer_id": str(a.gguf), "num_prompts": len(outputs),
        "request_rate": a.rate if math.isfinite(a.rate) else "inf", "burstiness": 1.0, "max_concurrency": a.c,
        "duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    _stats("ttft", [o.ttft for o in ok], result)
    _stats("tpot", [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1], result)
    _stats("itl", [t for o in ok for t in o.itl], result)
    _stats("e2el", [o.latency for o in ok], result)
    result.update(input_lens=[o.prompt_tokens for o in outputs], output_lens=[o.output_tokens for o in outputs],
                  ttfts=[o.ttft for o in outputs], itls=[o.itl for o in outputs],
                  generated_texts=[o.text for o in outputs], errors=[o.error for o in outputs])
    return result


def make_prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


async def warm(server: Server, a) -> None:
    """C concurrent short requests: jitllmd compiles its batched kinds, both fill their slots once."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(START_TIMEOUT)) as client:
        outs = await asyncio.gather(*(stream_one(client, server, p, 8) for p in make_prompts(a.c, a.p, a.seed + 1)))
    bad = [o.error for o in outs if o.error]
    if bad:
        sys.exit(f"{server.name}: the warm-up failed: {bad[0]}")


# -- the report --------------------------------------------------------------------------------------
ROW = "| {:<18} | {:>5} | {:>8} | {:>17} | {:>17} | {:>17} | {:>9} |"


def print_header() -> None:
    print(ROW.format("server", "round", "out t/s", "TTFT p50/p90/p99", "TPOT p50/p90/p99", "ITL p50/p90/p99",
                     "load avg"))
    print(ROW.format(*["-" * w for w in (18, 5, 8, 17, 17, 17, 9)]).replace(" ", "-").replace("|-", "| ")
          .replace("-|", " |"))


def print_row(name: str, rnd: int, r: dict) -> None:
    trio = lambda m: "/".join(f"{r[f'p{p}_{m}_ms']:.0f}" for p in (50, 90, 99))  # noqa: E731
    print(ROW.format(name, rnd, f"{r['output_throughput']:.1f}", trio("ttft"), trio("tpot"), trio("itl"),
                     f"{r['load_average'][0][0]:.2f}"), flush=True)
    for line in r["server_log"][:5]:
        print(f"  {r['backend']} said: {line}")
    if r["failed"]:
        print(f"  {r['failed']} failed: {next(e for e in r['errors'] if e)}")


def write_json(path: str, data: dict) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# -- the modes ---------------------------------------------------------------------------------------
def compare(a) -> dict:
    jit = start_jitllmd(a)
    servers = [jit]
    try:
        if a.llama_server:
            servers.append(start_llama_server(a))
        for s in servers:
            asyncio.run(warm(s, a))
        runs, specs = [], a.move.split(";") if a.move else None
        print_header()
        for rnd in range(a.rounds):
            order = servers if rnd % 2 == 0 else servers[::-1]
            prompts = make_prompts(a.prompts or 4 * a.c, a.p, a.seed + 1000 * (rnd + 1))
            for s in order:  # (the same prompts for both, new ones each round: no prefix-cache hits across runs)
                r = asyncio.run(run_load(s, prompts, a))
                r["round"] = rnd
                runs.append(r)
                print_row(s.name, rnd, r)
                if s is jit and specs:
                    moved = make_prompts(a.prompts or 4 * a.c, a.p, a.seed + 1000 * (rnd + 1) + 500)
                    r = asyncio.run(run_load(s, moved, a, moves=specs))
                    r["round"], r["backend"] = rnd, "jitllmd+moves"
                    runs.append(r)
                    print_row("jitllmd + moves", rnd, r)
                    print(f"  moves: {describe_moves(r['moves'])}; longest ITL across a move "
                          f"{r['max_itl_across_a_move_ms']:.0f} ms")
    finally:
        for s in servers:
            s.stop()
    summary = summarize(runs)
    for line in summary["lines"]:
        print(line)
    return {"runs": runs, "summary": summary}


def describe_moves(moves: list[dict]) -> str:
    return ", ".join(f"{m['spec']} {m['ms']:.0f} ms" + (f" ({m['error']})" if m["error"] else "") for m in moves)


def summarize(runs: list[dict]) -> dict:
    def med(backend: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["backend"] == backend]
        return statistics.median(values) if values else None

    out: dict = {"lines": []}
    for b in ("jitllmd", "llama.cpp", "jitllmd+moves"):
        if med(b, "output_throughput") is None:
            continue
        out[b] = {k: med(b, k) for k in ("output_throughput", "p50_itl_ms", "median_itl_ms", "p99_itl_ms",
                                         "p99_ttft_ms", "median_tpot_ms")}
        out["lines"].append(f"{b}: median over rounds {out[b]['output_throughput']:.1f} output t/s, ITL median "
                            f"{out[b]['median_itl_ms']:.1f} ms, p99 {out[b]['p99_itl_ms']:.1f} ms "
                            f"(p99/median {out[b]['p99_itl_ms'] / out[b]['median_itl_ms']:.2f}, goal <= 2)")
    if "jitllmd" in out and "llama.cpp" in out:
        ratio = out["jitllmd"]["output_throughput"] / out["llama.cpp"]["output_throughput"]
        out["throughput_ratio"] = ratio
        out["lines"].append(f"throughput jitllmd / llama.cpp: {ratio:.2f}x (goal >= 1.2x on the CPU)")
    if "jitllmd+moves" in out:
        added = out["jitllmd+moves"]["p99_itl_ms"] - out["jitllmd"]["p99_itl_ms"]
        out["move_added_p99_itl_ms"] = added
        out["lines"].append(f"moves add {added:.1f} ms to p99 ITL; one decode step (median ITL without moves) is "
                            f"{out['jitllmd']['median_itl_ms']:.1f} ms (goal: less)")
    return out


def soak(a, prompts: list[str]) -> dict:
    jit = start_jitllmd(a)
    try:
        pid = psutil.Process(jit.process.pid)
        result = asyncio.run(_soak(jit, pid, prompts, a))
    finally:
        jit.stop()
    rss = [mib for _, mib in result["rss_mib"]]
    tail = rss[len(rss) // 5:] or rss
    print(f"soak {a.soak:.0f} s at {a.c} streams: {result['completed']} streams completed, {result['lost']} lost, "
          f"{result['corrupted']} corrupted ({result['path_variants']} with the other path's answer), "
          f"{result['output_tokens']} tokens ({result['output_throughput']:.1f} t/s); "
          f"RSS MiB first {rss[0]:.0f}, after the first fifth {tail[0]:.0f}, max {max(rss):.0f}, last {rss[-1]:.0f} "
          f"({len(rss)} samples)")
    first, last = result["kv_pages"][0], result["kv_pages"][-1]
    print(f"  KV pool pages {first['pool_pages']:.0f} -> {last['pool_pages']:.0f} (in use {last['used_pages']:.0f}), "
          f"sessions kept {first['sessions']:.0f} -> {last['sessions']:.0f}")
    return result


async def _soak(server: Server, pid: psutil.Process, prompts: list[str], a) -> dict:
    limits = httpx.Limits(max_connections=a.c + 4, max_keepalive_connections=a.c + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        solo = {}
        for p in prompts:  # one at a time: each prompt's answer alone
            o = await stream_one(client, server, p, a.n)
            if o.error:
                sys.exit(f"soak: the solo answer failed: {o.error}")
            solo[p] = o.text
        together = await asyncio.gather(*(stream_one(client, server, p, a.n) for p in prompts))
        if any(o.error for o in together):
            sys.exit(f"soak: the batched reference failed: {next(o.error for o in together if o.error)}")
        batched = {p: o.text for p, o in zip(prompts, together)}
        differ = [p for p in prompts if batched[p] != solo[p]]
        print(f"soak: {len(prompts)} prompts, solo and batched answers differ for {len(differ)}; {a.c} streams "
              f"for {a.soak:.0f} s", flush=True)
        rss: list[tuple[float, float]] = []
        kv: list[dict[str, float]] = []
        counts = {"completed": 0, "lost": 0, "corrupted": 0, "path_variants": 0, "output_tokens": 0}
        problems: list[str] = []
        start = time.perf_counter()
        deadline = start + a.soak
        turn = iter(range(10**9))

        async def stream_worker() -> None:
            while time.perf_counter() < deadline:
                p = prompts[next(turn) % len(prompts)]
                o = await stream_one(client, server, p, a.n)
                if o.error:
                    counts["lost"] += 1
                    problems.append(f"lost: {o.error}")
                elif o.text not in (batched[p], solo[p]):
                    counts["corrupted"] += 1
                    problems.append(f"corrupted: {p[:30]!r}: {o.text[:60]!r} != {batched[p][:60]!r}")
                else:
                    counts["completed"] += 1
                    counts["path_variants"] += o.text != batched[p]
                    counts["output_tokens"] += o.output_tokens

        async def sampler() -> None:
            while time.perf_counter() < deadline:
                rss.append((round(time.perf_counter() - start, 1), pid.memory_info().rss / 2**20))
                kv.append(await kv_pages(client, server))
                await asyncio.sleep(a.rss_every)

        await asyncio.gather(sampler(), *(stream_worker() for _ in range(a.c)))
        duration = time.perf_counter() - start
    rss.append((round(duration, 1), pid.memory_info().rss / 2**20))
    return {"mode": "soak", "solo_differs_from_batched": len(differ),
            "solo_vs_batched": [{"prompt": p, "solo": solo[p], "batched": batched[p]} for p in differ],
            "seconds": a.soak, "max_concurrency": a.c, "duration": duration, **counts,
            "output_throughput": counts["output_tokens"] / duration, "problems": problems[:20], "rss_mib": rss,
            "kv_pages": kv,
            "load_average": os.getloadavg()}


async def kv_pages(client: httpx.AsyncClient, server: Server) -> dict[str, float]:
    """The KV pages the server's pools hold and how many of them sessions use, summed over devices, and its
    cached sessions (from /metrics)."""
    text = (await client.get(server.url + "/metrics")).text
    out = {"pool_pages": 0.0, "used_pages": 0.0, "sessions": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        key = {"jitllm_kv_pool_pages": "pool_pages", "jitllm_kv_pages": "used_pages",
               "jitllm_sessions": "sessions"}.get(name.split("{")[0])
        if key and not line.startswith("#"):
            out[key] += float(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", type=int, default=8, help="concurrent streams (jitllmd -parallel, llama-server -np)")
    p.add_argument("-parallel", type=int, default=None, help="jitllmd's slots (default: -c)")
    p.add_argument("-prompts", type=int, default=None, help="requests per run (default: 4 x -c)")
    p.add_argument("-p", type=int, default=48, help="words per prompt (~1.3 tokens each)")
    p.add_argument("-n", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("-rate", type=float, default=math.inf, help="Poisson arrivals per second (default: inf)")
    p.add_argument("-rounds", type=int, default=2)
    p.add_argument("-threads", type=int, default=2)
    p.add_argument("-ctx", type=int, default=1024, help="context per slot (both servers)")
    p.add_argument("-seed", type=int, default=0)
    p.add_argument("-gguf", type=Path, default=None, help="default: the built-in SmolLM2 Q4_1 GGUF")
    p.add_argument("-jlm", type=Path, default=None, help="default: the built-in model's .jlm (from that GGUF)")
    p.add_argument("-llama-server", dest="llama_server", default=os.environ.get("LLAMA_SERVER"),
                   help="llama.cpp's llama-server binary ($LLAMA_SERVER; without it only jitllmd runs)")
    p.add_argument("-jitllmd-args", dest="jitllmd_args", default="", help="more `jitllmd serve` flags")
    p.add_argument("-move", default=None, help="moves POSTed to jitllmd's /v1/placement in turn, ';'-separated")
    p.add_argument("-move-every", dest="move_every", type=float, default=2.0)
    p.add_argument("-soak", type=float, default=None, help="seconds of the soak (jitllmd only)")
    p.add_argument("-rss-every", dest="rss_every", type=float, default=5.0)
    p.add_argument("-cache", default=str(ROOT / "cache"))
    p.add_argument("-json", default=None, help="write the results here")
    a = p.parse_args()
    if a.c < 1 or a.n < 2 or a.rounds < 1 or not a.rate > 0:
        p.error("-c and -rounds must be >= 1, -n >= 2, -rate > 0")
    if a.llama_server and not os.access(a.llama_server, os.X_OK):
        p.error(f"-llama-server {a.llama_server}: not an executable")
    sys.path.insert(0, str(ROOT))
    from jitllm.default_model import default_gguf_path, default_model_path

    if a.gguf is None:
        a.gguf = default_gguf_path()
    if a.jlm is None and a.gguf == default_gguf_path():
        a.jlm = default_model_path()
    header = {"command": " ".join(map(shlex.quote, sys.argv)), "cpu_count": os.cpu_count(),
              "load_average_start": os.getloadavg()}
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    if a.soak:
        data = {**header, **soak(a, make_prompts(a.prompts or 16, a.p, a.seed))}
        failed = data["lost"] or data["corrupted"]
    else:
        data = {**header, **compare(a)}
        failed = False
    data["load_average_end"] = os.getloadavg()
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if a.json:
        write_json(a.json, data)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
