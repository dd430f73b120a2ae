"""The -devices grammar and budgets, against hand-built inventories."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitllm.core.errors import JitllmError
from jitllm.runtime.device_spec import (
    MIB,
    default_budget,
    format_bytes,
    host_budget,
    parse_devices,
    parse_size,
)
from jitllm.runtime.inventory import CpuInfo, GpuDevice, Inventory

GIB = 1 << 30


def cpu(free: int = 32 * GIB) -> CpuInfo:
    return CpuInfo("Fake CPU", [0, 1], [], [], {0: [0, 1]}, [0, 1], 64 * GIB, free)


def gpu(backend: str, ordinal: int, name: str, free: int, **kw) -> GpuDevice:
    return GpuDevice(-1, backend, ordinal, name, kw.pop("total", free), free, **kw)


CPU_ONLY = Inventory.from_views([], cpu())
TWO = Inventory.from_views(
    [
        gpu("cuda", 0, "Small Card", 8 * GIB, uuid="GPU-a", speed=300.0),
        gpu("cuda", 1, "Big Card", 24 * GIB, uuid="GPU-b", speed=900.0),
    ],
    cpu(),
)
ONE_CARD_TWO_BACKENDS = Inventory.from_views(
    [
        gpu("vulkan", 0, "NVIDIA H200", 100 * GIB, uuid="GPU-h"),
        gpu("cuda", 0, "NVIDIA H200", 100 * GIB, uuid="GPU-h", speed=4000.0),
    ],
    cpu(),
)
LAPTOP = Inventory.from_views(
    [
        gpu("vulkan", 0, "Intel(R) Iris(R) Xe Graphics", 16 * GIB, unified=True),
        gpu("vulkan", 1, "AMD Radeon RX 7600", 8 * GIB, pci_bus="0000:03:00.0"),
        gpu("vulkan", 2, "llvmpipe (LLVM 15)", 16 * GIB, unified=True, software=True),
    ],
    cpu(free=16 * GIB),
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("3G", 3 * GIB),
        ("3GiB", 3 * GIB),
        ("3gb", 3 * GIB),
        ("512M", 512 * MIB),
        ("800000000", 800000000),
        ("1.5G", 3 * GIB // 2),
        ("2T", 2 << 40),
        ("64k", 65536),
        ("10B", 10),
        (" 1 G ", GIB),
        (".5M", MIB // 2),
    ],
)
def test_sizes_are_binary(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["3Q", "", "G", "-1G", "1.2.3", "3GG", "1e9"])
def test_bad_sizes(text):
    with pytest.raises(JitllmError, match="bad size"):
        parse_size(text)


def test_format_bytes():
    assert format_bytes(40 * MIB) == "40.0 MiB"
    assert format_bytes(3 * GIB // 2) == "1.5 GiB"
    assert format_bytes(512) == "512 B"


def test_default_budget_keeps_an_eighth_at_least_256_mib():
    assert default_budget(8 * GIB) == 7 * GIB
    assert default_budget(1 * GIB) == 768 * MIB
    assert default_budget(100 * MIB) == 0


def test_cpu_machine_auto_all_and_cpu_mean_no_device():
    for text in ("auto", "all", "cpu"):
        assert parse_devices(text, CPU_ONLY) == []


def test_gpu_without_gpu_is_an_error():
    with pytest.raises(JitllmError, match="^gpu: no GPU on this machine"):
        parse_devices("gpu", CPU_ONLY)


def test_auto_picks_the_fastest_and_all_lists_fastest_first():
    assert [c.name for c in parse_devices("auto", TWO)] == ["cuda:1"]
    assert [c.name for c in parse_devices("all", TWO)] == ["cuda:1", "cuda:0"]
    assert [c.name for c in parse_devices("gpu", TWO)] == ["cuda:1"]


def test_timer_hook_overrides_the_speed_estimate():
    times = {"Small Card": 0.001, "Big Card": 0.002, "CPU": 0.01}  # (the timer's None: the CPU)
    chosen = parse_devices("auto", TWO, timer=lambda d: times["CPU" if d is None else d.name])
    assert [c.name for c in chosen] == ["cuda:0"]


def test_list_keeps_written_order_and_cpu_adds_nothing():
    chosen = parse_devices("cuda:0, cpu ,gpu:1", TWO)
    assert [c.name for c in chosen] == ["cuda:0", "cuda:1"]
    assert "gpu:1" in chosen[1].aliases and "gpu:0" in chosen[0].aliases


def test_default_and_explicit_budgets():
    small, big = parse_devices("cuda:0,cuda:1=3G", TWO)
    assert (small.budget_bytes, small.explicit_budget) == (7 * GIB, False)
    assert (big.budget_bytes, big.explicit_budget) == (3 * GIB, True)


def test_vram_budgets_every_device_and_an_entry_wins():
    chosen = parse_devices("cuda:0,cuda:1=1.5G", TWO, vram="2G")
    assert [c.budget_bytes for c in chosen] == [2 * GIB, 3 * GIB // 2]
    assert all(c.explicit_budget for c in chosen)
    with pytest.raises(JitllmError, match=r"^-vram 2X: bad size '2X'$"):
        parse_devices("auto", TWO, vram="2X")


def test_bad_budget_names_the_entry():
    with pytest.raises(JitllmError, match=r"^cuda:0=3Q: bad size '3Q'$"):
        parse_devices("cuda:0=3Q", TWO)


def test_one_card_through_two_backends_counts_once():
    assert len(ONE_CARD_TWO_BACKENDS.gpus) == 1
    assert [c.name for c in parse_devices("all", ONE_CARD_TWO_BACKENDS)] == ["cuda:0"]
    assert [c.name for c in parse_devices("auto", ONE_CARD_TWO_BACKENDS)] == ["cuda:0"]


def test_naming_vulkan_explicitly_selects_the_vulkan_view():
    for text in ("vulkan:0", "vulkan:h200", "vulkan:NVIDIA", "vulkan"):
        (choice,) = parse_devices(text, ONE_CARD_TWO_BACKENDS)
        assert choice.name == "vulkan:0" and choice.device.backend == "vulkan"
        assert choice.device.index == 0


def test_one_card_through_both_apis_shares_one_budget():
    """`cuda:0,vulkan:0` (each entry naming its API) is one card through two APIs: two devices, one budget
    (the card's, given once), `gpu:0` naming the first view only."""
    first, second = parse_devices("cuda:0,vulkan:0", ONE_CARD_TWO_BACKENDS)
    assert (first.name, second.name) == ("cuda:0", "vulkan:0")
    assert (first.shares_budget_of, second.shares_budget_of) == (None, "cuda:0")
    assert first.budget_bytes == second.budget_bytes == 100 * GIB - 100 * GIB // 8
    assert "gpu:0" in first.aliases and "gpu:0" not in second.aliases
    for text in ("cuda:0,vulkan:0=40G", "cuda:0=40G,vulkan:h200"):
        assert [c.budget_bytes for c in parse_devices(text, ONE_CARD_TWO_BACKENDS)] == [40 * GIB] * 2
    with pytest.raises(JitllmError, match=r"^cuda:0 and vulkan:0 are one card with one budget: give =SIZE on one of them$"):
        parse_devices("cuda:0=40G,vulkan:0=20G", ONE_CARD_TWO_BACKENDS)


def test_one_card_twice_through_one_api_or_gpu_n_is_a_duplicate():
    with pytest.raises(JitllmError, match=r"^gpu:0: cuda:0 is already in -devices$"):
        parse_devices("cuda:0,gpu:0", TWO)
    with pytest.raises(
        JitllmError, match=r"^gpu:0: vulkan:0 is already in -devices \(cuda:0 and vulkan:0 are one card\)$"
    ):
        parse_devices("vulkan:0,gpu:0", ONE_CARD_TWO_BACKENDS)
    with pytest.raises(JitllmError, match=r"^vulkan:0: vulkan:0 is already in -devices$"):
        parse_devices("cuda:0,vulkan:0,vulkan:0", ONE_CARD_TWO_BACKENDS)


def test_vulkan_selector_errors():
    with pytest.raises(JitllmError, match=r"^vulkan:nvidia: no Vulkan adapter matches 'nvidia'$"):
        parse_devices("vulkan:nvidia", LAPTOP)
    with pytest.raises(JitllmError, match=r"^vulkan:e: 'e' matches 3 Vulkan adapters"):
        parse_devices("vulkan:e", LAPTOP)
    with pytest.raises(JitllmError, match=r"^vulkan:7: no Vulkan adapter 7 \(found 3\)$"):
        parse_devices("vulkan:7", LAPTOP)


def test_software_adapters_only_when_named():
    assert [c.name for c in parse_devices("all", LAPTOP)] == ["vulkan:1", "vulkan:0"]
    assert parse_devices("vulkan:llvmpipe", LAPTOP)[0].device.software
    (choice,) = parse_devices("vulkan:radeon=4G", LAPTOP)
    assert choice.aliases == {"vulkan:1", "gpu:1", "vulkan:radeon"}


def test_unified_memory_is_carved_out_of_the_host():
    chosen = parse_devices("vulkan:iris", LAPTOP)
    assert chosen[0].budget_bytes == default_budget(16 * GIB)
    assert host_budget(LAPTOP, chosen) == 16 * GIB - chosen[0].budget_bytes
    discrete = parse_devices("vulkan:1", LAPTOP)
    assert host_budget(LAPTOP, discrete) == 16 * GIB


def test_a_second_unified_device_gets_only_what_the_first_left():
    first, second = parse_devices("vulkan:0=12G,vulkan:2", LAPTOP)
    assert second.budget_bytes == default_budget(4 * GIB)
    assert host_budget(LAPTOP, [first, second]) == 4 * GIB - second.budget_bytes


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "-devices is empty"),
        ("cuda:0,,cuda:1", "empty entry"),
        ("auto,cuda:0", "^auto,cuda:0|auto: auto must be the only"),
        ("cpu=2G", "^cpu=2G: the CPU takes no budget$"),
        ("tpu:0", "^tpu:0: unknown device 'tpu:0'"),
        ("gpu:x", "^gpu:x: bad index 'x'$"),
        ("gpu:5", r"^gpu:5: no such GPU \(jitllm hardware lists 2\)$"),
        ("cuda:9", r"^cuda:9: no CUDA device 9 \(found 2\)$"),
        ("cuda:big", "^cuda:big: bad ordinal 'big'$"),
        ("metal", "^metal: no Metal device on this machine$"),
    ],
)
def test_entry_errors(text, message):
    with pytest.raises(JitllmError, match=message):
        parse_devices(text, TWO)


