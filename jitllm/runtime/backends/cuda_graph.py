"""CUDA graphs through the driver API (libcuda, present wherever a CUDA driver is), for decode steps.

TVM launches its kernels on the stream of the FFI environment (`TVMFFIEnvGetStream`), so capturing is:
make our stream current for the device, begin a capture on it, run the step's VM functions as usual
(the kernels are recorded, not run; the VM's pooled allocator may still allocate, which the relaxed
capture mode allows), end the capture and instantiate the graph. A replay launches every recorded
kernel with the buffer addresses of the capture: callers must keep those buffers alive and unchanged
in place (jitllm.runtime.engine.step_graphs does).

The recorder is also the device's `Transfers`: a step's host arrays are page-locked (devices.pinned), and
the copies between them and the device tensors, issued on the capture stream while capturing, become
nodes of the graph, so a replayed decode step needs no other driver call than its launch and wait.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np
import tvm

from jitllm.runtime.backends import cuda_driver
from jitllm.runtime.backends.cuda_driver import check
from jitllm.runtime.backends.dlpack import data_pointer
from jitllm.runtime.backends.pinned import pinned_pool

CU_STREAM_NON_BLOCKING = 1
CU_STREAM_CAPTURE_MODE_RELAXED = 2
CU_EVENT_DISABLE_TIMING = 2

class CudaGraph:
    """An instantiated graph and the stream it replays on."""

    def __init__(self, exec_handle: ctypes.c_void_p, stream: ctypes.c_void_p, device: str) -> None:
        self._exec, self._stream, self._device = exec_handle, stream, device

    def replay(self) -> None:
        """Run the captured kernels and wait for them (the outputs are read right after)."""
        self.launch()
        check(cuda_driver.driver().cuStreamSynchronize(self._stream), "CUDA graph run", self._device)

    def launch(self) -> None:
        """Queue the captured kernels on the stream and return at once (`StepFence` tells when they ran)."""
        check(cuda_driver.driver().cuGraphLaunch(self._exec, self._stream), "CUDA graph launch", self._device)

    def __del__(self) -> None:
        if self._exec and cuda_driver.loaded() is not None:
            cuda_driver.loaded().cuGraphExecDestroy(self._exec)
            self._exec = None


class CudaFence:
    """A CUDA event on a recorder's stream: `record` marks the work queued so far, `wait` blocks until it ran."""

    def __init__(self, stream: ctypes.c_void_p, device: str) -> None:
        self._stream, self._device = stream, device
        self._event = ctypes.c_void_p()
        check(cuda_driver.driver().cuEventCreate(ctypes.byref(self._event), CU_EVENT_DISABLE_TIMING),
              "cuEventCreate", device)

    def record(self) -> None:
        check(cuda_driver.driver().cuEventRecord(self._event, self._stream), "cuEventRecord", self._device)

    def wait(self) -> None:
        check(cuda_driver.driver().cuEventSynchronize(self._event), "CUDA graph run", self._device)

    def __del__(self) -> None:
        if self._event and cuda_driver.loaded() is not None:
            cuda_driver.loaded().cuEventDestroy_v2(self._event)
            self._event = None


class CudaGraphRecorder:
    """Captures steps of one CUDA device on a stream of its own."""

    def __init__(self, device: tvm.runtime.Device, name: str) -> None:
        self._device, self._name = device, name
        self._stream: ctypes.c_void_p | None = None  # made at the first capture, once TVM has a context current
        self._capturing = False

    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """A zeroed array in page-locked host memory (jitllm.runtime.backends.pinned)."""
        array = pinned_pool(self._device.index).array(shape, dtype)
        array[...] = 0
        return array

    def copy_in(self, tensor: tvm.runtime.Tensor, array: np.ndarray) -> None:
        """Host array -> device tensor: a graph node while capturing, else TVM's synchronous copy."""
        if not self._capturing:
            tensor.copyfrom(array)
            return
        self._captured_copy("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(data_pointer(tensor)),
                            ctypes.c_void_p(array.ctypes.data), array.nbytes)

    def copy_out(self, array: np.ndarray, tensor: tvm.runtime.Tensor) -> None:
        """Device tensor -> host array: a graph node while capturing, else TVM's synchronous copy."""
        if not self._capturing:
            array[...] = tensor.numpy()
            return
        self._captured_copy("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(array.ctypes.data),
                            ctypes.c_uint64(data_pointer(tensor)), array.nbytes)

    def _captured_copy(self, call: str, dst: object, src: object, nbytes: int) -> None:
        """One asynchronous copy on the capture stream: a node of the graph being captured."""
        rc = getattr(cuda_driver.driver(), call)(dst, src, ctypes.c_size_t(nbytes), self._stream)
        check(rc, call.removesuffix("_v2"), self._name)

    def fence(self) -> CudaFence:
        """A marker of this recorder's stream, for steps launched without waiting (`CudaGraph.launch`)."""
        return CudaFence(self._ready_stream(), self._name)

    def _ready_stream(self) -> ctypes.c_void_p:
        if self._stream is None:
            stream = ctypes.c_void_p()
            rc = cuda_driver.driver().cuStreamCreate(ctypes.byref(stream), CU_STREAM_NON_BLOCKING)
            check(rc, "cuStreamCreate", self._name)
            self._stream = stream
        return self._stream

    def capture(self, body: Callable[[Callable], object]) -> tuple[CudaGraph, object]:
        """Record `body(call)` (which launches its kernels through `call(fn, *args)`); its return value
        holds the output tensors, written in place by every replay."""
        import tvm_ffi

        cuda = cuda_driver.driver()
        self._ready_stream()
        graph = ctypes.c_void_p()
        with tvm_ffi.use_raw_stream(self._device, self._stream.value):
            check(cuda.cuStreamBeginCapture_v2(self._stream, CU_STREAM_CAPTURE_MODE_RELAXED),
                   "cuStreamBeginCapture", self._name)
            self._capturing = True
            try:
                outputs = body(lambda fn, *args: fn(*args))
            finally:
                self._capturing = False
                rc = cuda.cuStreamEndCapture(self._stream, ctypes.byref(graph))
        check(rc, "cuStreamEndCapture", self._name)
        exec_handle = ctypes.c_void_p()
        try:
            check(cuda.cuGraphInstantiateWithFlags(ctypes.byref(exec_handle), graph, ctypes.c_ulonglong(0)),
                   "cuGraphInstantiate", self._name)
        finally:
            cuda.cuGraphDestroy(graph)
        return CudaGraph(exec_handle, self._stream, self._name), outputs
