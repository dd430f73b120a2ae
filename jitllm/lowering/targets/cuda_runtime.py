"""Loading TVM's CUDA runtime library, with a do-nothing libcuda where no driver is installed.

TVM links its CUDA runtime against libcuda.so.1. On a machine without the NVIDIA driver (our build
machine) it then cannot load that runtime and silently stores CUDA *source* in artifacts, which a
runtime-only TVM cannot load (DESIGN.md §3). To compile real GPU code there, we load a stub libcuda
(its SONAME must be libcuda.so.1 so the dynamic loader accepts it) and let TVM call nvcc.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

import tvm

from jitllm.core.atomic import atomic_path
from jitllm.core.errors import JitllmError
from jitllm.core.paths import home_dir

_STUB_SOURCE = r"""
#define STUB(name) int name() { return 100; /* CUDA_ERROR_NO_DEVICE */ }
STUB(cuDeviceGetName) STUB(cuFuncSetAttribute) STUB(cuLaunchKernelEx) STUB(cuModuleGetFunction)
STUB(cuModuleLoadData) STUB(cuModuleUnload) STUB(cuTensorMapEncodeTiled)
int cuGetErrorName(int e, const char **s) { (void)e; *s = "CUDA_STUB"; return 0; }
int cuGetErrorString(int e, const char **s) { (void)e; *s = "libcuda stub (no driver)"; return 0; }
"""


def _load_runtime() -> None:
    import tvm_ffi

    tvm.base._LOADED_LIBS["tvm_runtime_cuda"] = tvm_ffi.libinfo.load_lib_ctypes(
        "tvm", "tvm_runtime_cuda", "RTLD_LOCAL", extra_lib_paths=tvm.libinfo.package_lib_paths())


def cuda_runtime_loaded() -> bool:
    return "tvm_runtime_cuda" in tvm.base._LOADED_LIBS


def ensure_cuda_runtime(allow_stub: bool) -> bool:
    """Load TVM's CUDA runtime. Returns True if it runs on a stub (no driver: compile only)."""
    if cuda_runtime_loaded():
        return os.environ.get("JITLLM_CUDA_STUB") == "1"
    try:
        _load_runtime()
        return False
    except OSError:
        if not allow_stub:
            raise JitllmError("CUDA is not available: TVM's CUDA runtime cannot find libcuda.so.1 (no NVIDIA driver)") from None
    ctypes.CDLL(str(_stub_path()), mode=ctypes.RTLD_GLOBAL)
    _load_runtime()
    os.environ["JITLLM_CUDA_STUB"] = "1"
    return True


def _stub_path() -> Path:
    path = home_dir() / "cuda-stub" / "libcuda.so.1"
    if path.exists():
        return path
    with tempfile.TemporaryDirectory() as tmp, atomic_path(path) as out:
        src = Path(tmp) / "stub.c"
        src.write_text(_STUB_SOURCE)
        try:
            subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out), str(src)],
                           check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise JitllmError(f"cannot build the libcuda stub needed to compile CUDA without a driver: {e}") from None
    return path
