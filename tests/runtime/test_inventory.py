"""Inventory: folding backend views into cards, the CPU from a fake sysfs tree, `jitllm hardware`."""

import json

import pytest
from click.testing import CliRunner
from sysfs_fakes import fake_sysfs

from jitllm.cli import main
from jitllm.commands import hardware as hardware_command
from jitllm.runtime import inventory as inv
from jitllm.runtime.vulkan_ids import DEVICE_TYPES, VulkanCard, vulkan_cards
from jitllm.runtime.inventory import (
    CpuInfo,
    GpuDevice,
    Inventory,
    detect_cpu,
    format_cpu_list,
    parse_cpu_list,
)

GIB = 1 << 30
HOST = CpuInfo("Fake CPU", [0], [1], [], {0: [0, 1]}, [0, 1], 16 * GIB, 8 * GIB, ["avx2"])


def view(backend: str, ordinal: int, name: str = "card", uuid: str | None = None, **kw) -> GpuDevice:
    return GpuDevice(
        -1, backend, ordinal, name, kw.pop("total", 4 * GIB), kw.pop("free", 3 * GIB), uuid, **kw
    )


def test_views_of_one_card_fold_into_one_preferring_cuda_then_metal_then_vulkan():
    views = [
        view("vulkan", 0, uuid="A"),
        view("vulkan", 1, uuid="B"),
        view("cuda", 0, uuid="A"),
        view("vulkan", 2),
        view("metal", 0, uuid="B"),
    ]
    inventory = Inventory.from_views(views, HOST)
    assert [(g.index, g.spec_name) for g in inventory.gpus] == [(0, "cuda:0"), (1, "metal"), (2, "vulkan:2")]
    assert [(v.index, v.spec_name) for v in inventory.other_backends] == [(0, "vulkan:0"), (1, "vulkan:1")]
    assert len(inventory.views()) == 5


def test_views_without_uuid_are_never_merged():
    inventory = Inventory.from_views([view("vulkan", 0, "X"), view("vulkan", 1, "X")], HOST)
    assert len(inventory.gpus) == 2 and not inventory.other_backends


def test_vulkan_adapter_adopts_the_identity_of_its_cuda_card(tmp_path):
    cuda = [(view("cuda", 0, "H200", uuid="GPU-1", pci_bus="0000:19:00.0", speed=4000.0), 0x233510DE)]
    vulkan = [
        (view("vulkan", 0, "NVIDIA H200", total=0, free=0), 0x233510DE),
        (view("vulkan", 1, "Radeon", total=0, free=0), 0x74801002),
        (view("vulkan", 2, "Iris", unified=True), 0x46A68086),
    ]
    card = tmp_path / "card1" / "device"
    card.mkdir(parents=True)
    for name, value in {
        "vendor": "0x1002",
        "device": "0x7480",
        "mem_info_vram_total": str(8 * GIB),
        "mem_info_vram_used": str(GIB),
    }.items():
        (card / name).write_text(value + "\n")
    nvidia, radeon, iris = inv._adopt_identity(vulkan, cuda, drm_root=str(tmp_path), cards=())
    assert (nvidia.uuid, nvidia.pci_bus, nvidia.total_bytes, nvidia.speed) == (
        "GPU-1",
        "0000:19:00.0",
        4 * GIB,
        4000.0,
    )
    assert (radeon.uuid, radeon.total_bytes, radeon.free_bytes) == (None, 8 * GIB, 7 * GIB)
    assert iris == vulkan[2][0]
    folded = Inventory.from_views([cuda[0][0], nvidia, radeon, iris], HOST)
    assert [g.spec_name for g in folded.gpus] == ["cuda:0", "vulkan:1", "vulkan:2"]



