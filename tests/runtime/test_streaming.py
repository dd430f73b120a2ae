"""Streamed blocks (`~`) on a simulated device whose budget is smaller than the weights: the blocks pass
through two slots each token, the logits equal a resident run's bit for bit (a simulated device computes
from the slots' host memory, so a slot holding the wrong block's weights shows in the logits), and the
charged bytes and the bytes uploaded per token are what the slots and the streamed blocks say."""

from __future__ import annotations

import ctypes
import dataclasses
import numpy as np
import pytest

from jitllm.core.errors import JitllmError
from jitllm.model import load
from jitllm.runtime.backends import fake
from jitllm.runtime.backends.base import BackendCaps

PROMPT = list(range(4, 30))
STEPS = 10
BUDGET = 64_000
"""Bytes of sim:0: two 23 KiB slots and the 13 KiB head, not the four 23 KiB blocks."""


@pytest.fixture(autouse=True)
def sim_devices(monkeypatch):
    monkeypatch.setenv(fake.ENABLE, "1")


def _load(path, cache_dir, devices="cpu", placement=None):
    return load(path, devices=devices, ctx=128, cache_dir=cache_dir, placement=placement, cpu_kernels="exact")


def _logits(model, moves=None) -> list[np.ndarray]:
    """The prompt's last logits, then STEPS greedy steps' (with `moves[k]` applied before step k)."""
    ex = model.executor
    session = ex.new_session()
    out = [ex.forward(session, PROMPT)]
    for k in range(STEPS):
        for spec in (moves or {}).get(k, []):
            target = spec.split("=")[1]
            model.move(spec.split("=")[0], target)
        out.append(ex.forward(session, [int(np.argmax(out[-1]))]))
    return out


@pytest.fixture(scope="module")
def resident(tiny_four_blocks, cache_dir):
    return _logits(_load(tiny_four_blocks, cache_dir))


def test_streamed_blocks_match_a_resident_run_within_the_slots(tiny_four_blocks, cache_dir, resident):
    model = _load(tiny_four_blocks, cache_dir, f"sim:0={BUDGET}", "*=sim:0~")
    ex, device = model.executor, model.devices["sim:0"]
    block_bytes = ex.blocks[0].nbytes
    assert all(u.stream is not None and u.weights is None for u in ex.blocks)
    assert 4 * block_bytes + ex.head.nbytes > BUDGET  # the weights do not fit; the slots do
    assert device.used_bytes == 2 * block_bytes + ex.head.nbytes
    pool = ex.streams["sim:0"]
    session = ex.new_session()
    logits = [ex.forward(session, PROMPT)]
    assert len(pool.slots) == 2 and pool.uploads == 5  # four blocks, and the next token's first prefetched
    for _ in range(STEPS):
        before = pool.uploaded_bytes
        logits.append(ex.forward(session, [int(np.argmax(logits[-1]))]))
        assert pool.uploaded_bytes - before == 4 * block_bytes  # every block once per token
    assert all(np.array_equal(a, b) for a, b in zip(logits, resident, strict=True))
    assert ex.pools["sim:0"].pages.device == device.backend.tvm_device  # KV stays on the device
    assert model.plan.budgets[0].upload_bytes_per_token == 4 * block_bytes
    assert "4 blocks stream" in model.plan.describe()


def test_batched_steps_over_streamed_blocks_match_a_resident_run(tiny_four_blocks, cache_dir):
    """Two sessions' ragged prefill and decode steps (each streamed block once per step for both)."""
    prompts = [PROMPT, PROMPT[:9]]

    def run(model):
        ex = model.executor
        sessions = [ex.new_session(), ex.new_session()]
        out = [ex.batched_forward(list(zip(sessions, prompts)))]
        for _ in range(3):
            out.append(ex.batched_forward([(s, [int(np.argmax(row))]) for s, row in zip(sessions, out[-1])]))
        return out

    streamed = _load(tiny_four_blocks, cache_dir, f"sim:0={BUDGET}", "*=sim:0~")
    assert all(np.array_equal(a, b) for a, b in zip(run(streamed), run(_load(tiny_four_blocks, cache_dir)), strict=True))
    assert streamed.executor.streams["sim:0"].uploads == 4 * 4 + 1


