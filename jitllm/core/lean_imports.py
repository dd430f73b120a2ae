"""Modules a jitllm command's own process keeps out of TVM's import (docs/performance.md, "Warm start").

tvm_ffi imports torch where it is installed (for DLPack exchange with torch tensors), and TVM and tvm_ffi
import ml_dtypes where installed (to turn bfloat16 and float8 tensors into numpy arrays): jitllm makes
neither, and the two took 1.2 s and 0.6 s of every command's start here. A `jitllm` process marks torch
absent for good, and ml_dtypes only while TVM is imported (onnx, which needs it, imports it later where a
graph is built). Only in a process of its own: an embedding program or a test keeps both."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

_OWN_PROCESS = False


def own_process() -> None:
    """This process is a jitllm command (run from its own argv): torch is marked absent unless something
    imported it already (None in sys.modules: `import torch` raises ImportError)."""
    global _OWN_PROCESS
    _OWN_PROCESS = True
    sys.modules.setdefault("torch", None)


@contextlib.contextmanager
def importing_tvm() -> Iterator[None]:
    """Around the import that brings TVM in: in a command's own process, ml_dtypes looks absent to it,
    and is importable again after."""
    blocked = _OWN_PROCESS and "ml_dtypes" not in sys.modules
    if blocked:
        sys.modules["ml_dtypes"] = None
    try:
        yield
    finally:
        if blocked and sys.modules.get("ml_dtypes", 0) is None:
            del sys.modules["ml_dtypes"]
