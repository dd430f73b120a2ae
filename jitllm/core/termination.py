"""SIGTERM (what `timeout`, systemd and `docker stop` send) ends the process the way Ctrl-C does: by
unwinding the stack, so every `finally` and cleanup handler runs (temporary files of atomic writes are
removed, temporary directories deleted at exit), with one line on stderr and exit status 143 (128 +
SIGTERM). Without a handler, Python dies at once on SIGTERM and leaves its temporary files behind."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

EXIT_STATUS = 128 + signal.SIGTERM


class Terminated(SystemExit):
    """Raised in the main thread by the SIGTERM handler; a SystemExit, so `except Exception` (and
    Ctrl-C's `except KeyboardInterrupt`, which stops only an answer in chat) let it through."""


def install_termination_handler(prog: str) -> None:
    """Turn SIGTERM into `Terminated` in the main thread, announced as `PROG: error: terminated`. A
    second SIGTERM while the first unwinds is ignored, so the cleanup itself is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        return  # (signal handlers can only be set from the main thread: an embedding caller keeps its own)
    state = {"terminating": False}

    def handle(signum: int, frame: FrameType | None) -> None:
        if state["terminating"]:
            return
        state["terminating"] = True
        print(f"{prog}: error: terminated", file=sys.stderr, flush=True)
        raise Terminated(EXIT_STATUS)

    signal.signal(signal.SIGTERM, handle)
