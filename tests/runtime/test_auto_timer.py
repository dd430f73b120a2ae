"""`-devices auto` by timing: fake devices and timers decide (a GPU slower than the CPU loses), the machine's
timing cache is reused and a corrupt one rewritten, and a real load times the head's decode kernel on the
CPU and a simulated GPU."""

from __future__ import annotations

import json
import math

import pytest

from jitllm.runtime import inventory as inventory_module
from jitllm.runtime.auto_timer import AutoTimer, head_seconds
from jitllm.runtime.device_spec import parse_devices
from jitllm.runtime.inventory import CpuInfo, GpuDevice, Inventory
from jitllm.runtime.timing_cache import read_timings, timing_path

GIB = 1 << 30
CPU = CpuInfo("Fake CPU", [0, 1], [], [], {0: [0, 1]}, [0, 1], 16 * GIB, 8 * GIB, ["avx2"])
IGPU = GpuDevice(-1, "vulkan", 0, "Fake Iris Xe", 16 * GIB, 8 * GIB, unified=True)
CARD = GpuDevice(-1, "cuda", 0, "Fake RTX", 8 * GIB, 7 * GIB, uuid="GPU-1", speed=400.0)
MATERIAL = {"machine": "fake"}


class Measure:
    """Seconds per device name (None: the CPU), counting the calls."""

    def __init__(self, **seconds: float) -> None:
        self.seconds, self.calls = seconds, []

    def __call__(self, device: GpuDevice | None) -> float:
        name = "cpu" if device is None else device.spec_name.replace(":", "")
        self.calls.append(name)
        if self.seconds[name] is None:
            raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image\nmore")
        return self.seconds[name]


def timer(tmp_path, measure: Measure) -> AutoTimer:
    return AutoTimer(measure, MATERIAL, tmp_path / "auto" / "t.json", "head decode kernel (8x4 q4_1)")


def test_an_integrated_gpu_slower_than_the_cpu_loses(tmp_path):
    inventory = Inventory.from_views([IGPU], CPU)
    slow = timer(tmp_path, Measure(cpu=1e-3, vulkan0=3e-3))
    assert parse_devices("auto", inventory, timer=slow) == []  # (the CPU alone)
    assert slow.describe("the CPU") == (
        f"auto: head decode kernel (8x4 q4_1) per call: cpu 1.000 ms, vulkan:0 3.000 ms "
        f"(measured now: cpu, vulkan:0; kept in {tmp_path / 'auto' / 't.json'}) -> the CPU")
    assert parse_devices("auto", inventory) != []  # (without timing, the bandwidth order picks the GPU)
    fast = timer(tmp_path / "b", Measure(cpu=1e-3, vulkan0=2e-4))
    assert [c.name for c in parse_devices("auto", inventory, timer=fast)] == ["vulkan:0"]


def test_the_fastest_of_several_gpus_is_timed_against_the_cpu(tmp_path):
    inventory = Inventory.from_views([IGPU, CARD], CPU)
    measure = Measure(cpu=1e-3, vulkan0=3e-3, cuda0=1e-4)
    assert [c.name for c in parse_devices("auto", inventory, timer=timer(tmp_path, measure))] == ["cuda:0"]
    assert sorted(measure.calls) == ["cpu", "cuda0", "vulkan0"]  # (each device once)
    failing = Measure(cpu=1e-3, vulkan0=3e-3, cuda0=None)
    broken = timer(tmp_path / "b", failing)
    assert parse_devices("auto", inventory, timer=broken) == []
    assert "cuda:0 failed (CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image)" in broken.describe("the CPU")
    assert "cuda:0" not in read_timings(broken.path, MATERIAL)[0]  # (a failure is tried again next run)


def test_one_gpu_named_by_gpu_or_all_is_not_timed(tmp_path):
    inventory = Inventory.from_views([IGPU], CPU)
    measure = Measure(cpu=1e-3, vulkan0=3e-3)
    t = timer(tmp_path, measure)
    assert [c.name for c in parse_devices("gpu", inventory, timer=t)] == ["vulkan:0"]
    assert [c.name for c in parse_devices("all", inventory, timer=t)] == ["vulkan:0"]
    assert measure.calls == []


def test_the_machines_timings_are_reused(tmp_path):
    inventory = Inventory.from_views([IGPU], CPU)
    parse_devices("auto", inventory, timer=timer(tmp_path, Measure(cpu=1e-3, vulkan0=3e-3)))
    again = Measure(cpu=1.0, vulkan0=1.0)
    reused = timer(tmp_path, again)
    assert parse_devices("auto", inventory, timer=reused) == []
    assert again.calls == []
    assert reused.describe("the CPU").endswith(f"(from {reused.path}) -> the CPU")


