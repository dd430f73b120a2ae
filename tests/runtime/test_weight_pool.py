"""Weights buffers kept for reuse per device (backends/buffer_pool.py), on simulated devices whose memory
comes from a stand-in allocator that counts allocations (and can run out): a block moving back and forth
allocates nothing after its first trip, budgets are charged as without the pool, tokens are the same, a
failed allocation lets the kept buffers go and is retried, the bound drops the buffer kept longest, the
environment turns the pool off, and a buffer anything still holds is never handed out again."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import tvm
import tvm_ffi

from jitllm.core.errors import JitllmError
from jitllm.model import load
from jitllm.runtime.backends.buffer_pool import KEEP_BYTES, BufferPool, pool_from_env
from jitllm.runtime.backends.fake import ReplayRecorder, simulated_device
from jitllm.runtime.engine import packed_weights
from jitllm.runtime.engine.packed_weights import PackedWeights

PROMPT = list(range(4, 30))
N = 24


class _Lease:
    def __init__(self, memory: "StandInMemory", nbytes: int, backing: np.ndarray) -> None:
        self.memory, self.nbytes, self.backing = memory, nbytes, backing

    def __del__(self) -> None:
        self.memory.live -= self.nbytes


class StandInMemory:
    """A device's allocator over host memory (256-byte aligned): counts allocations and the bytes still
    held (given back when the last tensor over them is gone), and fails past `capacity`."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity, self.live, self.allocations, self.failures = capacity, 0, 0, 0

    def __call__(self, shape: tuple[int, ...], dtype: str) -> tvm.runtime.Tensor:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self.capacity is not None and self.live + nbytes > self.capacity:
            self.failures += 1
            raise RuntimeError(f"out of memory allocating {nbytes} bytes (stand-in)")
        backing = np.zeros(nbytes + 256, np.uint8)
        raw = (ctypes.c_uint8 * max(1, nbytes)).from_address(-(-backing.ctypes.data // 256) * 256)
        raw.lease = _Lease(self, nbytes, backing)
        self.live += nbytes
        self.allocations += 1
        return tvm_ffi.from_dlpack(np.frombuffer(raw, np.uint8, nbytes).view(dtype).reshape(shape))


def _sim(name: str, pool: bool = True, capacity: int | None = None, graphs: bool = False):
    device = simulated_device(name)
    device.allocator = StandInMemory(capacity)
    device.weight_pool = BufferPool() if pool else None
    device.graphs = ReplayRecorder() if graphs else None
    return device


def _load(path, cache_dir, *devices):
    return load(path, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", extra_devices=list(devices))


@pytest.fixture(scope="module")
def baseline(tiny_model, cache_dir):
    return _load(tiny_model, cache_dir).generate_ids(PROMPT, N)


def test_a_block_moving_back_and_forth_allocates_nothing_after_its_first_trip(tiny_model, cache_dir, monkeypatch):
    sim0, sim1 = _sim("sim:0"), _sim("sim:1")
    model = _load(tiny_model, cache_dir, sim0, sim1)
    ex = model.executor
    model.move("0", "sim:0")
    model.move("0", "sim:1")
    model.move("0", "sim:0")  # each side has had the block once (and its KV pool made)
    made = (sim0.allocator.allocations, sim1.allocator.allocations)
    made_aliases = []
    aliases = packed_weights.aliases
    monkeypatch.setattr(packed_weights, "aliases", lambda *args: made_aliases.append(args) or aliases(*args))
    for _ in range(3):
        model.move("0", "sim:1")
        model.move("0", "sim:0")
    assert (sim0.allocator.allocations, sim1.allocator.allocations) == made and made_aliases == []
    assert sim0.weight_pool.reused == 4 and sim1.weight_pool.reused == 3

    # block 1 has block 0's shape: it takes the buffer block 0 left on sim:1, aliases and all
    model.move("0", "host")  # (the host keeps no buffers here: aliases made there)
    left, made_aliases[:] = sim0.weight_pool.kept_bytes, []
    model.move("1", "sim:0")
    assert sim0.allocator.allocations == made[0] and made_aliases == [] and sim0.weight_pool.kept_bytes == 0
    assert left == int(ex.blocks[1].weights.buffer.shape[0])
    assert np.array_equal(ex.blocks[1].weights[1].numpy(), ex.upload_weights(1, model.devices["host"])[1].numpy())


def test_budgets_are_charged_as_without_the_pool(tiny_model, cache_dir):
    used = {}
    for pool in (False, True):
        sim0, sim1 = _sim("sim:0", pool), _sim("sim:1", pool)
        model = _load(tiny_model, cache_dir, sim0, sim1)
        steps = []
        for blocks, target in [("0", "sim:0"), ("0-1", "sim:1"), ("head", "sim:0"), ("0", "host"), ("*", "sim:0"),
                               ("head", "host"), ("*", "host")]:
            model.move(blocks, target)
            steps.append([(d.used_bytes, d.kv_bytes) for d in model.devices.values()])
        used[pool] = steps
        if pool:  # the blocks and the head that left are kept, not charged
            assert sim0.used_bytes == sim1.used_bytes == 0 and sim0.weight_pool.kept_bytes > 0
    assert used[True] == used[False]


def test_tokens_are_the_same_with_the_pool(tiny_model, cache_dir, baseline):
    """Moves every few tokens between pooled devices that capture their decode steps (a replayed step
    must never read a buffer that another unit took from the pool)."""
    sim0, sim1 = _sim("sim:0", graphs=True), _sim("sim:1", graphs=True)
    model = _load(tiny_model, cache_dir, sim0, sim1)
    model.move_schedule = {3: ["0=sim:0"], 6: ["1=sim:0,head=sim:1"], 9: ["0-1=sim:1"], 12: ["*=host"],
                           14: ["1=sim:1,0=sim:0"], 16: ["head=sim:0,0=sim:1,1=sim:0"], 20: ["*=host,head=host"]}
    assert model.generate_ids(PROMPT, N) == baseline
    assert sim0.weight_pool.reused >= 2 and sim1.weight_pool.reused >= 2
    assert sim0.graphs.captures >= 2 and sim1.graphs.captures >= 2


def test_a_failed_allocation_lets_the_kept_buffers_go_and_is_retried(tiny_model, cache_dir, baseline):
    sim = _sim("sim:0")
    model = _load(tiny_model, cache_dir, sim)
    ex = model.executor
    model.move("0", "sim:0")
    model.move("0", "host")
    kept = sim.weight_pool.kept_bytes
    head = int(ex.head.weights.buffer.shape[0])
    assert kept > 0 and head != kept
    sim.allocator.capacity = sim.allocator.live - kept // 2 + head  # the head fits only without the kept buffer
    model.move("head", "sim:0")
    assert sim.allocator.failures == 1 and sim.weight_pool.kept_bytes == 0 and ex.head.device is sim
    sim.allocator.capacity = None
    assert model.generate_ids(PROMPT, N) == baseline and ex.head.device is sim

    sim.allocator.capacity = sim.allocator.live  # nothing kept to let go: the failure stands
    with pytest.raises(RuntimeError, match="out of memory"):
        sim.empty((64,), "uint8")
    assert sim.allocator.failures == 2


def test_the_bound_drops_the_buffer_kept_longest():
    pool = BufferPool(keep_bytes=3000)
    layout = (((4,), "float32", 0),)
    buffers = {n: tvm.runtime.empty((n,), "uint8", tvm.cpu(0)) for n in (1000, 1024, 1100, 4000)}
    address = {n: b.data_ptr() for n, b in buffers.items()}
    for n in (1000, 1024, 1100, 4000):  # the last is over the bound on its own: not kept
        pool.give_back(buffers.pop(n), layout, ())
    assert pool.kept_bytes == 2124
    assert pool.take(1000, layout) is None and pool.take(4000, layout) is None
    assert [pool.take(n, layout)[0].data_ptr() for n in (1024, 1100)] == [address[1024], address[1100]]
    assert pool.kept_bytes == 0 and pool.reused == 2


def test_the_environment_bounds_or_turns_off_the_pool(tiny_model, cache_dir, monkeypatch):
    monkeypatch.delenv("JITLLM_DEVICE_POOL", raising=False)
    assert pool_from_env().keep_bytes == KEEP_BYTES == 1 << 30
    monkeypatch.setenv("JITLLM_DEVICE_POOL", "64M")
    assert pool_from_env().keep_bytes == 64 << 20
    monkeypatch.setenv("JITLLM_DEVICE_POOL", "lots")
    with pytest.raises(JitllmError, match="JITLLM_DEVICE_POOL: bad size 'lots'"):
        pool_from_env()

    def paged(monkeypatch_value: str | None):
        if monkeypatch_value is None:
            monkeypatch.delenv("JITLLM_DEVICE_POOL", raising=False)
        else:
            monkeypatch.setenv("JITLLM_DEVICE_POOL", monkeypatch_value)
        sim = simulated_device("sim:0")  # stands for a CUDA device: the host's memory becomes "page-locked"
        sim.host_allocator = lambda shape, dtype: tvm.runtime.empty(shape, dtype, tvm.cpu(0))
        return _load(tiny_model, cache_dir, sim)

    assert paged(None).devices["host"].weight_pool.keep_bytes == KEEP_BYTES
    model = paged("0")
    assert model.devices["host"].weight_pool is None
    model.move("0", "sim:0")
    model.move("0", "host")
    assert model.executor.blocks[0].weights._pool is None


@pytest.mark.parametrize("hold", ["alias", "buffer", "weights", "tvm-reference", "numpy-import"])
def test_a_buffer_still_held_is_not_handed_out_again(tiny_model, cache_dir, hold):
    """What a caller (or a captured step) still holds of weights that left a device keeps their buffer
    out of reach: the next weights of that size get a buffer of their own, and the held tensor keeps
    its values. Once let go, the buffer is reused."""
    sim = _sim("sim:0")
    model = _load(tiny_model, cache_dir, sim)
    ex = model.executor
    model.move("0", "sim:0")
    weights = ex.blocks[0].weights
    (shape, dtype, offset), address = weights.layout[1], weights.buffer.data_ptr()
    values = weights[1].numpy().copy()
    held = {"alias": lambda: weights[1], "buffer": lambda: weights.buffer, "weights": lambda: weights,
            "tvm-reference": lambda: tvm_ffi.Array([weights[1]]),  # TVM's reference only, no Python one
            "numpy-import": lambda: np.from_dlpack(weights[1])}[hold]()
    del weights
    model.move("0", "host")
    made = sim.allocator.allocations
    model.move("1", "sim:0")  # block 1 has block 0's shape and other values
    assert sim.allocator.allocations == made + 1 and ex.blocks[1].weights.buffer.data_ptr() != address
    held_values = {"alias": lambda: held.numpy(), "weights": lambda: held[1].numpy(),
                   "tvm-reference": lambda: held[0].numpy(), "numpy-import": lambda: held,
                   "buffer": lambda: held.numpy()[offset:offset + values.nbytes].view(dtype).reshape(shape)}[hold]()
    assert np.array_equal(held_values, values) and not np.array_equal(ex.blocks[1].weights[1].numpy(), values)
    del held, held_values
    model.move("1", "host")
    model.move("0", "sim:0")  # block 0's old buffer is free now (and so is block 1's)
    assert sim.allocator.allocations == made + 1 and sim.weight_pool.reused == 1


def test_buffers_come_back_from_many_threads_and_are_never_shared():
    """Threads take buffers, stamp them, check the stamp and drop them (given back from whichever
    thread drops the last reference): no buffer is ever handed to two holders at once, and the books
    stay consistent and within the bound."""
    pool = BufferPool(keep_bytes=8 * 1024)
    device = simulated_device("sim:0")
    device.weight_pool = pool
    layout = (((256,), "uint8", 0),)
    errors = []

    def work(stamp: int) -> None:
        for i in range(200):
            held = [PackedWeights.upload(device, [[np.full(1024 * (1 + (i + j) % 3), stamp, np.uint8)]])
                    for j in range(3)]
            for weights in held:
                weights.buffer.copyfrom(np.full(int(weights.buffer.shape[0]), stamp, np.uint8))
            for weights in held:
                if not (weights.buffer.numpy() == stamp).all():
                    errors.append(stamp)
            del held, weights

    threads = [threading.Thread(target=work, args=(stamp,)) for stamp in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.take(1, layout)  # files whatever is still queued
    assert errors == []
    kept = [entry for entries in pool._kept.values() for entry in entries]
    assert sorted(map(id, kept)) == sorted(pool._order) and pool.reused > 0
    assert pool.kept_bytes == sum(entry.nbytes for entry in kept) <= pool.keep_bytes
    assert len({entry.buffer.data_ptr() for entry in kept}) == len(kept)
