"""CUDA graphs through the driver API (libcuda, present wherever a CUDA driver is), for decode steps.

TVM launches its kernels on the stream of the FFI environment (`TVMFFIEnvGetStream`), so capturing is:
make our stream current for the device, begin a capture on it, run the step's VM functions as usual
(the kernels are recorded, not run; the VM's pooled allocator may still allocate, which the relaxed
capture mode allows), end the capture and instantiate the graph. A replay launches every recorded
kernel with the buffer addresses of the capture: callers must keep those buffers alive and unchanged
in place (jitllm.runtime.step_graphs does).

The recorder is also the device's `Transfers`: a step's host arrays are page-locked (devices.pinned), and
the copies between them and the device tensors, issued on the capture stream while capturing, become
nodes of the graph, so a replayed decode step needs no other driver call than its launch and wait.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np
import tvm

from jitllm.errors import DeviceFault
from jitllm.runtime.dlpack import data_pointer

CU_STREAM_NON_BLOCKING = 1
CU_STREAM_CAPTURE_MODE_RELAXED = 2

_driver: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _check(rc: int, what: str, device: str) -> None:
    if rc != 0:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(rc, ctypes.byref(text))
        raise DeviceFault(device, f"{what} failed: {(text.value or b'CUDA error %d' % rc).decode()}")


class CudaGraph:
    """An instantiated graph and the stream it replays on."""

    def __init__(self, exec_handle: ctypes.c_void_p, stream: ctypes.c_void_p, device: str) -> None:
        self._exec, self._stream, self._device = exec_handle, stream, device

    def replay(self) -> None:
        """Run the captured kernels and wait for them (the outputs are read right after)."""
        _check(_cuda().cuGraphLaunch(self._exec, self._stream), "CUDA graph launch", self._device)
        _check(_cuda().cuStreamSynchronize(self._stream), "CUDA graph run", self._device)

    def __del__(self) -> None:
        if self._exec and _driver is not None:
            _driver.cuGraphExecDestroy(self._exec)
            self._exec = None


class CudaGraphRecorder:
    """Captures steps of one CUDA device on a stream of its own."""

    def __init__(self, device: tvm.runtime.Device, name: str) -> None:
        self._device, self._name = device, name
        self._stream: ctypes.c_void_p | None = None  # made at the first capture, once TVM has a context current
        self._capturing = False

    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A zeroed array in page-locked host memory (jitllm.runtime.devices.pinned)."""
        from jitllm.runtime.devices.pinned import pinned_pool

        array = pinned_pool(self._device.index).array(shape, dtype)
        array[...] = 0
        return array

    def copy_in(self, tensor: tvm.runtime.Tensor, array: np.ndarray) -> None:
        """Host array -> device tensor: a graph node while capturing, else TVM's synchronous copy."""
        if not self._capturing:
            tensor.copyfrom(array)
            return
        _check(_cuda().cuMemcpyHtoDAsync_v2(ctypes.c_uint64(data_pointer(tensor)), ctypes.c_void_p(array.ctypes.data),
                                            ctypes.c_size_t(array.nbytes), self._stream),
               "cuMemcpyHtoDAsync", self._name)

    def copy_out(self, array: np.ndarray, tensor: tvm.runtime.Tensor) -> None:
        """Device tensor -> host array: a graph node while capturing, else TVM's synchronous copy."""
        if not self._capturing:
            array[...] = tensor.numpy()
            return
        _check(_cuda().cuMemcpyDtoHAsync_v2(ctypes.c_void_p(array.ctypes.data), ctypes.c_uint64(data_pointer(tensor)),
                                            ctypes.c_size_t(array.nbytes), self._stream),
               "cuMemcpyDtoHAsync", self._name)

    def _ready_stream(self) -> ctypes.c_void_p:
        if self._stream is None:
            stream = ctypes.c_void_p()
            _check(_cuda().cuStreamCreate(ctypes.byref(stream), CU_STREAM_NON_BLOCKING), "cuStreamCreate", self._name)
            self._stream = stream
        return self._stream

    def capture(self, body: Callable[[Callable], object]) -> tuple[CudaGraph, object]:
        """Record `body(call)` (which launches its kernels through `call(fn, *args)`); its return value
        holds the output tensors, written in place by every replay."""
        import tvm_ffi

        cuda = _cuda()
        self._ready_stream()
        graph = ctypes.c_void_p()
        with tvm_ffi.use_raw_stream(self._device, self._stream.value):
            _check(cuda.cuStreamBeginCapture_v2(self._stream, CU_STREAM_CAPTURE_MODE_RELAXED),
                   "cuStreamBeginCapture", self._name)
            self._capturing = True
            try:
                outputs = body(lambda fn, *args: fn(*args))
            finally:
                self._capturing = False
                rc = cuda.cuStreamEndCapture(self._stream, ctypes.byref(graph))
        _check(rc, "cuStreamEndCapture", self._name)
        exec_handle = ctypes.c_void_p()
        try:
            _check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(exec_handle), graph, ctypes.c_ulonglong(0)),
                   "cuGraphInstantiate", self._name)
        finally:
            cuda.cuGraphDestroy(graph)
        return CudaGraph(exec_handle, self._stream, self._name), outputs
