"""`jitllm speed [MODEL]`: llama-bench-style prefill/decode table on the chosen devices."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from jitllm.commands.common import WEIGHT_TYPES, load_model, opt, placement_options


@click.command()
@click.argument("model_path", metavar="[MODEL]", required=False)
@opt("p", "prompt_tokens", type=click.IntRange(min=0), default=512, show_default=True, help="prefill test: ppN (0: skip)")
@opt("n", "gen_tokens", type=click.IntRange(min=0), default=128, show_default=True, help="decode test: tgN (0: skip)")
@opt("r", "reps", type=click.IntRange(min=1), default=3, show_default=True, help="repetitions")
@opt("preset", default=None, help="measure a random-weight model of a named shape instead (e.g. llama-3.2-3b)")
@opt("wtype", default="q4_1", show_default=True, type=click.Choice(WEIGHT_TYPES),
     help="weight type of -preset")
@placement_options
def speed(model_path, prompt_tokens, gen_tokens, reps, preset, wtype, devices, vram, placement, placement_strict,
          gpu_layers, ctx, cache_dir, no_gpu_fallback, cpu_kernels, gpu_kernels, relocate, gpu_grow, tune_seam,
          verbose) -> None:
    """Prefill (ppN) and decode (tgN) tokens/s, mean ± sd over -r runs, as llama-bench prints them."""
    from jitllm.speed import decode_speed, prefill_speed, table

    if model_path and preset:
        raise click.UsageError("give a MODEL file or -preset NAME (not both)")
    ctx = ctx or prompt_tokens + gen_tokens + 8
    with tempfile.TemporaryDirectory() as tmp:
        if preset:
            from jitllm.random_model import write_random_model

            model_path = str(Path(tmp) / f"{preset}.jlm")
            write_random_model(model_path, preset, wtype)
        model = load_model(model_path, devices, vram, placement, placement_strict, gpu_layers, ctx, cache_dir,
                           no_gpu_fallback, cpu_kernels, gpu_kernels, relocate, False, False, verbose)
        results = []
        if prompt_tokens:
            results.append(prefill_speed(model, prompt_tokens, reps))
        if gen_tokens:
            results.append(decode_speed(model, gen_tokens, reps))
        name = f"{preset} {wtype}" if preset else Path(model_path or "smollm2-135m-instruct").stem
        click.echo(table(name, model, results))