def test_recurrent_and_attention_blocks_stream_through_one_pool(tiny_hybrid_model, cache_dir):
    """llama, gla, llama, gla: two layouts in the same slots, a recurrent step reading its slot."""
    model = _load(tiny_hybrid_model, cache_dir, "sim:0=100000", "*=sim:0~")
    assert len({s.layout for s in model.executor.streams["sim:0"].members.values()}) == 2
    assert all(np.array_equal(a, b) for a, b in zip(_logits(model), _logits(_load(tiny_hybrid_model, cache_dir)),
                                                    strict=True))


def test_moves_of_streamed_blocks_keep_the_logits(tiny_four_blocks, cache_dir, resident):
    """A streamed block made resident on the host, streamed on another device and back; one made resident on
    another device; one made resident on its own device (its KV pages staying) and streamed again."""
    model = _load(tiny_four_blocks, cache_dir, "sim:0=100000,sim:1=200000", "*=sim:0~")
    moves = {2: ["1=host"], 4: ["1=sim:1~"], 6: ["3=sim:1"], 7: ["2=sim:0"], 8: ["0-1=sim:0~"], 9: ["2=sim:0~"]}
    assert all(np.array_equal(a, b) for a, b in zip(_logits(model, moves), resident, strict=True))
    ex = model.executor
    assert [u.device.name for u in ex.blocks] == ["sim:0", "sim:0", "sim:0", "sim:1"]
    assert [u.stream is not None for u in ex.blocks] == [True, True, True, False]
    assert sorted(ex.streams["sim:0"].members) == [0, 1, 2] and not ex.streams["sim:1"].members
    assert model.devices["sim:1"].used_bytes == ex.blocks[3].nbytes  # its slots let go when block 1 left
    assert model.devices["sim:0"].used_bytes == 2 * ex.blocks[0].nbytes + ex.head.nbytes
    from jitllm.server.placement import describe  # GET /v1/placement's answer

    answer = describe(model)
    assert [u["streamed"] for u in answer["units"]] == [True, True, True, False, False]
    sim0 = next(d for d in answer["devices"] if d["name"] == "sim:0")["streaming"]
    assert sim0["blocks"] == [0, 1, 2] and sim0["slots"] == 2 and sim0["uploaded_bytes"] > 0


def test_gpu_grow_grows_streamed_blocks_as_streamed(tiny_four_blocks, cache_dir):
    model = load(tiny_four_blocks, devices=f"sim:0={BUDGET}", placement="*=sim:0~", gpu_grow=True, ctx=128,
                 cache_dir=cache_dir, cpu_kernels="exact")
    assert model.grow_queue[:2] == [(0, "sim:0~"), (1, "sim:0~")]
    assert model.generate_ids(PROMPT, 6) == _load(tiny_four_blocks, cache_dir).generate_ids(PROMPT, 6)
    assert all(u.device.name == "sim:0" and u.stream is not None for u in model.executor.blocks)


def test_a_failing_streaming_device_finishes_on_the_host(tiny_four_blocks, cache_dir):
    resident = _load(tiny_four_blocks, cache_dir).generate_ids(PROMPT, 8)
    model = _load(tiny_four_blocks, cache_dir, f"sim:0={BUDGET}", "*=sim:0~")
    model.devices["sim:0"].backend.faults.launch = True
    assert model.generate_ids(PROMPT, 8) == resident
    assert all(u.device.name == "host" and u.stream is None for u in model.executor.blocks)
    assert model.devices["sim:0"].used_bytes == 0 and not model.executor.streams["sim:0"].slots


def test_a_move_that_cannot_get_slots_is_refused(tiny_four_blocks, cache_dir):
    model = _load(tiny_four_blocks, cache_dir, f"sim:0={BUDGET},sim:1=30000", "*=sim:0~")
    with pytest.raises(JitllmError, match="sim:1 cannot hold"):
        model.move("2", "sim:1~")
    assert model.executor.blocks[2].device.name == "sim:0" and not model.executor.streams.get("sim:1")


