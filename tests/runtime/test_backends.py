"""Every backend that runs here keeps the Backend protocol's promises (backends/base.py): tensors made,
filled, read, viewed, aliased and copied between devices of one family and across families give the
values back; simulated devices come from the -devices grammar only where they are enabled."""

from __future__ import annotations

import numpy as np
import pytest

from jitllm.core.errors import JitllmError
from jitllm.runtime.backends import make_device
from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.backends.host import host_device
from jitllm.runtime.device_spec import parse_devices
from jitllm.runtime.inventory import CpuInfo, Inventory

MAKERS = {"host": lambda: host_device(), "sim": lambda: simulated_device("sim:0")}


@pytest.fixture(params=sorted(MAKERS))
def device(request):
    return MAKERS[request.param]()


def test_tensors_round_trip(device):
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    tensor = device.upload(values)
    assert np.array_equal(device.download(tensor), values)
    empty = device.empty((2, 3, 4), "float32")
    device.write(empty, values * 2)
    assert np.array_equal(device.download(empty), values * 2)
    assert np.array_equal(device.download(device.last_rows(tensor)), values[:, -1:])


def test_regions_and_aliases_see_the_buffer_at_their_offsets(device):
    buffer = device.upload(np.arange(64, dtype=np.uint8))
    device.write(device.region(buffer, (2, 4), "uint8", 16), np.full((2, 4), 7, np.uint8))
    assert device.download(buffer)[16:24].tolist() == [7] * 8
    first, second = device.aliases(buffer, (((4,), "uint8", 0), ((2, 2), "int16", 32)))
    assert device.download(first).tolist() == [0, 1, 2, 3]
    assert np.array_equal(device.download(second), np.arange(32, 40, dtype=np.uint8).view(np.int16).reshape(2, 2))


def test_copies_between_devices(device):
    other = simulated_device("sim:1")
    src = other.upload(np.linspace(0, 1, 12, dtype=np.float32))
    dst = device.empty((12,), "float32")
    device.copy_from(dst, src, other)
    assert np.array_equal(device.download(dst), other.download(src))
    assert np.array_equal(device.download(device.receive(src, other)), other.download(src))
    assert device.receive(dst, device) is dst


def test_simulated_devices_need_the_switch(monkeypatch):
    inventory = Inventory.from_views([], CpuInfo("cpu", [0], [], [], {0: [0]}, [0], 1 << 34, 1 << 33))
    (choice,) = parse_devices("sim:3=1G", inventory)
    monkeypatch.delenv("JITLLM_SIM_DEVICES", raising=False)
    with pytest.raises(JitllmError, match="sim:3: simulated devices are for testing; set JITLLM_SIM_DEVICES=1"):
        make_device(choice)
    monkeypatch.setenv("JITLLM_SIM_DEVICES", "1")
    sim = make_device(choice, cpu_kernels="fast")
    assert sim.name == "sim:3" and sim.budget_bytes == 1 << 30 and sim.target.kernels == "fast"
    assert sim.graphs is not None  # captured steps, as a GPU's


def test_injected_faults_fail_the_next_allocation_and_launch():
    sim = simulated_device("sim:0")
    sim.backend.faults.alloc = True
    with pytest.raises(RuntimeError, match="injected"):
        sim.empty((4,), "float32")
    assert np.array_equal(sim.download(sim.upload(np.ones(2, np.float32))), [1, 1])  # once only
