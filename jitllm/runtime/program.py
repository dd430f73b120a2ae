"""A compiled block kind loaded onto a device: its VM entry (`main`), the KV append and page kernels, and (GPU
heads) the embedding row gather and the greedy pick."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import tvm
import tvm.runtime.vm  # not imported by `import tvm` in a runtime-only install

from jitllm.core.errors import JitllmError
from jitllm.lowering import APPEND_FUNCTION, ARGMAX_FUNCTION, EMBED_FUNCTION, EXPORT_PAGES, IMPORT_PAGES


@dataclass
class Program:
    main: Callable
    append: Callable | None
    export_pages: Callable | None
    import_pages: Callable | None
    embed: Callable | None = None
    """(ids [1, n] int32, the head's weight parts, x [1, n, hidden] f32) where the artifact has it."""
    argmax: Callable | None = None
    """(logits [1, 1, vocab] f32, token [1] int32): the first largest logit's index, where the artifact has it."""


def load_program(path: Path, device: tvm.runtime.Device, has_append: bool) -> Program:
    """`has_append`: the artifact's page kernels are wanted (llama kinds whose `main` leaves the append to
    the runtime; a GPU decode variant's `main` appends itself, and moves use the general program's)."""
    try:
        module = tvm.runtime.load_module(str(path))
    except Exception as e:  # TVM raises its own error types; any failure here means an unusable artifact
        raise JitllmError(f"cannot load compiled artifact {path}: {str(e).splitlines()[0]}") from None
    vm = tvm.runtime.vm.VirtualMachine(module, device)
    embed, argmax = (module.get_function(name, query_imports=True)
                     if module.implements_function(name, query_imports=True) else None
                     for name in (EMBED_FUNCTION, ARGMAX_FUNCTION))
    if not has_append:
        return Program(vm["main"], None, None, None, embed, argmax)
    kernels = [module.get_function(name, query_imports=True) for name in (APPEND_FUNCTION, EXPORT_PAGES, IMPORT_PAGES)]
    return Program(vm["main"], *kernels, embed, argmax)
