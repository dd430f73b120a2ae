"""`jitllm tokenize MODEL TEXT`: the tokens of a text, printed as llama.cpp's llama-tokenize prints them."""

from __future__ import annotations

import click

from jitllm.commands.common import TextCommand, Utf8Text, opt, regular_file


@click.command(cls=TextCommand)
@click.argument("model", type=click.Path())
@click.argument("text", type=Utf8Text())
@opt("ids", is_flag=True, help="print only the ids, as a list")
@opt("no-bos", "no_bos", is_flag=True, help="no BOS even where the model starts every text with it")
@opt("parse-special", "parse_special", is_flag=True, help="match special tokens written in TEXT (<|im_start|>, ...)")
def tokenize(model: str, text: str, ids: bool, no_bos: bool, parse_special: bool) -> None:
    """Tokenize TEXT with the tokenizer of MODEL (a .jlm, or a GGUF file: vocabulary-only ones too)."""
    from jitllm.tokenizer import load_tokenizer

    tok = load_tokenizer(regular_file(model))
    tokens = tok.encode(text, add_special=not no_bos, parse_special=parse_special)
    if ids:
        click.echo(f"[{', '.join(map(str, tokens))}]")
        return
    for token in tokens:
        click.echo(f"{token:6d} -> '{tok.piece(token)}'")
