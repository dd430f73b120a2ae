"""Where jitllm keeps its files: its home (converted default model, the libcuda stub) and the compile cache."""

from __future__ import annotations

import os
from pathlib import Path


def home_dir() -> Path:
    """$JITLLM_HOME, else $XDG_CACHE_HOME/jitllm, else ~/.cache/jitllm."""
    if os.environ.get("JITLLM_HOME"):
        return Path(os.environ["JITLLM_HOME"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "jitllm"


def artifact_cache_dir() -> Path:
    """The compiled-artifact cache: $JITLLM_CACHE_DIR, else ./cache."""
    return Path(os.environ.get("JITLLM_CACHE_DIR") or "cache")
