"""Kernels one at a time: the prefill tensor-core linears (against the f32 CUDA-core kernel they
replaced), the prefill attention (the exact family's tiled f32 kernel and the fast family's on tensor
cores), and the decode matvecs over quantized weights (the exact f32
GEMV against the int8-activation dp4a GEMV at several row groups per thread block), checked against
float64 numpy and timed on the GPU.

    python bench/gpu_kernels.py build [-out build/gpu_kernels] [-parts matvecs,linears,attention]  # here
    python3 bench/gpu_kernels.py run [-dir build/gpu_kernels]         # there (carry the folder)

`build` compiles, for the benchmark shapes (the 3B shape's fused Q/K/V, O, gate/up and down matrices;
SmolLM2's Q/K/V and down; every weight format the tensor-core kernel takes), one module per linear
holding `mma` (the exact family's prefill kernel), `mma_f16` (the WMMA kernel with f16 operands alone, the
fast family's before stop 16), `mma_f16_m128` (the same with 128-row tiles, each warp 64 x 64), `gemm` (the
fast family's ldmatrix + mma.sync GEMM over f16 activations, kernels_gpu_gemm) and `simt`
(the dlight-scheduled f32 kernel, the stop 11 path), one module of the fast family's operand passes
(norm, SwiGLU and plain f16 conversion at the benchmark shapes' widths),
and one module per attention shape holding `attention` and `attention_mma`, and one module per decode matvec (the 3B and SmolLM2 shapes with the
ops a decode step folds into them) holding `exact` and `int8_g<RG>`. `run` prints, per kernel and row
count, the median time of 3 x 20 launches, TFLOP/s and the largest error relative to the largest float64
output; for the matvecs, the time per launch over copies of the weights that together overflow the L2
cache, the bandwidth that is, and the error against float64 and (int8) against a numpy emulation of
the activations' int8 quantization.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

LINEARS = {"llama-3.2-3b": [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)],
           "smollm2-135m": [(960, 576), (576, 1536)]}
FORMATS = ("f16", "q8_0", "q4_0", "q4_1")
MATVECS = {"llama-3.2-3b": [(5120, 3072, "RmsNormLinear"), (3072, 3072, "LinearAdd"), (16384, 3072, "RmsNormLinear"),
                            (3072, 8192, "SwiGLULinearAdd"), (3072, 3072, "Linear")],
           "smollm2-135m": [(960, 576, "RmsNormLinear"), (576, 576, "LinearAdd"), (3072, 576, "RmsNormLinear"),
                            (576, 1536, "SwiGLULinearAdd")]}
MATVEC_FORMATS = {"q4_0": (1, 2, 4), "q4_1": (None,), "q8_0": (None,)}  # row groups per block tried (None: default)
EPS = 1e-5
L2_BYTES = 160 * 2**20  # weight copies per matvec timing: together more than the H200's 50 MB L2
ATTENTION_CASES = [(1, 512, [0]), (1, 2048, [0]), (1, 256, [600]), (2, 37, [5, 100]), (1, 70, [33])]  # (batch, new tokens, history per sequence)
P = 16  # page size


def build(out: Path, parts: set[str]) -> None:
    import tvm
    from tvm.s_tir import dlight as dl

    from jitllm.ir.ops import LINEAR_ADD, NORM_LINEAR, SWIGLU_LINEAR_ADD
    from jitllm.lowering.kernels.cuda.attention_mma import mma_attention_kernel
    from jitllm.lowering.kernels.cuda.basic import attention_kernel, linear_kernel
    from jitllm.lowering.kernels.cuda.gemm import gemm_kernel, operand_kernel
    from jitllm.lowering.kernels.cuda.mma import mma_linear_kernel
    from jitllm.lowering.targets.cuda_runtime import ensure_cuda_runtime
    from jitllm.random_model import preset_layout

    ensure_cuda_runtime(allow_stub=True)
    os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
    out.mkdir(parents=True, exist_ok=True)

    def compile_to(name: str, funcs: dict) -> None:
        start = time.perf_counter()
        mod = tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()})
        with target, tvm.transform.PassContext(opt_level=3):
            mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.Fallback())(mod)
            lib = tvm.tirx.build(mod, target=target)
        tmp = out / f"{name}.tmp.so"
        lib.export_library(str(tmp))
        tmp.replace(out / f"{name}.so")
        print(f"built {name} in {time.perf_counter() - start:.1f}s", flush=True)

    manifest = {"linears": [], "attention": [], "matvecs": [], "operands": []}
    for preset, shapes in LINEARS.items() if "linears" in parts else ():
        for n, k in shapes:
            for wtype in FORMATS:
                name = f"linear_{wtype}_{n}x{k}"
                compile_to(name, {"mma": mma_linear_kernel(wtype, n, k)[1], "simt": linear_kernel(wtype, n, k)[1],
                                  "mma_f16": mma_linear_kernel(wtype, n, k, split=False)[1],
                                  "mma_f16_m128": mma_linear_kernel(wtype, n, k, split=False, bm=128)[1],
                                  "gemm": gemm_kernel(wtype, n, k)[1]})
                manifest["linears"].append({"name": name, "wtype": wtype, "n": n, "k": k})
    if "linears" in parts:  # the operand passes before each GEMM
        funcs = {}
        for preset in LINEARS:
            c = preset_layout(preset, "f16").config
            for family, k in ((NORM_LINEAR, c.hidden), (LINEAR_ADD, c.hidden), (SWIGLU_LINEAR_ADD, c.ffn)):
                symbol, funcs[symbol] = operand_kernel(family, k, EPS)
                manifest["operands"].append({"symbol": symbol, "family": family, "k": k})
        compile_to("operands", funcs)
    from jitllm.lowering.kernels.cuda.gemv import gemv_kernel
    from jitllm.lowering.kernels.cuda.gemv_int8 import groups_per_block, int8_gemv_kernel

    for preset, shapes in MATVECS.items() if "matvecs" in parts else ():
        for n, k, family in shapes:
            for wtype, groups in MATVEC_FORMATS.items():
                funcs = {"exact": gemv_kernel(wtype, n, k, family, EPS)[1]}
                for rg in groups:
                    rg = rg or groups_per_block(n // 8)
                    if (n // 8) % rg == 0:
                        funcs[f"int8_g{rg}"] = int8_gemv_kernel(wtype, n, k, family, EPS, rg)[1]
                name = f"matvec_{wtype}_{n}x{k}_{family}"
                compile_to(name, funcs)
                manifest["matvecs"].append({"name": name, "wtype": wtype, "n": n, "k": k, "family": family,
                                            "funcs": list(funcs)})
    for preset in LINEARS if "attention" in parts else ():
        kind = preset_layout(preset, "f16").block_kinds[0]
        c, name = kind.config, f"attention_{preset}"
        compile_to(name, {"attention": attention_kernel(kind)[1], "attention_mma": mma_attention_kernel(kind)[1]})
        manifest["attention"].append({"name": name, "heads": c.heads, "kv_heads": c.kv_heads, "head_dim": c.head_dim})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def random_weights(wtype: str, n: int, k: int, rng) -> tuple[list[np.ndarray], np.ndarray]:
    """The kernel's weight arguments (jitllm's layout parts of a random [n, k] matrix, quantized by gguf's
    reference quantizers as `jitllm convert` does) and the float64 matrix they dequantize to."""
    from jitllm.core.quant import dequantize, parts_from_float

    parts = parts_from_float(wtype, rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k)))
    return list(parts.values()), dequantize(wtype, parts).astype(np.float64)


def attention_reference(q, k, v, pages, pt, past) -> np.ndarray:
    """Causal attention of the new queries over each sequence's paged history plus the new keys."""
    batch, s, heads, d = q.shape
    kv_heads = k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        n = past[b]
        rows = [pages[pt[b, t // P], :, :, t % P, :] for t in range(n)]
        keys = np.concatenate([np.array([r[0] for r in rows]).reshape(n, kv_heads, d), k[b]]).astype(np.float64)
        values = np.concatenate([np.array([r[1] for r in rows]).reshape(n, kv_heads, d), v[b]]).astype(np.float64)
        masked = np.arange(n + s)[None, :] > (n + np.arange(s))[:, None]
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = q[b, :, h].astype(np.float64) @ keys[:, kv].T / np.sqrt(d)
            scores[masked] = -np.inf
            p = np.exp(scores - scores.max(1, keepdims=True))
            out[b, :, h] = (p / p.sum(1, keepdims=True)) @ values[:, kv]
    return out


def quantize_int8(v: np.ndarray) -> np.ndarray:
    """v (float32) through the fast kernels' int8 activations: per 32-block, scale max|v|/127, round half
    to even; returned dequantized, in float64."""
    blocks = v.reshape(-1, 32).astype(np.float32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    return (np.rint(blocks * inv).astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(v.shape)


def matvec_case(entry: dict, rng) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray, np.ndarray]:
    """(inputs before the weights, after them, float64 output, int8-emulated output) of one matvec with
    its folded ops: the norm (1/RMS of the input times the norm weight), SwiGLU, the residual add."""
    n, k, family = entry["n"], entry["k"], entry["family"]
    parts, w = random_weights(entry["wtype"], n, k, rng)
    x = rng.standard_normal((1, 2 * k if family == "SwiGLULinearAdd" else k), dtype=np.float32)
    before, after = [x], []
    v, scale = x[0], 1.0
    if family == "SwiGLULinearAdd":
        g, u = x[0, :k], x[0, k:]
        v = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
    if family == "RmsNormLinear":
        nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
        before.append(nw)
        scale = 1 / np.sqrt(np.mean(v.astype(np.float64) ** 2) + EPS)
        v = (v * nw).astype(np.float32)
    exact = (w @ v.astype(np.float64)) * scale
    emulated = (w @ quantize_int8(v)) * scale
    if family in ("LinearAdd", "SwiGLULinearAdd"):
        res = rng.standard_normal((1, n // 8, 8), dtype=np.float32)
        after.append(res)
        exact, emulated = exact + res.reshape(n), emulated + res.reshape(n)
    return [*before, *parts], after, exact, emulated


def run_matvecs(folder: Path, manifest: dict, dev, up, rng) -> None:
    import tvm

    for entry in manifest.get("matvecs", []):
        lib = tvm.runtime.load_module(str(folder / f"{entry['name']}.so"))
        inputs, after, exact, emulated = matvec_case(entry, rng)
        weight_bytes = sum(a.nbytes for a in inputs[1:] if a.ndim > 1)
        copies = [[up(a) for a in inputs + after] for _ in range(max(1, -(-L2_BYTES // weight_bytes)))]
        y = tvm.runtime.empty((1, entry["n"] // 8, 8), "float32", dev)
        line = [f"{entry['wtype']:>5} {entry['n']:>5} x {entry['k']:<5} {entry['family']:<16}"]
        for fn in entry["funcs"]:
            f = lib[fn]
            f(*copies[0], y)
            got = y.numpy().reshape(-1)
            scale = np.abs(exact).max()
            err = f"err {np.abs(got - exact).max() / scale:.1e}"
            if fn.startswith("int8"):
                err += f" emu {np.abs(got - emulated).max() / scale:.1e}"
            times = []
            for _ in range(3):
                dev.sync()
                start = time.perf_counter()
                for _ in range(max(1, 40 // len(copies))):
                    for args in copies:
                        f(*args, y)
                dev.sync()
                times.append((time.perf_counter() - start) / (max(1, 40 // len(copies)) * len(copies)))
            t = float(np.median(times))
            line.append(f"{fn} {t * 1e6:7.2f} us {weight_bytes / t / 1e9:6.0f} GB/s {err}")
        print(" | ".join(line), flush=True)


def run_operands(folder: Path, manifest: dict, dev, up, rng) -> None:
    """The operand passes at 512 and 2048 rows: time and error against float64 numpy."""
    if not manifest.get("operands"):
        return
    import tvm

    lib = tvm.runtime.load_module(str(folder / "operands.so"))
    for entry in manifest["operands"]:
        k, family = entry["k"], entry["family"]
        for m in (512, 2048):
            x = rng.standard_normal((m, 2 * k if family == "SwiGLULinearAdd" else k)).astype(np.float32)
            g = rng.standard_normal(k).astype(np.float32)
            x64 = x.astype(np.float64)
            if family == "RmsNormLinear":
                reference, args = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + EPS) * g, [up(x), up(g)]
            elif family == "SwiGLULinearAdd":
                reference, args = x64[:, :k] / (1 + np.exp(-x64[:, :k])) * x64[:, k:], [up(x)]
            else:
                reference, args = x64, [up(x)]
            out = tvm.runtime.empty((m, k), "float16", dev)
            lib[entry["symbol"]](*args, out)
            err = np.abs(out.numpy() - reference).max() / np.abs(reference).max()
            t = lib.time_evaluator(entry["symbol"], dev, number=20, repeat=3)(*args, out).median
            print(f"operand {entry['symbol']} M={m}: {t * 1e6:.1f} us, error {err:.1e}", flush=True)


def run(folder: Path) -> None:
    import tvm

    from jitllm.lowering.targets.cuda_runtime import ensure_cuda_runtime

    ensure_cuda_runtime(allow_stub=False)
    dev = tvm.cuda(0)
    manifest = json.loads((folder / "manifest.json").read_text())
    up = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
    rng = np.random.default_rng(0)
    run_matvecs(folder, manifest, dev, up, rng)
    for entry in manifest["linears"]:
        n, k = entry["n"], entry["k"]
        lib = tvm.runtime.load_module(str(folder / f"{entry['name']}.so"))
        parts, w = random_weights(entry["wtype"], n, k, rng)
        weights = [up(p) for p in parts]
        for m in (512, 2048):
            x = rng.standard_normal((m, k), dtype=np.float32)
            exact = x.astype(np.float64) @ w.T
            line = [f"{entry['wtype']:>5} {n:>5} x {k:<5} M={m:<5}"]
            for fn in [f for f in ("simt", "mma", "mma_f16", "mma_f16_m128", "gemm") if lib.implements_function(f, True)]:
                y = tvm.runtime.empty((m, n), "float32", dev)
                xin = up(x.astype(np.float16) if fn == "gemm" else x)  # the GEMM takes the operand pass's f16
                lib[fn](xin, *weights, y)
                err = np.abs(y.numpy() - exact).max() / np.abs(exact).max()
                t = lib.time_evaluator(fn, dev, number=20, repeat=3)(xin, *weights, y).median
                line.append(f"{fn} {t * 1e6:8.1f} us {2 * m * n * k / t / 1e12:6.1f} TFLOP/s err {err:.1e}")
            print(" | ".join(line), flush=True)
    run_operands(folder, manifest, dev, up, rng)
    for entry in manifest["attention"]:
        lib = tvm.runtime.load_module(str(folder / f"{entry['name']}.so"))
        heads, kv_heads, d = entry["heads"], entry["kv_heads"], entry["head_dim"]
        for batch, s, pasts in ATTENTION_CASES:
            pages = rng.standard_normal((80, 2, kv_heads, P, d)).astype(np.float32)
            pt = np.stack([rng.permutation(80)[:40] for _ in range(batch)]).astype(np.int32)
            q = rng.standard_normal((batch, s, heads, d)).astype(np.float32)
            k = rng.standard_normal((batch, s, kv_heads, d)).astype(np.float32)
            v = rng.standard_normal((batch, s, kv_heads, d)).astype(np.float32)
            past = np.array(pasts, np.int32)
            args = [up(a) for a in (q, k, v, pages, pt, past)]
            reference = attention_reference(q, k, v, pages, pt, past)
            line = [f"attention {entry['name'][10:]} batch {batch} new {s} history {pasts}"]
            for fn in ("attention", "attention_mma"):
                out = tvm.runtime.empty(q.shape, "float32", dev)
                lib[fn](*args, out)
                err = np.abs(out.numpy() - reference).max() / np.abs(reference).max()
                t = lib.time_evaluator(fn, dev, number=10, repeat=3)(*args, out).median
                line.append(f"{fn} {t * 1e6:.1f} us, error {err:.1e}")
            print(" | ".join(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["build", "run"])
    ap.add_argument("-out", "-dir", dest="folder", default="build/gpu_kernels")
    ap.add_argument("-parts", default="matvecs,linears,attention", help="what `build` compiles")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.step == "build":
        build(Path(args.folder), set(args.parts.split(",")))
    else:
        run(Path(args.folder))


if __name__ == "__main__":
    main()
