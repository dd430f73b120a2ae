"""`jitllm hardware`: list devices and the CPU."""

import click

from jitllm.cli import opt


@click.command()
@opt("json", "as_json", is_flag=True, help="machine-readable output")
def hardware(as_json: bool) -> None:
    """List every device, each backend that reaches it, and the CPU."""
    raise click.ClickException("not implemented yet")
