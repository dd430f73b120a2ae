"""`jitllm batch [MODEL]`: llama-batched-bench's table over batched steps of many sessions."""

from __future__ import annotations

import click

from jitllm.commands.common import load_model, opt, placement_options


def batch_sizes(ctx, param, value: str) -> list[int]:
    try:
        sizes = [int(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a list of batch sizes (e.g. 1,2,4,8)") from None
    if not sizes or min(sizes) < 1 or max(sizes) > 1024:
        raise click.BadParameter(f"{value!r}: batch sizes are 1 to 1024")
    return sizes


@click.command()
@click.argument("model_path", metavar="[MODEL]", required=False)
@opt("b", "batches", default="1,2,4,8,16,32,64", show_default=True, callback=batch_sizes,
     help="batch sizes (sessions per step), comma-separated")
@opt("p", "prompt_tokens", type=click.IntRange(min=1), default=128, show_default=True, help="prompt tokens per session")
@opt("n", "gen_tokens", type=click.IntRange(min=0), default=128, show_default=True, help="tokens generated per session")
@opt("r", "reps", type=click.IntRange(min=1), default=3, show_default=True, help="repetitions (times are means)")
@opt("ub", "token_budget", type=click.IntRange(min=1), default=512, show_default=True,
     help="tokens per step (prompts are prefilled in chunks under it, beside decoding sessions)")
@opt("json", "as_json", is_flag=True, help="one JSON object per row (llama-batched-bench's jsonl keys)")
@opt("eager", is_flag=True,
     help="run batched decode steps eagerly, not as captured graphs per batch-size bucket (CUDA), to compare")
@placement_options(devices="gpu")
def batch(model_path, batches, prompt_tokens, gen_tokens, reps, token_budget, as_json, eager, **flags) -> None:
    """Batched prefill and decode over B sessions at once, as llama-batched-bench prints them (default
    devices: gpu; -devices cpu runs on the host)."""
    from jitllm.batch_bench import HEADER, json_row, measure, table_row, warm_up

    ctx = flags["ctx"] or prompt_tokens + gen_tokens + 8
    if prompt_tokens + gen_tokens + 1 > ctx:  # (before loading; the model's own context is checked after)
        raise click.UsageError(f"-p {prompt_tokens} -n {gen_tokens} do not fit the context of {ctx}")
    model = load_model(model_path, flags, ctx=ctx, gpu_grow=False, tune_seam=False)
    if prompt_tokens + gen_tokens + 1 > model.executor.ctx:
        raise click.UsageError(f"-p {prompt_tokens} -n {gen_tokens} do not fit the context of {model.executor.ctx}")
    ex = model.executor
    ex.batch_graphs = not eager
    warm_up(ex)
    if not as_json:
        click.echo(HEADER)
    for size in batches:
        result = measure(ex, size, prompt_tokens, gen_tokens, reps, token_budget)
        click.echo(json_row(result) if as_json else table_row(result))
