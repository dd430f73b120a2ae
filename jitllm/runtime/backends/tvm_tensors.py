"""The Backend protocol over TVM tensors on one TVM device: what the host, CUDA and simulated backends
share (each adds its own capabilities, recorder and memory)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tvm
import tvm.runtime.vm  # not imported by `import tvm` in a runtime-only install

from jitllm.core.errors import JitllmError
from jitllm.ir.config import BlockKind
from jitllm.lowering import APPEND_FUNCTION, ARGMAX_FUNCTION, EMBED_FUNCTION, EXPORT_PAGES, IMPORT_PAGES
from jitllm.runtime.backends.base import BackendCaps, Layout
from jitllm.runtime.backends.dlpack import aliases
from jitllm.runtime.program import Program


def _load_runtime_extra() -> None:
    """Load libtvm_runtime_extra where TVM runs runtime-only (TVM_USE_RUNTIME_LIB=1: the GPU machine's
    install), which `import tvm` loads only beside the compiler: it registers packed functions that artifacts
    call, e.g. `tvm.contrib.sort.topk` (the MoE router's top-k), without which such an artifact fails at its
    first call. Once, at import."""
    if not tvm.base._RUNTIME_ONLY or "tvm_runtime_extra" in tvm.base._LOADED_LIBS:
        return
    import tvm_ffi

    runtime_dir = Path(tvm.base._LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    try:
        tvm.base._LOADED_LIBS["tvm_runtime_extra"] = tvm_ffi.libinfo.load_lib_ctypes(
            "tvm", "tvm_runtime_extra", "RTLD_LOCAL", extra_lib_paths=[runtime_dir])
    except (OSError, RuntimeError):  # an install without it: artifacts that need it say so at their first call
        pass


_load_runtime_extra()


HOST_ALLOCATOR = "naive"
"""The Relax VM allocator for programs whose tensors live in host memory. TVM's default, "pooled", keeps every
freed buffer for a later request of the same (page-rounded) size and never gives any back, so a batched
step's intermediates, whose sizes follow its row count, leave a buffer set behind for every row count the
server has seen: measured on SmolLM2, 55 distinct row counts took RssAnon from 350 to 827 MiB with "pooled"
and to 485 MiB with "naive" (malloc and free per buffer; the step times did not get worse), and jitllmd's
RSS climbed through a soak as new row counts came (docs/server.md)."""


class TvmBackend:
    """Tensors are tvm.runtime.Tensor on `tvm_device`; artifacts are TVM shared libraries run by its VM with
    the `allocator` ("pooled": TVM's default, kept on CUDA, where a cudaMalloc per buffer would cost more than
    the pool's memory; "naive": HOST_ALLOCATOR)."""

    def __init__(self, name: str, tvm_device: tvm.runtime.Device, caps: BackendCaps,
                 allocator: str = "pooled") -> None:
        self.name, self.tvm_device, self.caps, self.allocator = name, tvm_device, caps, allocator

    def empty(self, shape: tuple[int, ...], dtype: str) -> tvm.runtime.Tensor:
        return tvm.runtime.empty(shape, dtype, self.tvm_device)

    def upload(self, array: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.ascontiguousarray(array), self.tvm_device)

    def download(self, tensor: tvm.runtime.Tensor) -> np.ndarray:
        return tensor.numpy()

    def write(self, tensor: tvm.runtime.Tensor, array: np.ndarray) -> None:
        tensor.copyfrom(np.ascontiguousarray(array))

    def copy(self, dst: tvm.runtime.Tensor, src: tvm.runtime.Tensor) -> None:
        dst.copyfrom(src)

    def receive(self, tensor: tvm.runtime.Tensor) -> tvm.runtime.Tensor:
        return tensor if tensor.device == self.tvm_device else tensor.copyto(self.tvm_device)

    def region(self, buffer: tvm.runtime.Tensor, shape: tuple[int, ...], dtype: str, offset: int) -> tvm.runtime.Tensor:
        return buffer._create_view(shape, dtype, offset)

    def aliases(self, buffer: tvm.runtime.Tensor, layout: Layout) -> list[tvm.runtime.Tensor]:
        return aliases(buffer, layout)

    def last_rows(self, hidden: tvm.runtime.Tensor) -> tvm.runtime.Tensor:
        """Copied on the hidden state's own device (a prefill's whole hidden state never crosses to the
        host; kernels take no offset views)."""
        batch, seq, width = (int(v) for v in hidden.shape)
        out = tvm.runtime.empty((batch, 1, width), "float32", hidden.device)
        row = width * 4
        for b in range(batch):
            source = hidden._create_view((1, 1, width), "float32", (b * seq + seq - 1) * row)
            out._create_view((1, 1, width), "float32", b * row).copyfrom(source)
        return out

    def synchronize(self) -> None:
        self.tvm_device.sync()

    def load(self, path: Path, kind: BlockKind, page_kernels: bool) -> Program:
        return load_program(path, self.tvm_device, page_kernels, self.allocator)


def load_program(path: Path, device: tvm.runtime.Device, page_kernels: bool, allocator: str = "pooled") -> Program:
    """A TVM artifact on `device`, run by a VM with `allocator` (TvmBackend); `page_kernels`: wanted for
    decoder kinds whose `main` leaves the append to the runtime (a GPU decode variant's `main` appends itself,
    and moves use the general program's)."""
    try:
        module = tvm.runtime.load_module(str(path))
    except Exception as e:  # TVM raises its own error types; any failure here means an unusable artifact
        raise JitllmError(f"cannot load compiled artifact {path}: {str(e).splitlines()[0]}") from None
    vm = tvm.runtime.vm.VirtualMachine(module, device, allocator)
    embed, argmax = (module.get_function(name, query_imports=True)
                     if module.implements_function(name, query_imports=True) else None
                     for name in (EMBED_FUNCTION, ARGMAX_FUNCTION))
    if not page_kernels:
        return Program(vm["main"], None, None, None, embed, argmax)
    kernels = [module.get_function(name, query_imports=True) for name in (APPEND_FUNCTION, EXPORT_PAGES, IMPORT_PAGES)]
    return Program(vm["main"], *kernels, embed, argmax)
