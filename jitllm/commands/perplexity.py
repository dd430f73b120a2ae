"""`jitllm perplexity [MODEL] FILE [-c N]`: a text's perplexity as llama.cpp's `llama-perplexity` measures it."""

from __future__ import annotations

import sys
import time

import click

from jitllm.commands.common import load_model, open_model, opt, placement_options, read_text


@click.command()
@click.argument("args", nargs=-1, metavar="[MODEL] FILE")
@opt("c", "window", type=click.IntRange(min=4), default=512, show_default=True,
     help="tokens per window (llama-perplexity's -c); the second half of each is scored")
@opt("b", "batch", type=click.IntRange(min=1), default=512, show_default=True, help="tokens per prefill step")
@opt("chunks", type=click.IntRange(min=1), default=None, help="score the first N windows only (default all)")
@opt("decode", is_flag=True,
     help="score each window's second half one token a step (the decode kernels a generation uses), not by prefill")
@placement_options
def perplexity(args, window, batch, chunks, decode, **flags) -> None:
    """Perplexity of the text in FILE (- for standard input), llama-perplexity's way: non-overlapping windows
    of -c tokens, each from an empty context (BOS first where the model adds one), the second half of each
    scored. Prints the running estimate after each window and `Final estimate: PPL = x +/- y`."""
    if len(args) not in (1, 2):
        raise click.UsageError(f"expected [MODEL] FILE, got {len(args)} arguments")
    model_path, text_path = (None, args[0]) if len(args) == 1 else args
    text = read_text(text_path, "FILE")
    if flags["ctx"] is not None and flags["ctx"] < window:
        raise click.UsageError(f"-c {window} does not fit -ctx {flags['ctx']}")
    from jitllm.perplexity import perplexity as measure
    from jitllm.perplexity import windows

    checked = open_model(model_path)  # (every check below before TVM is imported)
    context = checked.layout.config.context
    if window > context:
        raise click.UsageError(f"-c {window} is larger than the model's context of {context} tokens")
    tok = checked.tokenizer
    started = time.perf_counter()
    tokens = tok.encode(text, add_special=True, parse_special=False)
    every = windows(tokens, window, tok.bos_token_id if tok.add_bos else None)
    chosen = every[:chunks] if chunks else every
    click.echo(f"jitllm: {len(tokens)} tokens of {text_path} (tokenized in {time.perf_counter() - started:.2f} s): "
               f"perplexity over {len(chosen)} of {len(every)} windows of {window} tokens, "
               f"{window - window // 2 - 1} scored in each{' by decode steps' if decode else ''}", err=True)
    ex = load_model(checked, flags, ctx=flags["ctx"] or window).executor
    started = time.perf_counter()

    def show(estimate) -> None:
        sys.stdout.write(f"[{estimate.windows}]{estimate.ppl:.4f},")
        sys.stdout.flush()

    estimate = measure(ex, chosen, batch, decode, show)
    seconds = time.perf_counter() - started
    sys.stdout.write(f"\nFinal estimate: PPL = {estimate.ppl:.4f} +/- {estimate.error:.5f}\n")
    sys.stdout.flush()
    tokens_run = estimate.windows * window
    click.echo(f"jitllm: {tokens_run} tokens in {seconds:.1f} s ({tokens_run / seconds:.1f} tok/s), "
               f"{estimate.count} scored", err=True)
