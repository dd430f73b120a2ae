"""The page-locked host pool (backends/pinned.py) with a stand-in driver: memory is reused by size,
kept only up to its limit, and a model whose host memory comes from it computes and moves as before."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from jitllm.model import load
from jitllm.runtime.backends import cuda_driver, pinned
from jitllm.runtime.backends.dlpack import data_pointer
from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.engine.packed_weights import PackedWeights

PROMPT = list(range(4, 30))


class FakeDriver:
    """cuMemHostAlloc / cuMemFreeHost over page-aligned numpy memory, counting calls."""

    def __init__(self) -> None:
        self.live: dict[int, np.ndarray] = {}
        self.freed: list[int] = []

    def cuCtxGetCurrent(self, ctx) -> int:
        ctx._obj.value = 1
        return 0

    def cuMemHostAlloc(self, pointer, size, flags) -> int:
        backing = np.zeros(size.value + 4096, np.uint8)
        address = -(-backing.ctypes.data // 4096) * 4096
        self.live[address] = backing
        pointer._obj.value = address
        return 0

    def cuMemFreeHost(self, pointer: ctypes.c_void_p) -> int:
        self.freed.append(pointer.value)
        self.live.pop(pointer.value)
        return 0


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda_driver, "driver", lambda: fake)
    return fake


def test_memory_given_back_is_reused_by_size_up_to_the_limit(driver):
    pool = pinned.PinnedPool(keep_bytes=4100)
    a = pool.tensor((256,), "float32")  # 1024 bytes
    address = data_pointer(a)
    assert address in driver.live and a.device.dlpack_device_type() == 1  # a host tensor
    a.copyfrom(np.arange(256, dtype=np.float32))
    assert a.numpy()[255] == 255
    del a
    assert pool.kept_bytes == 1024 and not driver.freed
    b = pool.tensor((16, 16), "float32")  # same size: the same memory, no new lock
    assert data_pointer(b) == address and pool.locked == 1
    c, d = pool.tensor((2000,), "uint8"), pool.tensor((2000,), "uint8")
    assert pool.locked == 3
    del b, c
    assert pool.kept_bytes == 3024 and not driver.freed
    del d  # past the limit: the memory kept longest (b's) goes back to the system
    assert pool.kept_bytes == 4000 and driver.freed == [address]


def test_packed_weights_and_moves_use_the_host_pool(driver, tiny_model, cache_dir):
    baseline = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact").generate_ids(PROMPT, 12)
    pool = pinned.PinnedPool()
    sim = simulated_device("sim:0")
    sim.host_allocator = pool.tensor
    model = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", extra_devices=[sim])
    ex = model.executor
    assert all(data_pointer(u.weights.buffer) in driver.live for u in ex.blocks)
    assert data_pointer(ex.pools["host"].pages) in driver.live
    model.move_schedule = {3: ["0=sim:0"], 6: ["0=host"], 9: ["0=sim:0"]}
    assert model.generate_ids(PROMPT, 12) == baseline
    locked = pool.locked
    model.move("0", "host")
    model.move("0", "sim:0")  # the block's host memory went back to the pool and is reused
    model.move("0", "host")
    assert pool.locked == locked
    assert isinstance(ex.blocks[0].weights, PackedWeights)


def test_leases_come_back_from_many_threads(driver):
    import threading

    pool = pinned.PinnedPool(keep_bytes=8 * 1024)

    def work() -> None:
        for i in range(300):
            held = [pool.array((1024 * (1 + (i + j) % 3),), "uint8") for j in range(3)]
            del held

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = [address for addresses in pool._kept.values() for address in addresses]
    assert sorted(kept) == sorted(pool._order) and all(a in driver.live for a in kept)
    assert pool.kept_bytes == sum(pool._order.values()) <= pool.keep_bytes
    assert len(driver.live) == len(kept)  # everything not kept went back to the system