def test_vulkan_adapters_pair_with_cuda_by_vulkans_uuid_whatever_the_order():
    """Two identical cards that CUDA numbers in the opposite order to Vulkan (CUDA's fastest-first against
    the PCI order): Vulkan's deviceUUID pairs each adapter with its own card, which the n-th-of-its-PCI-id
    pairing got crossed; a third card CUDA does not see (CUDA_VISIBLE_DEVICES) keeps Vulkan's memory."""
    pci = 0x233510DE
    a, b, c = ("5f7a3c1e-0000-4000-8000-00000000000a", "5f7a3c1e-0000-4000-8000-00000000000b",
               "5f7a3c1e-0000-4000-8000-00000000000c")
    cuda = [(view("cuda", 0, "H200", uuid="GPU-" + b.upper(), pci_bus="0000:2a:00.0"), pci),
            (view("cuda", 1, "H200", uuid="GPU-" + a.upper(), pci_bus="0000:19:00.0"), pci)]
    vulkan = [(view("vulkan", i, "NVIDIA H200", total=0, free=0), pci) for i in range(3)]
    cards = tuple(VulkanCard(pci, "NVIDIA H200", u, "discrete", 141 * GIB, 100 * GIB) for u in (a, b, c))
    first, second, third = inv._adopt_identity(vulkan, cuda, drm_root="/nonexistent", cards=cards)
    assert (first.uuid, first.pci_bus) == ("GPU-" + a.upper(), "0000:19:00.0")
    assert (second.uuid, second.pci_bus) == ("GPU-" + b.upper(), "0000:2a:00.0")
    assert (third.uuid, third.total_bytes, third.free_bytes) == (c, 141 * GIB, 100 * GIB)
    folded = Inventory.from_views([v for v, _ in cuda] + [first, second, third], HOST)
    assert [g.spec_name for g in folded.gpus] == ["cuda:0", "cuda:1", "vulkan:2"]
    assert sorted((v.spec_name, g) for g in range(2) for v in folded.other_backends if v.index == g) == [
        ("vulkan:0", 1), ("vulkan:1", 0)]


@pytest.mark.vulkan
def test_vulkan_properties_read_through_the_loader(setup_failed):
    """The ctypes layouts of vulkan_ids against a real driver (lavapipe in CI): the device Vulkan names is
    the adapter wgpu names, its UUID is 16 bytes that are not all zero, and its device-local memory is a
    plausible size (a misplaced field would read garbage or zeros)."""
    names = [str(a.info.get("device")) for a, backend in inv.wgpu_adapters() if backend == "vulkan"]
    if not names:
        setup_failed("no Vulkan adapter (apt-get install mesa-vulkan-drivers libvulkan1 gives lavapipe)")
    cards = vulkan_cards()
    assert [c.name for c in cards] == names
    for card in cards:
        assert len(bytes.fromhex(card.uuid.replace("-", ""))) == 16 and card.uuid.strip("0-")
        assert card.device_type in DEVICE_TYPES
        assert 64 << 20 <= card.local_bytes <= 1 << 50
        assert card.budget_bytes is None or card.budget_bytes <= card.local_bytes


@pytest.mark.parametrize(
    "spec,expected", [(None, [0, 1, 2]), ("2,0", [2, 0]), ("GPU-b", [1]), ("1,bad,2", [1]), ("", [])]
)
def test_cuda_visible_devices_renumbers_ordinals(monkeypatch, spec, expected):
    if spec is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    assert inv._visible([0, 1, 2], ["GPU-a", "GPU-b", "GPU-c"]) == expected


