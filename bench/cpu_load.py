"""Competing CPU-bound processes for load measurements (bench/cpu_decode.py -hog): each spins for at most
`seconds` on its own, and the context manager kills whatever is left when it ends, however it ends."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def hogs(count: int, seconds: float) -> Iterator[list[subprocess.Popen]]:
    """`count` busy processes (a pure-Python spin, one CPU each), ended at exit of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