def test_budget_smaller_than_the_slots_is_refused(tiny_four_blocks, cache_dir):
    with pytest.raises(JitllmError) as e:
        _load(tiny_four_blocks, cache_dir, "sim:0=40000", "*=sim:0~")
    assert "cannot hold 2 streaming slots of 23.0 KiB" in str(e.value) and "\n" not in str(e.value)


class _Marker:
    def __init__(self) -> None:
        self.recorded = 0


class DeferredQueue:
    """A copy queue whose uploads happen only when a wait asks for their end (reading the staging buffer
    then, as a DMA engine would): kernels that do not wait for their upload get wrong weights. It also
    checks what its synchronous stand-in cannot show: a staging buffer is refilled only after the host
    waited for its last upload, and an upload into a slot comes after the kernels of the slot's last unit."""

    def __init__(self) -> None:
        self.pending: dict[_Marker, tuple] = {}
        self.unconfirmed: dict[int, _Marker] = {}
        """staging buffer address -> the marker of its last upload, until the host waited for it."""
        self.after_seen: dict[_Marker, int] = {}
        self.device_waits_seen = self.uploads = 0

    def staging(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)

    def marker(self) -> _Marker:
        return _Marker()

    def record_kernels(self, marker: _Marker) -> None:
        marker.recorded += 1

    def upload(self, dst, src: np.ndarray, after: _Marker, done: _Marker) -> None:
        assert done not in self.pending
        assert src.ctypes.data not in self.unconfirmed, "staging refilled before its last upload was waited for"
        if after in self.after_seen:
            assert after.recorded > self.after_seen[after], "upload into a slot whose kernels were not marked"
        self.after_seen[after] = after.recorded
        self.unconfirmed[src.ctypes.data] = done
        self.pending[done] = (dst, src)
        self.uploads += 1

    def _run(self, marker: _Marker) -> None:
        if marker in self.pending:
            dst, src = self.pending.pop(marker)
            dst.copyfrom(src)

    def device_waits(self, marker: _Marker) -> None:
        self.device_waits_seen += 1
        self._run(marker)

    def host_waits(self, marker: _Marker) -> None:
        self._run(marker)
        self.unconfirmed = {at: m for at, m in self.unconfirmed.items() if m is not marker}


class _AsyncSim:
    """A simulated device's backend that declares async copies and hands out a DeferredQueue."""

    def __init__(self, inner) -> None:
        self.inner, self.queue = inner, DeferredQueue()
        self.caps = BackendCaps(**{**dataclasses.asdict(inner.caps), "async_copies": True})

    def copy_queue(self) -> DeferredQueue:
        return self.queue

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_async_copy_queue_path_orders_uploads_by_markers(tiny_four_blocks, cache_dir, resident, monkeypatch):
    made = fake.make_device

    def async_sim(choice, cpu_kernels, gpu_kernels):
        device = made(choice, cpu_kernels, gpu_kernels)
        device.backend = _AsyncSim(device.backend)
        return device

    monkeypatch.setattr(fake, "make_device", async_sim)
    model = _load(tiny_four_blocks, cache_dir, f"sim:0={BUDGET}", "*=sim:0~")
    assert all(np.array_equal(a, b) for a, b in zip(_logits(model), resident, strict=True))
    queue = model.devices["sim:0"].backend.queue
    assert queue.uploads == 4 * (STEPS + 1) + 1 and queue.device_waits_seen == 4 * (STEPS + 1)


def test_cli_streams_and_says_so(tiny_four_blocks, cache_dir, monkeypatch):
    """`jitllm run -v` (in this process) prints the slots and a token's uploads, and what streamed; a budget
    smaller than the slots is one line."""
    from click.testing import CliRunner

    from jitllm.cli import main

    monkeypatch.setenv("JITLLM_CACHE_DIR", str(cache_dir))

    def run(*flags):
        args = ["run", "-n", "4", "-temp", "0", str(tiny_four_blocks), "hello", "-placement", "*=sim:0~", *flags]
        return CliRunner().invoke(main, args)

    ok = run("-devices", f"sim:0={BUDGET}", "-v", "-cpu-kernels", "exact")
    assert ok.exit_code == 0, ok.stderr
    assert "2 streaming slots of 23.0 KiB (4 blocks stream: 92.0 KiB uploaded per token)" in ok.stderr
    assert "jitllm: streamed sim:0: 4 streamed blocks through 2 slots" in ok.stderr
    bad = run("-devices", "sim:0=40000")
    assert bad.exit_code == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert bad.stderr.startswith("jitllm: error: placement *=sim:0~: sim:0 cannot hold 2 streaming slots")


