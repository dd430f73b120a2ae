"""Command line: thin click commands over plain library functions (imports stay lazy so --help is instant)."""

from __future__ import annotations

import difflib
import os
import sys
from typing import NoReturn

import click

from jitllm.commands.common import TextCommand
from jitllm.commands.output import OutputFailed, discard_stdout, guarded_stdout
from jitllm.core.errors import JitllmError
from jitllm.core.lean_imports import own_process
from jitllm.core.termination import install_termination_handler

MAX_MESSAGE = 400
"""Characters of an error line at most: a long value the user gave is echoed with its middle left out."""


def fail(message: str, prog: str = "jitllm") -> NoReturn:
    """Print one line naming the problem and exit with code 2."""
    click.echo(f"{prog}: error: {shorten(' '.join(message.split()))}", err=True)
    sys.exit(2)


def shorten(message: str, limit: int = MAX_MESSAGE) -> str:
    """`message`, or its start and end around a note of how much was left out (the end often says why)."""
    if len(message) <= limit:
        return message
    tail = limit // 4
    head = limit - tail - 40
    return f"{message[:head]} [... {len(message) - head - tail} characters ...] {message[-tail:]}"


class _Group(click.Group):
    """A group whose every failure is one line on stderr (`PROG: error: ...`) and exit code 2, never a
    traceback."""

    prog = "jitllm"

    def main(self, args=None, prog_name=None, **extra):  # type: ignore[override]
        install_termination_handler(self.prog)
        if args is None:  # (this process is the command: its own argv; a caller's CliRunner passes args)
            own_process()
        argv = list(args) if args is not None else sys.argv[1:]
        try:
            with guarded_stdout():
                rv = super().main(args=argv, prog_name=prog_name, standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.Abort:
            fail("aborted", self.prog)
        except click.NoSuchOption as e:
            fail(self._no_such_option(e, argv), self.prog)
        except click.ClickException as e:
            fail(e.format_message(), self.prog)
        except JitllmError as e:
            fail(str(e), self.prog)
        except KeyboardInterrupt:
            fail("interrupted", self.prog)
        except OutputFailed as e:
            discard_stdout()
            if e.broken_pipe:  # (the reader had what it wanted: `| head`)
                sys.exit(0)
            fail(f"cannot write to standard output: {e}", self.prog)
        except Exception as e:  # noqa: BLE001 (a bug: still one line, the traceback where asked for)
            if os.environ.get("JITLLM_TRACEBACK"):
                raise
            fail(f"internal error: {type(e).__name__}: {e} (a bug; JITLLM_TRACEBACK=1 shows where)", self.prog)
        if isinstance(rv, int):
            sys.exit(rv)
        sys.exit(0)

    def _no_such_option(self, e: click.NoSuchOption, argv: list[str]) -> str:
        """The token the user typed (`-hello`, where click names the `-e` it could not match in the cluster),
        and the option it looks like a typo of, else, for a verb that takes text, how to pass text that
        begins with '-'."""
        name = e.option_name
        words = argv[: argv.index("--")] if "--" in argv else argv
        known = set() if e.ctx is None else {o for p in e.ctx.command.get_params(e.ctx) for o in p.opts + p.secondary_opts}
        typed = [a for a in words if a.startswith("-") and a.split("=")[0] not in known]
        token = next((a for a in typed if a.split("=")[0] == name), None) or next(
            (a for a in typed if not a.startswith("--") and name.lstrip("-") in a[1:]), name)
        message = f"no such option: {token.split('=')[0]}"
        close = difflib.get_close_matches(token.split("=")[0], sorted(o for o in known if not o.startswith("--")), 1)
        if close:  # (a mistyped flag: -devicez)
            return f"{message} (did you mean {close[0]}?)"
        if e.ctx is not None and isinstance(e.ctx.command, TextCommand):
            options, *arguments = e.ctx.command.collect_usage_pieces(e.ctx)
            message += (f" (text that begins with '-' goes after --: {self.prog} {e.ctx.info_name} {options} -- "
                        f"{' '.join(arguments)})")
        return message


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
