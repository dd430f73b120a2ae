"""`jitllm convert`: a GGUF file or Hugging Face directory -> .jlm."""

from __future__ import annotations

import click

from jitllm.commands.common import opt

_DTYPES = ("f32", "f16", "q8_0")  # jitllm.convert.CONVERT_TYPES, repeated so --help needs no import


@click.command()
@click.argument("src", type=click.Path())
@click.option("-o", "-out", "--out", "out", required=True, type=click.Path(), help="the .jlm file to write")
@opt("dtype", type=click.Choice(_DTYPES), default=None,
     help="convert every linear and the embedding to this type (default: keep each weight's type)")
@opt("quiet", is_flag=True, help="no progress bar")
def convert(src: str, out: str, dtype: str | None, quiet: bool) -> None:
    """Convert SRC (a llama-family GGUF file or Hugging Face directory) into a .jlm model file."""
    from jitllm.convert import convert as run_convert
    from jitllm.runtime.device_spec import format_bytes

    s = run_convert(src, out, dtype=dtype, progress=not quiet)
    types = s["weight_types"]
    head = "tied" if s["tied_head"] else types["output"]
    click.echo(f"wrote {s['path']}: {s['arch']}, {s['blocks']} blocks ({'+'.join(types['blocks'])}), "
               f"embedding {types['token_embd']}, head {head}, {format_bytes(s['bytes'])}")
