"""One fast CPU linear kernel timed alone under each kernel instruction set this host runs (targets/llvm.py):

    TVM_NUM_THREADS=1 python bench/cpu_isa_kernels.py [-wtype q4_1] [-shape 2048x2048] [-tokens 1,64]

Random weights in the stored layout, random activations; per ISA and token count the best of -rounds timings
of a loop of calls (the ISAs alternating), then whether the outputs equal the first ISA's bit for bit (the int8 dot products of every
x86 ISA sum the same integers).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-wtype", default="q4_1", choices=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("-shape", default="2048x2048", help="NxK of the weight")
    ap.add_argument("-tokens", default="1,64", help="token counts M")
    ap.add_argument("-rounds", type=int, default=7, help="timings per ISA, alternating (the best is kept)")
    args = ap.parse_args()
    import tvm

    from jitllm.core.layouts import weight_parts
    from jitllm.lowering.kernels.cpu.linear import linear_kernel
    from jitllm.lowering.targets.llvm import host_isas, isa_target_dict

    n, k = (int(v) for v in args.shape.split("x"))
    rng = np.random.default_rng(0)
    parts = []
    for name, shape, dtype in weight_parts(args.wtype, n, k):
        if dtype == "float16":
            parts.append((rng.random(shape) * 0.01).astype(np.float16) * (-1 if name == "m" else 1))
        else:
            parts.append(rng.integers(-128 if dtype == "int8" else 0, 128 if dtype == "int8" else 256, shape,
                                      dtype=dtype))
    isas = [isa for isa in host_isas() if isa != "generic"]
    if not isas:
        sys.exit("cpu_isa_kernels: this host has no fast kernel ISA")
    fns = {}
    for isa in isas:
        symbol, func = linear_kernel(args.wtype, n, k, "fast", isa)
        fns[isa] = tvm.compile(tvm.IRModule({symbol: func}), target=tvm.target.Target(isa_target_dict(isa)))[symbol]
    print(f"{args.wtype} {n}x{k}, {tvm.get_global_func('runtime.NumThreads')()} TVM worker(s)")
    for m in (int(v) for v in args.tokens.split(",")):
        x = tvm.runtime.tensor(rng.standard_normal((m, k // 32, 32)).astype(np.float32))
        weights = [tvm.runtime.tensor(p) for p in parts]
        ys = {isa: tvm.runtime.tensor(np.zeros((m, n // 8, 8), np.float32)) for isa in fns}
        times = {isa: float("inf") for isa in fns}
        reps = max(3, int(1e9 / (n * k * m)))
        for _ in range(args.rounds):  # the ISAs alternate, so a busy spell of the machine hits them alike
            for isa, fn in fns.items():
                fn(x, *weights, ys[isa])
                start = time.perf_counter()
                for _ in range(reps):
                    fn(x, *weights, ys[isa])
                times[isa] = min(times[isa], (time.perf_counter() - start) / reps)
        outs = {isa: y.numpy() for isa, y in ys.items()}
        first = isas[0]
        for isa in isas:
            same = "bit-identical" if np.array_equal(outs[isa], outs[first]) else "DIFFERENT"
            print(f"  M={m:<4d} {isa:12s} {times[isa] * 1e3:8.3f} ms  {times[first] / times[isa]:5.2f}x"
                  f"  {2 * n * k * m / times[isa] / 1e9:6.1f} GOP/s  {same} vs {first}")


if __name__ == "__main__":
    main()
