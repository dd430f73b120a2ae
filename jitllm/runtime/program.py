"""A compiled block kind loaded onto a device: its VM entry (`main`) and the KV append kernel."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import tvm

from jitllm.errors import JitllmError
from jitllm.lowering import APPEND_FUNCTION


@dataclass
class Program:
    main: Callable
    append: Callable | None


def load_program(path: Path, device: tvm.runtime.Device, has_append: bool) -> Program:
    try:
        module = tvm.runtime.load_module(str(path))
    except Exception as e:  # TVM raises its own error types; any failure here means an unusable artifact
        raise JitllmError(f"cannot load compiled artifact {path}: {str(e).splitlines()[0]}") from None
    vm = tvm.runtime.vm.VirtualMachine(module, device)
    append = module.get_function(APPEND_FUNCTION, query_imports=True) if has_append else None
    return Program(vm["main"], append)
