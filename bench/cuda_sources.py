"""Write the CUDA source TVM generates for every kind of a set of shapes, one file per kind, so a refactor
can show it left the GPU code byte-identical (`diff -r BEFORE AFTER`). No GPU or nvcc needed: the source
is read before nvcc would run (~2 s per kind on 2 cores).

    python bench/cuda_sources.py -out /tmp/cuda-after            # then diff -r /tmp/cuda-before /tmp/cuda-after
    python bench/cuda_sources.py -out /tmp/cuda-kv -kv f16,q8_0 -presets smollm2-135m:q4_1   # KV types
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT = "tiny:f32,tiny:f16,tiny:q8_0,tiny:q4_0,tiny:q4_1,smollm2-135m:q4_1,llama-3.2-3b:f16,llama-3.2-3b:q4_0"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-out", required=True, help="folder to write <preset>-<wtype>-<family>-<arch>-<n>.cu into")
    ap.add_argument("-presets", default=DEFAULT, help="comma-separated preset:wtype pairs")
    ap.add_argument("-archs", default="sm_90,sm_80")
    ap.add_argument("-kv", default="f32", help="comma-separated KV cache types of the blocks (f32, f16, q8_0)")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for pair in args.presets.split(","):
        preset, wtype = pair.split(":")
        for kv_type in args.kv.split(","):
            write_sources(out, preset, wtype, kv_type, args.archs.split(","))


def write_sources(out: Path, preset: str, wtype: str, kv_type: str, archs: list[str]) -> None:
    """One .cu per kind (block, head, their decode variants), family and arch; `-kv_<type>` in the name but
    for f32 (the names from before KV types)."""
    import tvm

    from jitllm.ir.blocks import build_block_graph
    from jitllm.lowering.onnx_import import to_relax
    from jitllm.lowering.target import kind_for_target
    from jitllm.lowering.targets.cuda import CudaTarget, _pipeline
    from jitllm.random_model import preset_layout

    layout = preset_layout(preset, wtype).with_kv_type(kv_type)
    suffix = "" if kv_type == "f32" else f"-kv_{kv_type}"
    for family in ("fast", "exact"):
        for arch in archs:
            target = CudaTarget(arch, family)
            kinds = [kind_for_target(layout.block_kinds[0], target), kind_for_target(layout.head, target)]
            for n, kind in enumerate(kinds + [k.decode_variant() for k in kinds]):
                mod = to_relax(kind, build_block_graph(kind), target)
                tvm_target = target.tvm_target()
                with tvm_target, tvm.transform.PassContext(opt_level=3):
                    executable = tvm.compile(mod, target=tvm_target, relax_pipeline=_pipeline(tvm_target))
                source = executable.mod.imports[0].imports[0].inspect_source("")
                name = f"{preset}-{wtype}{suffix}-{family}-{arch}-{n}.cu"
                (out / name).write_text(source)
                print(f"{name}: {len(source)} characters", flush=True)


if __name__ == "__main__":
    main()
