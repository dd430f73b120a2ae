"""Command line: thin click commands over plain library functions (imports stay lazy so --help is instant)."""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from jitllm.core.errors import JitllmError
from jitllm.core.termination import install_termination_handler


def fail(message: str, prog: str = "jitllm") -> NoReturn:
    """Print one line naming the problem and exit with code 2."""
    click.echo(f"{prog}: error: {message}", err=True)
    sys.exit(2)


class _Group(click.Group):
    """A group whose every failure is one line on stderr (`PROG: error: ...`) and exit code 2, never a
    traceback."""

    prog = "jitllm"

    def main(self, args=None, prog_name=None, **extra):  # type: ignore[override]
        install_termination_handler(self.prog)
        try:
            rv = super().main(args=args, prog_name=prog_name, standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.Abort:
            fail("aborted", self.prog)
        except click.NoSuchOption as e:
            argv = list(args) if args is not None else sys.argv[1:]
            token = next((a for a in argv if a.split("=")[0] == e.option_name), None)
            token = token or next((a for a in argv if a.startswith(e.option_name) and a.startswith("-")), e.option_name)
            fail(f"no such option: {token.split('=')[0]}", self.prog)
        except click.ClickException as e:
            fail(e.format_message().replace("\n", " "), self.prog)
        except JitllmError as e:
            fail(str(e), self.prog)
        except KeyboardInterrupt:
            fail("interrupted", self.prog)
        except BrokenPipeError:
            sys.exit(0)
        if isinstance(rv, int):
            sys.exit(rv)
        sys.exit(0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """jitllm: place transformer blocks on devices, compile them with TVM, move them while serving."""


class _DaemonGroup(_Group):
    prog = "jitllmd"


@click.group(cls=_DaemonGroup, context_settings={"help_option_names": ["-h", "--help"]})
def jitllmd() -> None:
    """jitllmd: serve a model over OpenAI's HTTP API, and talk to a running server."""


def _register() -> None:
    from jitllm.cli_commands import COMMANDS, DAEMON_COMMANDS

    for command in COMMANDS:
        main.add_command(command)
    for command in DAEMON_COMMANDS:
        jitllmd.add_command(command)


_register()
