"""`jitllm run [MODEL] PROMPT`: stream a completion (or a chat answer) from a .jlm."""

from __future__ import annotations

import sys

import click

from jitllm.commands.common import (FAST_START_HELP, TextCommand, Utf8Text, checked_text, finish_answer,
                                    load_model, opt, placement_options, read_text, sampling_options)


@click.command(cls=TextCommand)
@click.argument("args", nargs=-1, metavar="[MODEL] PROMPT")
@opt("f", "prompt_file", default=None, metavar="FILE", help="read the prompt from FILE (- for standard input)")
@opt("n", "max_tokens", type=click.IntRange(min=0), default=256, show_default=True,
     help="tokens to generate (at most what the context has room for)")
@sampling_options
@opt("chat", is_flag=True, help="apply the model's chat template (always on for the built-in instruct model)")
@opt("system", type=Utf8Text(), default=None, help="system message (with -chat)")
@opt("move-at", "move_at", multiple=True, metavar="TOKEN:SEL=TARGET[,...]",
     help="after TOKEN generated tokens, move blocks (repeatable), e.g. 8:0-9=cuda:0,head=host")
@opt("no-fast-start", "no_fast_start", is_flag=True, help=FAST_START_HELP)
@placement_options
def run(args, prompt_file, max_tokens, temperature, top_k, top_p, seed, chat, system, move_at, no_fast_start,
        **flags) -> None:
    """Generate text. With only PROMPT, runs the built-in SmolLM2-135M-Instruct. A PROMPT that begins with -
    goes after --: jitllm run -n 8 -- MODEL "-1 is negative". Generation stops at -n tokens, a stop token or
    the end of the context (a note on stderr then)."""
    from jitllm.runtime.placement import parse_placement
    from jitllm.runtime.sampling import SamplingParams

    model_path, prompt = split_prompt(args, prompt_file)
    chat = chat or model_path is None
    if system is not None and not chat:
        raise click.UsageError("-system is a message of the chat template: give -chat too")
    schedule = parse_move_at(move_at)
    model = load_model(model_path, flags, fast_start=not no_fast_start)
    for specs in schedule.values():
        for spec in specs:
            parse_placement(spec).validate(len(model.executor.blocks), set(model.devices))
    model.move_schedule = schedule
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    for piece in model.generate(prompt, max_tokens, sampling, chat=chat, system=system):
        sys.stdout.write(piece)
        sys.stdout.flush()
    finish_answer(model)
    if model.fast_start is not None:
        model.fast_start.finish()


def split_prompt(args: tuple[str, ...], prompt_file: str | None) -> tuple[str | None, str]:
    """([MODEL], PROMPT) from the arguments, the prompt read from -f FILE (or standard input) where given."""
    wanted = 1 if prompt_file is None else 0
    if not wanted <= len(args) <= wanted + 1:
        shape = "[MODEL] PROMPT" if wanted else "[MODEL] with -f"
        hint = " (quote the prompt)" if len(args) > wanted + 1 and wanted else ""
        raise click.UsageError(f"expected {shape}, got {len(args)} arguments{hint}")
    if prompt_file is None:
        model_path, prompt = (None, args[0]) if len(args) == 1 else (args[0], args[1])
        return model_path, checked_text(prompt, "the prompt")
    return (args[0] if args else None), read_text(prompt_file, "-f")


def parse_move_at(values: tuple[str, ...]) -> dict[int, list[str]]:
    """`TOKEN:SEL=TARGET[,...]` entries -> {token: [spec, ...]} (one-line errors on malformed ones)."""
    schedule: dict[int, list[str]] = {}
    for value in values:
        token, colon, spec = value.partition(":")
        if not colon or not token.strip().isdigit() or not spec.strip():
            raise click.UsageError(f"-move-at {value!r}: expected TOKEN:SEL=TARGET[,...], e.g. 8:0-9=cuda:0")
        schedule.setdefault(int(token), []).append(spec.strip())
    return schedule
