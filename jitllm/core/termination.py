"""SIGTERM (what `timeout`, systemd and `docker stop` send) ends the process the way Ctrl-C does: by
unwinding the stack, so every `finally` and cleanup handler runs (temporary files of atomic writes are
removed, temporary directories deleted at exit), with one line on stderr and exit status 143 (128 +
SIGTERM). Without a handler, Python dies at once on SIGTERM and leaves its temporary files behind.
Once the cleanup has run (the last exit handler), the process ends without the interpreter's own
teardown, which takes seconds with TVM loaded and has nothing left to do for a terminated command."""

from __future__ import annotations

import atexit
import os
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

    def end_now() -> None:  # (registered first, so run last of the exit handlers)
        if state["terminating"]:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):  # (a closed or full output: nothing more can be said)
                    pass
            os._exit(EXIT_STATUS)

    atexit.register(end_now)
    signal.signal(signal.SIGTERM, handle)
