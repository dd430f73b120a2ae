"""`jitllm chat [MODEL]`: an interactive conversation that keeps its KV cache between turns."""

from __future__ import annotations

import sys

import click

from jitllm.commands.common import load_model, opt, placement_options

EXIT = "/exit"


@click.command()
@click.argument("model_path", metavar="[MODEL]", required=False)
@opt("system", default=None, help="system message")
@opt("n", "max_tokens", type=click.IntRange(min=1), default=512, show_default=True, help="tokens per answer at most")
@opt("temp", "temperature", type=click.FloatRange(min=0.0), default=0.8, show_default=True, help="0 = greedy")
@opt("top-k", "top_k", type=click.IntRange(min=0), default=40, show_default=True, help="0 = whole vocabulary")
@opt("top-p", "top_p", type=click.FloatRange(min=0.0, max=1.0), default=0.95, show_default=True)
@opt("seed", type=int, default=None, help="sampling seed (reproducible runs)")
@placement_options
def chat(model_path, system, max_tokens, temperature, top_k, top_p, seed, **flags) -> None:
    """Chat with MODEL (default: the built-in SmolLM2-135M-Instruct) through its chat template; each answer
    streams, Ctrl-C stops it (not the program), /exit or end of input leaves."""
    from jitllm.chat import Conversation
    from jitllm.runtime.sampling import SamplingParams

    model = load_model(model_path, flags)
    conversation = Conversation(model, system)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        if line.strip() == EXIT:
            break
        if not line.strip():
            continue
        answer = conversation.say(line, max_tokens, sampling)
        try:
            for piece in answer:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            answer.close()
            click.echo("\njitllm: answer stopped", err=True)
        sys.stdout.write("\n")
        sys.stdout.flush()
        s = model.last_stats
        click.echo(f"jitllm: prefill {s.prompt_tokens} tokens ({conversation.reused} reused) at {s.prefill_tps:.1f} "
                   f"tok/s, decode {s.generated_tokens} tokens at {s.decode_tps:.1f} tok/s", err=True)
    conversation.close()
