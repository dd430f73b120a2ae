"""A CUDA device's copy queue (BackendCaps.async_copies): uploads from page-locked host memory on a stream
of their own, ordered against the kernels by CUDA events, for streamed blocks (runtime/engine/streaming.py).

TVM launches kernels on the FFI environment's stream of the device (`tvm_ffi.get_raw_stream`; the legacy
default stream unless a capture made another current). The copy stream is non-blocking, so nothing orders
it against that stream but the events: an upload waits (cuStreamWaitEvent) for the event recorded after
the kernels of its slot's last unit, and the kernels of the unit it brings wait for the event recorded
after the copy.
"""

from __future__ import annotations

import ctypes

import numpy as np
import tvm
import tvm_ffi

from jitllm.runtime.backends import cuda_driver
from jitllm.runtime.backends.cuda_driver import check
from jitllm.runtime.backends.cuda_graph import CU_EVENT_DISABLE_TIMING, CU_STREAM_NON_BLOCKING
from jitllm.runtime.backends.dlpack import data_pointer
from jitllm.runtime.backends.pinned import pinned_pool


class CudaEvent:
    """One CUDA event (a Marker of the copy queue), recorded again for every use."""

    def __init__(self, device: str) -> None:
        self.event = ctypes.c_void_p()
        check(cuda_driver.driver().cuEventCreate(ctypes.byref(self.event), CU_EVENT_DISABLE_TIMING),
              "cuEventCreate", device)

    def __del__(self) -> None:
        if self.event and cuda_driver.loaded() is not None:
            cuda_driver.loaded().cuEventDestroy_v2(self.event)
            self.event = None


class CudaCopyQueue:
    """The CopyQueue protocol (backends/base.py) on one CUDA device."""

    def __init__(self, device: tvm.runtime.Device, name: str) -> None:
        self._device, self._name = device, name
        self._stream: ctypes.c_void_p | None = None  # made at first use, once a context is current

    def staging(self, nbytes: int) -> np.ndarray:
        return pinned_pool(self._device.index).array((nbytes,), "uint8")

    def marker(self) -> CudaEvent:
        cuda_driver.ensure_context(self._device.index)
        return CudaEvent(self._name)

    def record_kernels(self, marker: CudaEvent) -> None:
        check(cuda_driver.driver().cuEventRecord(marker.event, self._kernels()), "cuEventRecord", self._name)

    def upload(self, dst: tvm.runtime.Tensor, src: np.ndarray, after: CudaEvent, done: CudaEvent) -> None:
        cuda, stream = cuda_driver.driver(), self._copies()
        check(cuda.cuStreamWaitEvent(stream, after.event, 0), "cuStreamWaitEvent", self._name)
        check(cuda.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(data_pointer(dst)), ctypes.c_void_p(src.ctypes.data),
                                        ctypes.c_size_t(src.nbytes), stream), "cuMemcpyHtoDAsync", self._name)
        check(cuda.cuEventRecord(done.event, stream), "cuEventRecord", self._name)

    def device_waits(self, marker: CudaEvent) -> None:
        check(cuda_driver.driver().cuStreamWaitEvent(self._kernels(), marker.event, 0), "cuStreamWaitEvent",
              self._name)

    def host_waits(self, marker: CudaEvent) -> None:
        check(cuda_driver.driver().cuEventSynchronize(marker.event), "streamed upload", self._name)

    def _kernels(self) -> ctypes.c_void_p:
        """The stream TVM launches this device's kernels on now."""
        return ctypes.c_void_p(tvm_ffi.get_raw_stream(self._device) or None)

    def _copies(self) -> ctypes.c_void_p:
        if self._stream is None:
            cuda_driver.ensure_context(self._device.index)
            stream = ctypes.c_void_p()
            check(cuda_driver.driver().cuStreamCreate(ctypes.byref(stream), CU_STREAM_NON_BLOCKING),
                  "cuStreamCreate", self._name)
            self._stream = stream
        return self._stream
