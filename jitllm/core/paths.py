"""Where jitllm keeps its files: its home (converted default model, the libcuda stub) and the compile cache."""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def special_kind(mode: int) -> str | None:
    """What a file of this st_mode is where it is not a regular file ("a FIFO", "a directory", ...), else None."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def home_dir() -> Path:
    """$JITLLM_HOME, else $XDG_CACHE_HOME/jitllm, else ~/.cache/jitllm."""
    if os.environ.get("JITLLM_HOME"):
        return Path(os.environ["JITLLM_HOME"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "jitllm"


def artifact_cache_dir() -> Path:
    """The compiled-artifact cache: $JITLLM_CACHE_DIR, else ./cache."""
    return Path(os.environ.get("JITLLM_CACHE_DIR") or "cache")
