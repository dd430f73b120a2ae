"""Fill a cache folder with exactly what a GPU-machine session needs, and nothing else (at most 64 MiB
travels there): the CUDA kinds of tests/gpu in both kernel families, the llvm kinds its host-side
comparisons load (exact kernels; no llvm key holds a worker count), the CUDA kinds of the benchmark
shapes (fast family; quantized ones in the exact family too, for `gpu_decode.py -gpu-kernels exact`;
their ragged variants in the fast family, for `jitllm batch -devices gpu`), and both the llvm and CUDA
kinds of bench/migrate.py's shapes (-host-presets; its blocks start on the host).

    python bench/device_cache.py -cache cache -presets llama-3.2-3b:f16,smollm2-135m:q4_0
    python bench/device_cache.py -cache cache -presets smollm2-135m:q4_1 -host-presets "" -kv f32,q8_0

Run it here (full TVM); artifacts already in the cache are kept, missing ones compiled, and files of
other keys deleted with -prune (an artifact's key changes whenever a source it depends on does, so age
says nothing about staleness).

llvm artifacts are keyed by the kernel ISA (jitllm.lowering.targets.llvm.host_isa), and the GPU machine's
CPU is not this one: the llvm kinds are compiled for `-cpu-isa` (default avx2, which every x86-64-v3 host
runs), and the commands there must export the same `JITLLM_CPU_ISA` or they compile their own (the H200
host of 2026-12-03 has avx512_vnni and avx512vbmi, so unpinned it would pick avx512vnni).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))


def needed_kinds(presets: list[tuple[str, str]], host_presets: list[tuple[str, str]] = (),
                 kv_types: tuple[str, ...] = ()):
    """(kind, target) pairs: tests/gpu's CUDA kinds (the newer weight formats' in the exact family alone), the
    tiny model's exact llvm kinds and its ragged variants (llvm and CUDA exact; at every KV type, q8_0 on
    tiny-d32), the random MoE models' exact llvm and CUDA kinds and their expert-streaming CUDA kinds
    (test_moe_cuda.py), the presets' CUDA kinds (and their fast ragged variants), and both the exact llvm and the CUDA
    kinds of `host_presets` (bench/migrate.py's blocks start on the host); the presets' kinds at the default
    f16 KV and at `kv_types` (bench/kv_types.py -devices cuda:0 loads each type)."""
    from kinds import (
        expert_streaming_kinds,
        f16_kv_test_kinds,
        format_test_kinds,
        gpu_test_kinds,
        kv_model_preset,
        moe_test_layouts,
        q8_kv_test_kinds,
        ragged_test_kinds,
    )

    from jitllm.ir.config import DEFAULT_KV_TYPE, KV_DTYPES
    from jitllm.lowering.target import kind_for_target
    from jitllm.lowering.targets.cuda import CudaTarget
    from jitllm.lowering.targets.llvm import LlvmTarget
    from jitllm.random_model import preset_layout

    cuda, fast, host = CudaTarget("sm_90"), CudaTarget("sm_90", "fast"), LlvmTarget("exact")

    def as_run(kind, target):  # what Executor.kind_on gives a device of `target`, and its decode variant
        kind = kind_for_target(kind, target)
        return [(kind, target), (kind.decode_variant(), target)]

    pairs = [(kind, target) for kind in gpu_test_kinds() for target in (cuda, fast)]
    pairs += [(kind, cuda) for kind in [*format_test_kinds(), *f16_kv_test_kinds(), *q8_kv_test_kinds()]]
    for kv_type in KV_DTYPES:  # (the tests load the tiny model at the default f16 KV, some pin f32; tiny-d32 at q8_0)
        tiny = preset_layout(kv_model_preset(kv_type), "q4_1").with_kv_type(kv_type)
        for kind in [*tiny.block_kinds, tiny.head]:
            pairs += as_run(kind, host) + as_run(kind, cuda) + as_run(kind, fast)
        pairs += [(kind, target) for target in (host, cuda) for kind in ragged_test_kinds(target, kv_type)]
    for layout in moe_test_layouts():  # (test_moe_cuda.py: MoE blocks on cuda:0 and on the host, exact kernels)
        for kind in [*layout.block_kinds, layout.head]:
            pairs += as_run(kind, host) + as_run(kind, cuda)
    pairs += [(kind, cuda) for kind in expert_streaming_kinds(cuda)]
    preset_kv = list(dict.fromkeys([DEFAULT_KV_TYPE, *kv_types]))
    for kv_type in preset_kv:
        for preset, wtype in [*presets, *host_presets]:
            layout = preset_layout(preset, wtype).with_kv_type(kv_type)
            for kind in [*layout.block_kinds, layout.head]:
                pairs += as_run(kind, fast) + (as_run(kind, cuda) if wtype.startswith("q") else [])
        for preset, wtype in presets:  # the ragged variants `jitllm batch -devices gpu` runs (fast family)
            layout = preset_layout(preset, wtype).with_kv_type(kv_type)
            pairs += [(kind_for_target(kind, fast).ragged_variant(), fast)
                      for kind in [*layout.block_kinds, layout.head]]
        for preset, wtype in host_presets:
            layout = preset_layout(preset, wtype).with_kv_type(kv_type)
            for kind in [*layout.block_kinds, layout.head]:
                pairs += as_run(kind, host)
    return list(dict.fromkeys(pairs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-cache", default="cache")
    ap.add_argument("-presets", default="llama-3.2-3b:f16,llama-3.2-3b:q4_0,smollm2-135m:q4_0",
                    help="comma-separated preset:wtype pairs for bench/gpu_decode.py")
    ap.add_argument("-host-presets", default="smollm2-135m:f16,llama-3.2-3b:f16",
                    help="preset:wtype pairs for bench/migrate.py (exact llvm kinds and CUDA kinds)")
    ap.add_argument("-kv", default="", help="KV types for the presets' kinds beside the default f16 (f32,q8_0)")
    ap.add_argument("-prune", action="store_true", help="delete every other file in the cache folder")
    ap.add_argument("-cpu-isa", default="avx2",
                    help="kernel ISA of the llvm kinds (export JITLLM_CPU_ISA=<it> on the GPU machine too)")
    args = ap.parse_args()
    os.environ["JITLLM_CPU_ISA"] = args.cpu_isa

    from jitllm.lowering.cache import get_artifact, stderr_log

    presets = [tuple(p.split(":")) for p in args.presets.split(",") if p]
    host_presets = [tuple(p.split(":")) for p in args.host_presets.split(",") if p]
    keep: set[Path] = set()
    kv_types = tuple(t for t in args.kv.split(",") if t)
    for kind, target in needed_kinds(presets, host_presets, kv_types):
        directory = get_artifact(kind, target, args.cache, log=stderr_log).path.parent.resolve()
        keep |= {f.resolve() for f in directory.iterdir()}  # (the artifact and its sidecar)
    root = Path(args.cache)
    stale = [f for f in root.rglob("*") if f.is_file() and f.resolve() not in keep]
    if args.prune:
        for f in stale:
            f.unlink()
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    print(f"{len(keep) // 2} artifacts needed; {len(stale)} other files {'deleted' if args.prune else 'left (use -prune)'}; "
          f"cache {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