def test_cpu_hyperthreads_hybrid_cores_numa_and_mask(tmp_path):
    # 2 P-cores with hyperthreads (0/1, 2/3), 4 E-cores (4-7), two NUMA nodes; the mask excludes cpu 7.
    siblings = {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3", 4: "4", 5: "5", 6: "6", 7: "7"}
    fake_sysfs(
        tmp_path,
        siblings,
        {
            "sys/devices/cpu_atom/cpus": "4-7",
            "sys/devices/system/node/node0/cpulist": "0-3",
            "sys/devices/system/node/node1/cpulist": "4-7",
        },
    )
    cpu = detect_cpu(str(tmp_path), mask=[0, 1, 2, 3, 4, 5, 6])
    assert cpu.model == "Fake Core i9"
    assert (cpu.performance_cores, cpu.hyperthread_siblings, cpu.efficiency_cores) == (
        [0, 2],
        [1, 3],
        [4, 5, 6],
    )
    assert cpu.numa_nodes == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert cpu.cpu_mask == [0, 1, 2, 3, 4, 5, 6]
    assert cpu.features == ["avx", "avx2", "fma", "f16c", "avx_vnni"]


def test_arm_little_cores_by_capacity(tmp_path):
    capacity = {
        f"sys/devices/system/cpu/cpu{i}/cpu_capacity": c for i, c in enumerate(["446", "446", "1024", "1024"])
    }
    fake_sysfs(tmp_path, {i: str(i) for i in range(4)}, capacity)
    cpu = detect_cpu(str(tmp_path), mask=[0, 1, 2, 3])
    assert (cpu.performance_cores, cpu.efficiency_cores, cpu.hyperthread_siblings) == ([2, 3], [0, 1], [])


def test_missing_sysfs_counts_every_cpu_as_a_core(tmp_path):
    cpu = detect_cpu(str(tmp_path), mask=[0, 1])
    assert cpu.performance_cores == [0, 1] and cpu.model == "unknown CPU" and cpu.numa_nodes == {}


def test_cpu_lists():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert parse_cpu_list("") == [] and format_cpu_list([]) == ""


def test_this_machine_is_detected_without_error():
    inventory = inv.detect_inventory()
    assert inventory.cpu.cpu_mask and inventory.cpu.performance_cores
    assert all(g.index == i for i, g in enumerate(inventory.gpus))


def test_hardware_command_on_this_machine():
    runner = CliRunner()
    result = runner.invoke(main, ["hardware"])
    assert result.exit_code == 0, result.output
    assert "CPU:" in result.stdout and "process CPU mask" in result.stdout
    result = runner.invoke(main, ["hardware", "-json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"gpus", "cpu", "other_backends"} and data["cpu"]["cpu_mask"]


def test_hardware_command_lists_each_card_once_with_its_other_backends(monkeypatch):
    fake = Inventory.from_views(
        [
            view("cuda", 0, "NVIDIA H200", uuid="GPU-1", speed=4000.0),
            view("vulkan", 0, "NVIDIA H200", uuid="GPU-1"),
        ],
        HOST,
    )
    monkeypatch.setattr(inv, "detect_inventory", lambda: fake)
    text = CliRunner().invoke(main, ["hardware"]).stdout
    assert "gpu:0  cuda:0    NVIDIA H200" in text and "UUID GPU-1" in text and "also vulkan:0" in text
    assert "vulkan:0  " not in text
    assert "performance cores      1 (0)" in text and "hyperthread siblings   1 (1)" in text
    data = json.loads(CliRunner().invoke(main, ["hardware", "--json"]).stdout)
    assert [g["spec_name"] for g in data["gpus"]] == ["cuda:0"]
    assert [g["spec_name"] for g in data["other_backends"]] == ["vulkan:0"]
    assert hardware_command.render(Inventory.from_views([], HOST)).startswith("GPUs: none")


def test_hardware_only_device_lists_skip_wgpu_where_no_gpu_node_exists(monkeypatch, tmp_path):
    """-devices auto takes hardware GPUs only; without a GPU device node wgpu could find software adapters
    alone, so it is not asked (~1.2 s of the start); a list naming an adapter still asks it."""
    from jitllm.runtime.device_spec import hardware_only

    asked = []
    monkeypatch.setattr(inv, "_wgpu_views", lambda cpu: asked.append(1) or [])
    monkeypatch.setattr(inv, "gpu_nodes", lambda: False)
    assert hardware_only("auto") and hardware_only("all") and hardware_only(" gpu=2G") and hardware_only("cpu")
    assert not hardware_only("vulkan:0") and not hardware_only("gpu:1") and not hardware_only("auto,vulkan")
    inv.detect_inventory(software=False)
    assert asked == []
    inv.detect_inventory(software=True)
    assert asked == [1]
    monkeypatch.setattr(inv, "gpu_nodes", lambda: True)
    inv.detect_inventory(software=False)
    assert asked == [1, 1]


def test_gpu_nodes_are_device_files_a_gpu_driver_makes(tmp_path, monkeypatch):
    monkeypatch.setattr(inv.sys, "platform", "linux")
    assert not inv.gpu_nodes(str(tmp_path))
    (tmp_path / "dri").mkdir()
    (tmp_path / "dri" / "card0").touch()  # (a display-only card: no render node)
    assert not inv.gpu_nodes(str(tmp_path))
    (tmp_path / "dri" / "renderD128").touch()
    assert inv.gpu_nodes(str(tmp_path))
    (tmp_path / "dri" / "renderD128").unlink()
    (tmp_path / "nvidia0").touch()
    assert inv.gpu_nodes(str(tmp_path))
