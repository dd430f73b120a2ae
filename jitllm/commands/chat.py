"""`jitllm chat [MODEL]`: an interactive conversation that keeps its KV cache between turns."""

from __future__ import annotations

import sys

import click

from jitllm.commands.common import (FAST_START_HELP, Utf8Text, finish_answer, load_model, opt, placement_options,
                                    sampling_options, utf8_problem)

EXIT = "/exit"


@click.command()
@click.argument("model_path", metavar="[MODEL]", required=False)
@opt("system", type=Utf8Text(), default=None, help="system message")
@opt("n", "max_tokens", type=click.IntRange(min=1), default=512, show_default=True,
     help="tokens per answer at most (and what the context has room for)")
@sampling_options
@opt("no-fast-start", "no_fast_start", is_flag=True, help=FAST_START_HELP)
@placement_options
def chat(model_path, system, max_tokens, temperature, top_k, top_p, seed, no_fast_start, **flags) -> None:
    """Chat with MODEL (default: the built-in SmolLM2-135M-Instruct) through its chat template; each answer
    streams, Ctrl-C stops it (not the program), /exit or end of input leaves. A line that is not UTF-8 text,
    or that the context has no room for, is refused with a note and the chat goes on."""
    from jitllm.chat import Conversation, ConversationFull
    from jitllm.runtime.sampling import SamplingParams

    model = load_model(model_path, flags, fast_start=not no_fast_start)
    conversation = Conversation(model, system)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    interactive = sys.stdin.isatty()
    sys.stdin.reconfigure(errors="surrogateescape")  # (bytes that are not UTF-8 reach utf8_problem, not input())
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        if line.strip() == EXIT:
            break
        if not line.strip():
            continue
        problem = utf8_problem(line)
        if problem:
            click.echo(f"jitllm: that line is not valid UTF-8 text ({problem}); it was left out", err=True)
            continue
        answer = conversation.say(line, max_tokens, sampling)
        try:
            for piece in answer:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            answer.close()
            click.echo("\njitllm: answer stopped", err=True)
        except ConversationFull as e:
            click.echo(f"jitllm: {e} (/exit, then a new chat or a longer -ctx)", err=True)
            continue
        finish_answer(model, conversation.reused)
    conversation.close()
    if model.fast_start is not None:
        model.fast_start.finish()
