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
@opt("targets", default=None, metavar="NAME,...|list",
     help="measure each named target preset (a target, backend and device) in turn, e.g. llvm,ort; list: show them")
@placement_options
def speed(model_path, prompt_tokens, gen_tokens, reps, preset, wtype, targets, **flags) -> None:
    """Prefill (ppN) and decode (tgN) tokens/s, mean ± sd over -r runs, as llama-bench prints them."""
    from jitllm.speed import TARGET_PRESETS, decode_speed, list_targets, prefill_speed, table, target_table

    if targets is not None and targets.strip() == "list":
        click.echo(list_targets())
        return
    if model_path and preset:
        raise click.UsageError("give a MODEL file or -preset NAME (not both)")
    presets = []
    if targets is not None:
        names = [t.strip() for t in targets.split(",")]
        unknown = [t for t in names if t not in TARGET_PRESETS]
        if unknown or not names:
            raise click.UsageError(f"-targets {targets}: unknown {', '.join(unknown) or 'empty list'} "
                                   f"(known: {', '.join(TARGET_PRESETS)}; -targets list describes them)")
        source = click.get_current_context().get_parameter_source
        if any(source(flag) is not click.core.ParameterSource.DEFAULT for flag in ("devices", "placement")):
            raise click.UsageError("-targets places the model itself: give it without -devices or -placement")
        presets = [TARGET_PRESETS[t] for t in names]
    ctx = flags["ctx"] or prompt_tokens + gen_tokens + 8
    with tempfile.TemporaryDirectory() as tmp:
        if preset:
            from jitllm.random_model import write_random_model

            model_path = str(Path(tmp) / f"{preset}.jlm")
            write_random_model(model_path, preset, wtype)
        name = f"{preset} {wtype}" if preset else Path(model_path or "smollm2-135m-instruct").stem

        def measure(**overrides) -> tuple:
            model = load_model(model_path, flags, ctx=ctx, gpu_grow=False, tune_seam=False, **overrides)
            results = []
            if prompt_tokens:
                results.append(prefill_speed(model, fitted(model, "pp", prompt_tokens, 0), reps))
            if gen_tokens:
                results.append(decode_speed(model, fitted(model, "tg", gen_tokens, 1), reps))
            return model, results

        if not presets:
            model, results = measure()
            click.echo(table(name, model, results))
            return
        rows, size = [], 0
        for target in presets:
            model, results = measure(devices=target.devices, placement=target.placement, placement_strict=True)
            size = sum(u.nbytes for u in [*model.executor.blocks, model.executor.head])
            rows.append((target, results))
            del model
        click.echo(target_table(name, size, rows))


def fitted(model, test: str, tokens: int, prompt: int) -> int:
    """The tokens of a test that fit the context beside its `prompt` positions: all of them, or as many as
    fit, with a note (as generation ends at the context; the table names the test that ran)."""
    room = model.executor.ctx - prompt
    if tokens > room:
        click.echo(f"jitllm: {test}{tokens} does not fit the context of {model.executor.ctx} tokens: "
                   f"measuring {test}{room}", err=True)
    return min(tokens, room)
