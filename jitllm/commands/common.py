"""Options shared by the verbs: the `-name`/`--name` style, and those of the verbs that load and place
a model (run, speed, verify). The verbs import from here, never from jitllm.cli (which imports them)."""

from __future__ import annotations

import os
from typing import Callable

import click

WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
"""jitllm.core.layouts.WEIGHT_TYPES (the -wtype choices), repeated so --help needs no import
(tests/test_architecture.py checks them)."""


def opt(name: str, *args, **kwargs):
    """An option that answers to both the seed style `-name` and `--name`."""
    return click.option(f"-{name}", f"--{name}", *args, **kwargs)


def placement_options(func=None, *, devices: str = "auto"):
    """-devices, -vram, -placement, -placement-strict, -gpu-layers, -ctx, -cache, -v (`devices`: the default of
    -devices; `@placement_options` or `@placement_options(devices="cpu")`)."""
    if func is None:
        return lambda f: placement_options(f, devices=devices)
    decorators = [
        opt("devices", default=devices, show_default=True, help="auto|all|cpu|gpu[:N]|cuda[:ORD]|vulkan[:SEL]|metal, =BYTES each"),
        opt("vram", default=None, help="one weight budget for every device (3G, 512M, bytes)"),
        opt("placement", default=None, help="SEL=TARGET[!|~],... (N, A-B, head, *; host or a device)"),
        opt("placement-strict", "placement_strict", is_flag=True, help="the map is all or nothing"),
        opt("gpu-layers", "gpu_layers", type=click.IntRange(min=0), default=None, help="cap the blocks offered to devices"),
        opt("ctx", type=click.IntRange(min=1), default=None, help="context length (default 4096, at most the model's)"),
        opt("cache", "cache_dir", default=None, help="compiled-artifact cache directory (default ./cache or $JITLLM_CACHE_DIR)"),
        opt("no-gpu-fallback", "no_gpu_fallback", is_flag=True, help="fail instead of finishing on the CPU when a device breaks"),
        opt("cpu-kernels", "cpu_kernels", type=click.Choice(["fast", "exact"]), default="fast", show_default=True,
            help="host kernels: fast = int8-quantized activations, exact = f32 activations"),
        opt("gpu-kernels", "gpu_kernels", type=click.Choice(["fast", "exact"]), default="fast", show_default=True,
            help="GPU decode matvecs over quantized weights: fast = int8 activations (dp4a), exact = f32"),
        click.option("-relocate/-no-relocate", "--relocate/--no-relocate", "relocate", default=True, show_default=True,
                     help="when a device cannot grow the context, hand its last block to the host"),
        opt("gpu-grow", "gpu_grow", is_flag=True, help="start on the CPU, move one block per token onto the devices"),
        opt("tune-seam", "tune_seam", is_flag=True, help="time runs of tokens at different seams, keep the fastest"),
        opt("v", "verbose", is_flag=True, help="print the placement plan"),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def load_model(model_path: str | None, flags: dict, log: Callable[[str], None] | None = None, **overrides):
    """Load (converting the built-in default when `model_path` is None) and report on stderr, or through `log`
    where given (then -v's plan goes there too). `flags`: the values of `placement_options` by name,
    `overrides` what a verb sets itself."""
    from jitllm.checked_model import open_checked

    if model_path is None:
        from jitllm.default_model import default_model_path

        model_path = str(default_model_path())
    checked = open_checked(model_path)  # a bad file fails here, before the imports below bring TVM in
    from jitllm.lowering.cache import stderr_log
    from jitllm.model import LoadOptions, load_with, with_placement

    f = {**flags, **overrides}
    option = with_placement(f["placement"], strict=f["placement_strict"]) if f["placement"] else None
    options = LoadOptions(
        devices=f["devices"], vram=f["vram"], placement=option, gpu_layers=f["gpu_layers"], ctx=f["ctx"],
        cache_dir=f["cache_dir"] or os.environ.get("JITLLM_CACHE_DIR"),
        log=log or (stderr_log if f["verbose"] else _compile_log),
        no_gpu_fallback=f["no_gpu_fallback"], cpu_kernels=f["cpu_kernels"], gpu_kernels=f["gpu_kernels"],
        relocate=f["relocate"], gpu_grow=f["gpu_grow"], tune_seam=f["tune_seam"])
    return load_with(checked, options)


def _compile_log(message: str) -> None:
    """Without -v, the plan stays quiet; compile, cache, move and fallback events still reach stderr."""
    if message.startswith(("compiled", "cache:", "moved", "relocated", "tune-seam", "warning:")):
        click.echo(f"jitllm: {message}", err=True)
