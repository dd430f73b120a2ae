"""The CUDA driver API through ctypes (libcuda, present wherever a CUDA driver is): what TVM's runtime
does not expose — graphs, page-locked memory, peer access. Callers reach it as `cuda_driver.driver()`
so tests can stand a fake in for it."""

from __future__ import annotations

import ctypes

from jitllm.core.errors import DeviceFault

_lib: ctypes.CDLL | None = None


def driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def loaded() -> ctypes.CDLL | None:
    """The library if something already loaded it (finalizers must not load it at interpreter exit)."""
    return _lib


def check(rc: int, what: str, device: str) -> None:
    """A driver call's result as a DeviceFault naming the call and the driver's message."""
    if rc != 0:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(rc, ctypes.byref(text))
        raise DeviceFault(device, f"{what} failed: {(text.value or b'CUDA error %d' % rc).decode()}")


def primary_context(ordinal: int) -> tuple[ctypes.c_int, ctypes.c_void_p] | None:
    """(device handle, primary context) of a CUDA ordinal — the context TVM's runtime uses — or None
    where the driver refuses."""
    lib = driver()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if lib.cuDeviceGet(ctypes.byref(dev), ordinal) or lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
        return None
    return dev, ctx


def ensure_context(ordinal: int) -> None:
    """The driver API needs a current context on this thread: the device's primary one (the runtime's)."""
    lib = driver()
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        return
    lib.cuInit(0)
    primary = primary_context(ordinal)
    if primary is not None:
        lib.cuCtxSetCurrent(primary[1])
