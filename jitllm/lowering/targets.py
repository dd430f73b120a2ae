"""The explicit registry of compile targets (one small module per target)."""

from __future__ import annotations

from types import ModuleType

from jitllm.errors import JitllmError
from jitllm.lowering import llvm

TARGETS: dict[str, ModuleType] = {"llvm": llvm}


def get_target(name: str) -> ModuleType:
    try:
        return TARGETS[name]
    except KeyError:
        raise JitllmError(f"unknown target {name!r} (known: {', '.join(sorted(TARGETS))})") from None
