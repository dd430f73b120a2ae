"""Standard output for the length of a command: a write that fails (a reader that went away, a full disk)
ends the command as one OutputFailed the CLI answers, wherever the verb wrote from. (An OSError would reach
click, which turns a broken pipe into exit code 1 and lets any other error through as a traceback.)"""

from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager
from typing import Iterator, TextIO


class OutputFailed(Exception):
    """Writing to standard output failed."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.broken_pipe = error.errno == errno.EPIPE


class GuardedStream:
    """A text stream that raises OutputFailed where the stream it wraps raises OSError."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise OutputFailed(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputFailed(e) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def guarded_stdout() -> Iterator[None]:
    original = sys.stdout
    sys.stdout = GuardedStream(original)
    try:
        yield
    finally:
        sys.stdout = original


def discard_stdout() -> None:
    """After a failed write: point standard output's descriptor at /dev/null, so that the interpreter's last
    flush of what is still buffered cannot fail again on the way out (Python's advice for SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # (a stream without a descriptor: nothing will flush to one)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