@pytest.mark.parametrize("body", [b"\x00\xffnot json", b'{"material": {"machine": "fake"}, "seconds": {"cpu": -1}}',
                                  b'{"material": {"machine": "other"}, "seconds": {"cpu": 1}}', b"[1, 2]",
                                  b'{"material": {"machine": "fake"}, "seconds": {"cpu": true}}'])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(tmp_path, body):
    path = tmp_path / "auto" / "t.json"
    path.parent.mkdir()
    path.write_bytes(body)
    measure = Measure(cpu=1e-3, vulkan0=3e-3)
    t = timer(tmp_path, measure)
    assert parse_devices("auto", Inventory.from_views([IGPU], CPU), timer=t) == []
    assert sorted(measure.calls) == ["cpu", "vulkan0"]
    assert "timing again" in t.describe("the CPU")
    assert json.loads(path.read_text()) == {"material": MATERIAL, "seconds": {"cpu": 1e-3, "vulkan:0": 3e-3}}
    assert [p.name for p in path.parent.iterdir()] == ["t.json"]  # (written whole: no temporary left)


def test_the_cache_key_is_the_machine_and_the_kernel(tmp_path):
    one = timing_path({"devices": [["cuda:0", "RTX", "GPU-1"]], "kernel": "8x4"}, tmp_path)
    assert one == timing_path({"kernel": "8x4", "devices": [["cuda:0", "RTX", "GPU-1"]]}, tmp_path)
    assert one != timing_path({"devices": [["cuda:0", "RTX", "GPU-2"]], "kernel": "8x4"}, tmp_path)
    assert one.parent == tmp_path


def test_the_head_decode_kernel_is_timed_on_the_host(tiny_model, cache_dir):
    from jitllm.core.jlm import JlmFile
    from jitllm.runtime.backends.host import host_device
    from jitllm.runtime.model_layout import ModelLayout

    file = JlmFile(tiny_model)
    seconds = head_seconds(host_device("fast"), file, ModelLayout.from_file(file), cache_dir, budget=0.05)
    assert 0 < seconds < 0.1 and math.isfinite(seconds)


def test_a_run_times_the_cpu_against_a_gpu_and_then_reads_the_cache(tiny_model, cache_dir, tmp_path, monkeypatch):
    from jitllm.model import load

    monkeypatch.setenv("JITLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JITLLM_SIM_DEVICES", "1")  # (a simulated GPU: host memory and kernels as the device)
    gpu = GpuDevice(0, "sim", 0, "simulated GPU", 16 * GIB, 8 * GIB, unified=True)
    monkeypatch.setattr(inventory_module, "detect_inventory", lambda **_: Inventory([gpu], inventory_module.detect_cpu()))
    lines: list[str] = []
    load(tiny_model, devices="auto", cache_dir=cache_dir, log=lines.append)
    (line,) = [x for x in lines if x.startswith("auto: ")]
    assert line.startswith("auto: head decode kernel (") and " cpu " in line and " sim:0 " in line
    assert "measured now: cpu, sim:0; kept in" in line
    (kept,) = (tmp_path / "home" / "auto").iterdir()
    assert set(json.loads(kept.read_text())["seconds"]) == {"cpu", "sim:0"}
    lines.clear()
    load(tiny_model, devices="auto", cache_dir=cache_dir, log=lines.append)
    (line,) = [x for x in lines if x.startswith("auto: ")]
    assert f"(from {kept})" in line


def test_a_machine_without_a_gpu_auto_may_pick_times_nothing(tiny_model, tmp_path):
    from jitllm.core.jlm import JlmFile
    from jitllm.runtime.auto_timer import head_timer
    from jitllm.runtime.model_layout import ModelLayout

    software = GpuDevice(-1, "vulkan", 0, "llvmpipe", 16 * GIB, 8 * GIB, unified=True, software=True)
    inventory = Inventory.from_views([software], CPU)
    file = JlmFile(tiny_model)
    t = head_timer(file, ModelLayout.from_file(file), inventory, 2, "fast", "fast", None, None, None, root=tmp_path)
    assert parse_devices("auto", inventory, timer=t) == []
    assert t.describe("the CPU") == ("auto: no GPU here that auto may pick (vulkan:0 llvmpipe: a software adapter), "
                                     "nothing timed -> the CPU")
    assert list(tmp_path.iterdir()) == []


def test_timings_that_cannot_be_kept_are_said_and_the_run_goes_on(tmp_path):
    (tmp_path / "auto").write_text("a file where the folder should be")
    t = timer(tmp_path, Measure(cpu=1e-3, vulkan0=3e-3))
    assert parse_devices("auto", Inventory.from_views([IGPU], CPU), timer=t) == []
    assert f"measured now: cpu, vulkan:0; cannot write {t.path}: " in t.describe("the CPU")
