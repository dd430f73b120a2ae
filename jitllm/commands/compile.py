"""`jitllm compile MODEL`: fill the artifact cache ahead of time, one artifact per block kind."""

from __future__ import annotations

import os
from dataclasses import replace

import click

from jitllm.commands.common import KV_TYPES, WEIGHT_TYPES, opt, regular_file

TARGET_NAMES = ("llvm", "cuda", "onnxruntime", "webgpu")
"""jitllm.lowering.targets.TARGETS' names, repeated so --help needs no import (tests/test_cli.py checks them)."""


@click.command(name="compile")
@click.argument("model", metavar="MODEL", required=False)
@opt("preset", default=None, help="compile a random-weight shape instead of a model file (e.g. llama-3.2-3b)")
@opt("wtype", default="q4_1", show_default=True, type=click.Choice(WEIGHT_TYPES),
     help="weight type of -preset")
@opt("target", "target_name", type=click.Choice(TARGET_NAMES), default="llvm", show_default=True)
@opt("arch", default=None, help="GPU architecture for cuda (default sm_90)")
@opt("cpu-kernels", "cpu_kernels", type=click.Choice(["fast", "exact"]), default="fast", show_default=True,
     help="llvm kernel family, as `run -cpu-kernels` picks")
@opt("gpu-kernels", "gpu_kernels", type=click.Choice(["fast", "exact"]), default="fast", show_default=True,
     help="cuda kernel family, as `run -gpu-kernels` picks")
@opt("ctk", "kv_type", type=click.Choice(KV_TYPES), default="f16", show_default=True,
     help="KV cache type, as `run -ctk` picks (f32 on targets that lack it)")
@opt("cache", "cache_dir", default=None, help="cache directory (default ./cache or $JITLLM_CACHE_DIR)")
def compile_command(model: str | None, preset: str | None, wtype: str, target_name: str, arch: str | None,
                    cpu_kernels: str, gpu_kernels: str, kv_type: str, cache_dir: str | None) -> None:
    """Compile every block kind of MODEL for a target into the cache (with the decode and the batched-step
    variants the target runs)."""
    from jitllm.core.jlm import JlmFile
    from jitllm.ir.block_type import RECURRENT
    from jitllm.ir.blocks import block_type
    from jitllm.lowering.cache import get_artifact
    from jitllm.lowering.target import kind_for_target
    from jitllm.lowering.targets import TARGETS, get_target
    from jitllm.runtime.model_layout import ModelLayout

    if (model is None) == (preset is None):
        raise click.UsageError("give a MODEL file or -preset NAME (not both)")
    if preset is not None:
        from jitllm.random_model import preset_layout

        layout = preset_layout(preset, wtype)
    else:
        layout = ModelLayout.from_file(JlmFile(regular_file(model)))
    layout = layout.with_kv_type(kv_type)
    family = {"cpu-kernels": cpu_kernels, "gpu-kernels": gpu_kernels}.get(TARGETS[target_name].caps.kernels_flag, "fast")
    target = get_target(target_name, arch, family)
    general = list(dict.fromkeys(kind_for_target(k, target) for k in [*layout.block_kinds, layout.head]))
    kinds = list(general)
    if target.caps.decode_variants:
        kinds += [k.decode_variant() for k in general]
    if target.caps.ragged_batches and all(block_type(k).state != RECURRENT for k in layout.block_kinds):
        kinds += [k.ragged_variant() for k in general]  # (`jitllm batch` and jitllmd's batched steps)
    cache_dir = cache_dir or os.environ.get("JITLLM_CACHE_DIR")
    built = cached = 0
    for kind in kinds:
        artifact = get_artifact(kind, target, cache_dir)
        users = [str(i) for i, k in enumerate(layout.block_kinds)
                 if kind_for_target(k, target) == replace(kind, decode=False, ragged=False)] or ["head"]
        what = f"{kind.kind}{' decode' if kind.decode else ''}{' ragged' if kind.ragged else ''} ({_span(users)})"
        if artifact.built:
            built += 1
            click.echo(f"compiled {what} for {target.name} in {artifact.seconds:.1f}s -> {artifact.path}")
        else:
            cached += 1
            click.echo(f"cached   {what} for {target.name}: {artifact.path}")
    click.echo(f"{len(kinds)} kinds: {built} compiled, {cached} already cached")


def _span(users: list[str]) -> str:
    if users == ["head"]:
        return "head"
    if len(users) == 1:
        return f"block {users[0]}"
    if [int(u) for u in users] == list(range(int(users[0]), int(users[-1]) + 1)):
        return f"blocks {users[0]}-{users[-1]}"
    return f"blocks {','.join(users)}"  # a hybrid model's kinds interleave
