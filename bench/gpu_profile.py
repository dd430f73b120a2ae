"""Where a decode step's time goes on the GPU: per-kernel times of one block's decode program (TVM VM
instrument, synchronized around each call) and the host time of a whole step; with -prefill N, one
block's prefill calls and a whole prefill forward (timed, then under cProfile). Run on the GPU machine: python3 bench/gpu_profile.py -preset llama-3.2-3b -wtype f16"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import tvm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-preset", default="llama-3.2-3b")
    ap.add_argument("-wtype", default="f16")
    ap.add_argument("-cache", default="cache")
    ap.add_argument("-history", type=int, default=512)
    ap.add_argument("-prefill", type=int, default=0,
                    help="also time each call of one block's prefill program over this many prompt tokens")
    args = ap.parse_args()

    from gpu_decode import random_model

    from jitllm.model import load
    from jitllm.runtime.engine.kv_pages import PageTable

    with tempfile.TemporaryDirectory() as tmp:
        path, _ = random_model(args.preset, args.wtype, tmp)
        model = load(path, devices="cuda:0", ctx=args.history + 64, cache_dir=args.cache)
    ex = model.executor
    session = ex.new_session()
    rng = np.random.default_rng(0)
    ex.forward(session, [int(t) for t in rng.integers(4, 259, args.history)])
    dev = ex.blocks[0].device
    times = []
    for _ in range(10):
        start = time.perf_counter()
        ex.forward(session, [5])
        times.append(time.perf_counter() - start)
    print(f"decode step: median {1e3 * np.median(times):.2f} ms over 10 steps")
    if ex._graphs:
        graph = next(iter(ex._graphs.values())).graph
        replays = []
        for _ in range(10):
            start = time.perf_counter()
            graph.replay()
            replays.append(time.perf_counter() - start)
        print(f"its captured graph alone (every block and the head on the GPU, then a sync): median "
              f"{1e3 * np.median(replays):.2f} ms; the rest of the step is host work")
        fence, runs = dev.graphs.fence(), 20
        start = time.perf_counter()
        for _ in range(runs):
            graph.launch()
        fence.record()
        fence.wait()
        print(f"{runs} replays launched back to back, one wait: {1e3 * (time.perf_counter() - start) / runs:.2f} ms "
              "each (the GPU's time per step with no host turn between: what pipelined decode approaches)")
    unit = ex.blocks[0]
    from jitllm.lowering.cache import get_artifact

    kind = ex.kind_on(0, dev).decode_variant() if unit.decode_program is not None else ex.kind_on(0, dev)
    artifact = get_artifact(kind, unit.device.target, args.cache)
    vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(artifact.path)), dev.backend.tvm_device)
    spent: dict[str, list[float]] = {}
    clock = {}

    def instrument(func, name, before, ret, *call_args):
        dev.synchronize()
        if before:
            clock["t"] = time.perf_counter()
        else:
            spent.setdefault(str(name), []).append(time.perf_counter() - clock["t"])
        return 0

    past = session.length
    table: PageTable = session.tables[0]
    x = dev.upload(rng.standard_normal((1, 1, ex.layout.config.hidden)).astype(np.float32))
    cos = dev.upload(ex.rope[0][past:past + 1][None])
    sin = dev.upload(ex.rope[1][past:past + 1][None])
    past_t = dev.upload(np.array([past], np.int32))
    call = (x, cos, sin, ex.pools[dev.name].pages, table.tensor(), past_t, *unit.weights)
    print(f"one block main(): {_time_main(dev, unit.program_for(1), call, 20):.1f} us (async launches + sync)")
    _per_call(vm, call, instrument, spent)
    kernels: list[tuple[str, object, tuple]] = []

    def collect(func, name, before, ret, *call_args):
        if before and not str(name).startswith("vm.builtin"):
            kernels.append((str(name), func, call_args))
        return 0

    vm.set_instrument(collect)
    vm["main"](*call)
    from jitllm.runtime.backends.cuda_graph import CudaGraphRecorder

    reps = 50
    recorder = CudaGraphRecorder(dev.backend.tvm_device, "profile")
    print(f"GPU time per kernel ({reps} launches of it captured in one CUDA graph, no host in between):")
    total = 0.0
    for name, func, call_args in kernels:
        graph, _ = recorder.capture(lambda launch: [launch(func, *call_args) for _ in range(reps)])
        graph.replay()
        start = time.perf_counter()
        graph.replay()
        spent_us = 1e6 * (time.perf_counter() - start) / reps
        total += spent_us
        print(f"  {spent_us:8.2f} us  {name}")
    print(f"  {total:8.2f} us  sum over the block's kernels")
    if args.prefill:
        prompt = ex.new_session()
        table = PageTable(ex.pools[dev.name])
        table.ensure(args.prefill)
        n = args.prefill
        x = dev.upload(rng.standard_normal((1, n, ex.layout.config.hidden)).astype(np.float32))
        call = (x, dev.upload(ex.rope[0][:n][None]), dev.upload(ex.rope[1][:n][None]), ex.pools[dev.name].pages,
                table.tensor(), dev.upload(np.array([0], np.int32)), *unit.weights)
        artifact = get_artifact(ex.kind_on(0, dev), unit.device.target, args.cache)
        vm = tvm.runtime.vm.VirtualMachine(tvm.runtime.load_module(str(artifact.path)), dev.backend.tvm_device)
        spent.clear()
        print(f"prefill of {n} tokens, one block:")
        _per_call(vm, call, instrument, spent)
        ex.close_session(prompt)
        print(f"one block's prefill main(): {_time_main(dev, unit.program_for(n), call, 10):.1f} us "
              "(async launches + sync)")
        _profile_forward(ex, n, rng)


def _time_main(dev, program, call: tuple, reps: int) -> float:
    """µs per call of a block program's main, launched `reps` times back to back after warm-up calls."""
    for _ in range(3):
        program.main(*call)
    dev.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        program.main(*call)
    dev.synchronize()
    return 1e6 * (time.perf_counter() - start) / reps


def _profile_forward(ex, n: int, rng) -> None:
    """A whole prefill forward of n tokens in a new session, timed, then again under cProfile: where the
    host spends it (time inside a download is time waiting for the GPU)."""
    import cProfile
    import pstats

    prompt = [int(t) for t in rng.integers(4, 259, n)]
    for profiled in (False, True):
        session = ex.new_session()
        profiler = cProfile.Profile()
        start = time.perf_counter()
        if profiled:
            profiler.enable()
        ex.forward(session, prompt)
        profiler.disable()
        print(f"prefill forward of {n} tokens{' under cProfile' if profiled else ''}: "
              f"{1e3 * (time.perf_counter() - start):.2f} ms")
        ex.close_session(session)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


def _per_call(vm, call: tuple, instrument, spent: dict[str, list[float]]) -> None:
    """Run main 5 times with a synchronizing instrument; print each function's median time per call."""
    vm.set_instrument(instrument)
    for _ in range(5):
        vm["main"](*call)
    rows = sorted(((np.median(v), len(v) // 5, k) for k, v in spent.items()), reverse=True)
    print("per call (synchronized, median), calls per block, function:")
    for t, count, name in rows[:25]:
        print(f"  {1e6 * t:8.1f} us  x{count:<3} {name}")


if __name__ == "__main__":
    main()