class StreamDriver:
    """The CUDA driver calls of backends/cuda_copies.py over host memory: events and streams are numbers,
    an async copy is a memmove done at once, and every call is logged (its ctypes arguments unpacked as
    the real library would take them)."""

    COPY_STREAM = 7

    def __init__(self) -> None:
        self.live: dict[int, np.ndarray] = {}
        self.calls: list[tuple] = []
        self.events = 100

    def cuCtxGetCurrent(self, ctx) -> int:
        ctx._obj.value = 1
        return 0

    def cuMemHostAlloc(self, pointer, size, flags) -> int:
        backing = np.zeros(size.value + 4096, np.uint8)
        pointer._obj.value = address = -(-backing.ctypes.data // 4096) * 4096
        self.live[address] = backing
        return 0

    def cuEventCreate(self, pointer, flags) -> int:
        self.events += 1
        pointer._obj.value = self.events
        return 0

    def cuStreamCreate(self, pointer, flags) -> int:
        pointer._obj.value = self.COPY_STREAM
        return 0

    def cuEventRecord(self, event, stream) -> int:
        self.calls.append(("record", event.value, stream.value))
        return 0

    def cuStreamWaitEvent(self, stream, event, flags) -> int:
        self.calls.append(("wait", stream.value, event.value))
        return 0

    def cuMemcpyHtoDAsync_v2(self, dst, src, nbytes, stream) -> int:
        ctypes.memmove(dst.value, src.value, nbytes.value)
        self.calls.append(("copy", stream.value, nbytes.value))
        return 0

    def cuEventSynchronize(self, event) -> int:
        self.calls.append(("sync", event.value))
        return 0


def test_cuda_copy_queue_drives_a_stream_and_events(tiny_four_blocks, cache_dir, resident, monkeypatch):
    """CudaCopyQueue (what a CUDA device streams with) against a stand-in driver on a simulated device: the
    weights arrive (logits as a resident run's), each copy runs on the copy stream after it waited for the
    slot's kernels event, and the kernels' stream waits for each copy's event."""
    import tvm

    from jitllm.runtime.backends import cuda_driver, pinned
    from jitllm.runtime.backends.cuda_copies import CudaCopyQueue

    driver = StreamDriver()
    monkeypatch.setattr(cuda_driver, "driver", lambda: driver)
    monkeypatch.setattr(pinned, "_pool", None)  # (this test's page-locked memory is the stand-in's)
    made = fake.make_device

    def cuda_like(choice, cpu_kernels, gpu_kernels):
        device = made(choice, cpu_kernels, gpu_kernels)
        device.backend = _AsyncSim(device.backend)
        device.backend.queue = CudaCopyQueue(tvm.cpu(0), "sim:0")
        return device

    monkeypatch.setattr(fake, "make_device", cuda_like)
    model = _load(tiny_four_blocks, cache_dir, f"sim:0={BUDGET}", "*=sim:0~")
    assert all(np.array_equal(a, b) for a, b in zip(_logits(model), resident, strict=True))
    calls = driver.calls
    copies = [i for i, c in enumerate(calls) if c[0] == "copy"]
    assert len(copies) == 4 * (STEPS + 1) + 1 and all(calls[i][1] == StreamDriver.COPY_STREAM for i in copies)
    assert all(calls[i - 1][:2] == ("wait", StreamDriver.COPY_STREAM) for i in copies)
    assert all(calls[i + 1][0] == "record" and calls[i + 1][2] == StreamDriver.COPY_STREAM for i in copies)
    kernel_waits = [c for c in calls if c[0] == "wait" and c[1] != StreamDriver.COPY_STREAM]
    assert len(kernel_waits) == 4 * (STEPS + 1)
    del model
