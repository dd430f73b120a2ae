"""The CUDA recorder's transfers against a stand-in driver: outside a capture they are TVM's own
copies; while capturing, each is one asynchronous driver copy on the capture stream between the host
array and the tensor's memory (the node a replayed decode step runs)."""

from __future__ import annotations

import ctypes

import numpy as np
import tvm

from jitllm.runtime.backends import cuda_driver
from jitllm.runtime.backends.cuda_graph import CudaGraphRecorder
from jitllm.runtime.backends.dlpack import data_pointer


class FakeDriver:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int, int]] = []

    def __getattr__(self, name: str):
        def call(dst, src, nbytes, stream) -> int:
            self.calls.append((name, dst.value, src.value, nbytes.value, stream.value))
            return 0
        return call


def test_transfers_are_plain_copies_outside_a_capture_and_driver_copies_inside(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda_driver, "driver", lambda: fake)
    recorder = CudaGraphRecorder(tvm.cpu(0), "cuda:0")
    tensor = tvm.runtime.empty((4,), "float32", tvm.cpu(0))
    array = np.arange(4, dtype=np.float32)
    recorder.copy_in(tensor, array)
    assert np.array_equal(tensor.numpy(), array) and not fake.calls
    back = np.zeros(4, np.float32)
    recorder.copy_out(back, tensor)
    assert np.array_equal(back, array) and not fake.calls

    recorder._capturing, recorder._stream = True, ctypes.c_void_p(77)
    recorder.copy_in(tensor, array)
    recorder.copy_out(back, tensor)
    assert fake.calls == [("cuMemcpyHtoDAsync_v2", data_pointer(tensor), array.ctypes.data, 16, 77),
                          ("cuMemcpyDtoHAsync_v2", back.ctypes.data, data_pointer(tensor), 16, 77)]