@settings(max_examples=300, deadline=None)
@given(
    st.text(),
    st.sampled_from([CPU_ONLY, TWO, ONE_CARD_TWO_BACKENDS, LAPTOP]),
    st.none() | st.text(max_size=8),
)
def test_any_text_parses_or_raises_jitllm_error(text, inventory, vram):
    try:
        chosen = parse_devices(text, inventory, vram=vram)
    except JitllmError as e:
        assert len(str(e).splitlines()) == 1
    else:
        assert len({c.device.index for c in chosen}) == len(chosen)
        assert all(c.budget_bytes >= 0 for c in chosen)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "auto",
                "all",
                "cpu",
                "gpu",
                "gpu:0",
                "gpu:1",
                "cuda",
                "cuda:0",
                "cuda:1",
                "vulkan",
                "vulkan:0",
                "vulkan:1",
                "vulkan:radeon",
                "metal",
            ]
        ),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.sampled_from(["", "=1G", "=512M", "=3Q", "=1.5GiB"]), min_size=4, max_size=4),
    st.sampled_from([CPU_ONLY, TWO, ONE_CARD_TWO_BACKENDS, LAPTOP]),
)
def test_grammar_shaped_text_parses_or_raises_jitllm_error(specs, sizes, inventory):
    text = ",".join(s + z for s, z in zip(specs, sizes))
    try:
        parse_devices(text, inventory)
    except JitllmError as e:
        assert len(str(e).splitlines()) == 1


def test_simulated_devices_are_named_with_a_budget_and_no_gpu_alias():
    two = parse_devices("sim:0=64M,sim:1", CPU_ONLY)
    assert [c.name for c in two] == ["sim:0", "sim:1"] and two[0].budget_bytes == 64 * MIB
    assert two[0].aliases == {"sim:0"} and two[1].budget_bytes == default_budget(32 * GIB - 64 * MIB)
    assert [c.name for c in parse_devices("auto", CPU_ONLY)] == []  # never picked unless named
    with pytest.raises(JitllmError, match="sim:x: bad index 'x'"):
        parse_devices("sim:x", CPU_ONLY)
