"""Vulkan and Metal selection against hand-built inventories (no adapter needed): an adapter the webgpu
kernels cannot run on (no shader-f16) is listed but never picked by auto/all/gpu, and naming it is one
clear error; Metal (wgpu's Metal backend, not run here: no Mac) is named `metal` and, as unified memory,
draws its budget from the host's."""

from __future__ import annotations

import pytest

from jitllm.core.errors import JitllmError
from jitllm.runtime import backends
from jitllm.runtime.device_spec import default_budget, host_budget, parse_devices
from jitllm.runtime.inventory import CpuInfo, GpuDevice, Inventory

GIB = 1 << 30
NO_F16 = "the adapter lacks shader-f16, which the webgpu kernels need"


def _inventory(*views: GpuDevice, free: int = 16 * GIB) -> Inventory:
    return Inventory.from_views(list(views), CpuInfo("cpu", [0], [], [], {0: [0]}, [0], 32 * GIB, free))


def _view(backend: str, ordinal: int, name: str, free: int, **kw) -> GpuDevice:
    return GpuDevice(-1, backend, ordinal, name, free, free, **kw)


OLD_CARD = _inventory(_view("vulkan", 0, "Old Radeon", 4 * GIB, unusable=NO_F16, speed=500.0),
                      _view("vulkan", 1, "Intel Arc", 8 * GIB, speed=200.0))
ONLY_OLD = _inventory(_view("vulkan", 0, "Old Radeon", 4 * GIB, unusable=NO_F16))
MAC = _inventory(_view("metal", 0, "Apple M2", 24 * GIB, unified=True), free=24 * GIB)


def test_auto_all_and_gpu_skip_an_adapter_the_kernels_cannot_run_on():
    assert [c.name for c in parse_devices("auto", OLD_CARD)] == ["vulkan:1"]
    assert [c.name for c in parse_devices("all", OLD_CARD)] == ["vulkan:1"]
    assert [c.name for c in parse_devices("gpu", OLD_CARD)] == ["vulkan:1"]
    assert [c.name for c in parse_devices("vulkan", OLD_CARD)] == ["vulkan:1"]
    assert parse_devices("auto", ONLY_OLD) == []  # the CPU alone, not a device that fails at load


@pytest.mark.parametrize("text", ["vulkan:0", "vulkan:radeon", "gpu:0"])
def test_naming_an_adapter_the_kernels_cannot_run_on_is_one_clear_error(text):
    with pytest.raises(JitllmError, match=f"^{text}: vulkan:0 cannot run blocks: {NO_F16}$"):
        parse_devices(text, OLD_CARD)


def test_metal_is_named_metal_and_carved_out_of_the_host():
    (choice,) = parse_devices("metal", MAC)
    assert choice.name == "metal" and choice.device.unified
    assert choice.budget_bytes == default_budget(24 * GIB)
    assert host_budget(MAC, [choice]) == 24 * GIB - choice.budget_bytes
    assert [c.name for c in parse_devices("auto", MAC)] == ["metal"]
    with pytest.raises(JitllmError, match="^metal:0: metal takes no selector$"):
        parse_devices("metal:0", MAC)


def test_vulkan_and_metal_run_through_the_wgpu_backend():
    """The one backend module serves both APIs (Metal: built to the same interface, not run here)."""
    assert backends.BACKENDS["vulkan"] is backends.BACKENDS["metal"] is backends.wgpu
    assert backends.wgpu.CAPS.tensors == "wgpu" and backends.wgpu.UNIFIED_CAPS.unified_memory
