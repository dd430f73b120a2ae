"""`jitllm run [MODEL] PROMPT`: stream a completion (or a chat answer) from a .jlm."""

from __future__ import annotations

import sys

import click

from jitllm.commands.common import load_model, opt, placement_options


@click.command()
@click.argument("args", nargs=-1, required=True, metavar="[MODEL] PROMPT")
@opt("n", "max_tokens", type=click.IntRange(min=0), default=256, show_default=True, help="tokens to generate")
@opt("temp", "temperature", type=click.FloatRange(min=0.0), default=0.8, show_default=True, help="0 = greedy")
@opt("top-k", "top_k", type=click.IntRange(min=0), default=40, show_default=True, help="0 = whole vocabulary")
@opt("top-p", "top_p", type=click.FloatRange(min=0.0, max=1.0), default=0.95, show_default=True)
@opt("seed", type=int, default=None, help="sampling seed (reproducible runs)")
@opt("chat", is_flag=True, help="apply the model's chat template (always on for the built-in instruct model)")
@opt("system", default=None, help="system message (with -chat)")
@opt("move-at", "move_at", multiple=True, metavar="TOKEN:SEL=TARGET[,...]",
     help="after TOKEN generated tokens, move blocks (repeatable), e.g. 8:0-9=cuda:0,head=host")
@placement_options
def run(args, max_tokens, temperature, top_k, top_p, seed, chat, system, move_at, **flags) -> None:
    """Generate text. With only PROMPT, runs the built-in SmolLM2-135M-Instruct."""
    from jitllm.runtime.placement import parse_placement
    from jitllm.runtime.sampling import SamplingParams

    if len(args) > 2:
        raise click.UsageError(f"expected [MODEL] PROMPT, got {len(args)} arguments (quote the prompt)")
    model_path, prompt = (None, args[0]) if len(args) == 1 else args
    chat = chat or model_path is None
    schedule = parse_move_at(move_at)
    model = load_model(model_path, flags)
    for specs in schedule.values():
        for spec in specs:
            parse_placement(spec).validate(len(model.executor.blocks), set(model.devices))
    model.move_schedule = schedule
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    for piece in model.generate(prompt, max_tokens, sampling, chat=chat, system=system):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = model.last_stats
    click.echo(f"jitllm: prefill {s.prompt_tokens} tokens at {s.prefill_tps:.1f} tok/s, "
               f"decode {s.generated_tokens} tokens at {s.decode_tps:.1f} tok/s", err=True)


def parse_move_at(values: tuple[str, ...]) -> dict[int, list[str]]:
    """`TOKEN:SEL=TARGET[,...]` entries -> {token: [spec, ...]} (one-line errors on malformed ones)."""
    schedule: dict[int, list[str]] = {}
    for value in values:
        token, colon, spec = value.partition(":")
        if not colon or not token.strip().isdigit() or not spec.strip():
            raise click.UsageError(f"-move-at {value!r}: expected TOKEN:SEL=TARGET[,...], e.g. 8:0-9=cuda:0")
        schedule.setdefault(int(token), []).append(spec.strip())
    return schedule
