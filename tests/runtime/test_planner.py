"""The planner against described inventories (no hardware, no tensors: block sizes in bytes)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitllm.core.errors import JitllmError
from jitllm.runtime.device_spec import MIB, DeviceChoice, host_budget, parse_devices
from jitllm.runtime.inventory import CpuInfo, GpuDevice, Inventory
from jitllm.runtime.placement import parse_placement
from jitllm.runtime.planner import Decline, plan

GIB = 1 << 30
BLOCKS = [40 * MIB] * 10
HEAD = 100 * MIB


def cpu(free: int = 32 * GIB) -> CpuInfo:
    return CpuInfo("Fake CPU", [0, 1], [], [], {0: [0, 1]}, [0, 1], 64 * GIB, free)


def gpu(backend: str, ordinal: int, name: str, free: int, **kw) -> GpuDevice:
    return GpuDevice(-1, backend, ordinal, name, free, free, **kw)


TWO_UNEQUAL = Inventory.from_views(
    [
        gpu("cuda", 0, "Slow Small", 2 * GIB, uuid="GPU-s", speed=200.0),
        gpu("cuda", 1, "Fast Big", 8 * GIB, uuid="GPU-f", speed=1000.0),
    ],
    cpu(),
)
ONE_CARD_TWO_BACKENDS = Inventory.from_views(
    [
        gpu("cuda", 0, "NVIDIA H200", 4 * GIB, uuid="GPU-h", speed=4000.0),
        gpu("vulkan", 0, "NVIDIA H200", 4 * GIB, uuid="GPU-h", speed=4000.0),
    ],
    cpu(),
)
INTEGRATED = Inventory.from_views(
    [gpu("vulkan", 0, "Intel Iris Xe", 8 * GIB, unified=True)], cpu(free=8 * GIB)
)


def devices(text: str, inventory: Inventory = TWO_UNEQUAL, vram: str | None = None) -> list[DeviceChoice]:
    return parse_devices(text, inventory, vram=vram)


def where(p) -> list[str]:
    return [a.device for a in p.blocks]


def test_two_unequal_gpus_fastest_first_then_host():
    p = plan(BLOCKS, HEAD, devices("all=100M"))
    assert where(p) == ["cuda:1"] * 2 + ["cuda:0"] * 2 + ["host"] * 6
    assert p.seam == 3
    assert p.declines == (
        Decline(2, "cuda:1", "block 2 needs 40.0 MiB, cuda:1 has 20.0 MiB left"),
        Decline(4, "cuda:0", "block 4 needs 40.0 MiB, cuda:0 has 20.0 MiB left"),
        Decline(None, "cuda:0", "head needs 100.0 MiB, cuda:0 has 20.0 MiB left"),
    )
    assert p.head.device == "host" and p.head.reason.startswith("declined by cuda:0")
    assert [(b.name, b.used_bytes, b.left_bytes) for b in p.budgets] == [
        ("cuda:1", 80 * MIB, 20 * MIB),
        ("cuda:0", 80 * MIB, 20 * MIB),
    ]


def test_everything_fits_on_the_first_device_with_the_head():
    p = plan(BLOCKS, HEAD, devices("all"))
    assert where(p) == ["cuda:1"] * 10
    assert p.head.device == "cuda:1" and p.seam == 9 and not p.declines
    assert p.budgets[1].used_bytes == 0


def test_written_order_wins_over_speed():
    p = plan(BLOCKS, HEAD, devices("cuda:0=100M,cuda:1"))
    assert where(p)[:3] == ["cuda:0", "cuda:0", "cuda:1"]


def test_one_card_two_backends_is_budgeted_once():
    chosen = devices("all", ONE_CARD_TWO_BACKENDS)
    assert [c.name for c in chosen] == ["cuda:0"]
    p = plan([1 * GIB] * 6, HEAD, chosen)
    assert where(p) == ["cuda:0"] * 3 + ["host"] * 3  # 3.5 GiB budget: the card is not counted twice
    vulkan = devices("vulkan:0", ONE_CARD_TWO_BACKENDS)
    assert where(plan(BLOCKS, HEAD, vulkan))[0] == "vulkan:0"


def test_integrated_gpu_budget_comes_out_of_the_host():
    chosen = devices("vulkan:iris=1G", INTEGRATED)
    assert host_budget(INTEGRATED, chosen) == 7 * GIB
    p = plan([300 * MIB] * 5, HEAD, chosen)
    assert where(p) == ["vulkan:0"] * 3 + ["host"] * 2
    assert p.head.device == "vulkan:0" and p.budgets[0].left_bytes == 1 * GIB - 1000 * MIB


def test_budgets_too_small_for_one_block_put_everything_on_the_host():
    p = plan(BLOCKS, HEAD, devices("cuda:0=10M,cuda:1=20M"))
    assert where(p) == ["host"] * 10 and p.seam is None
    assert [(d.block, d.wanted) for d in p.declines] == [(0, "cuda:0"), (0, "cuda:1")]
    assert p.head.device == "host"
    assert "seam: none" in p.describe()


def test_no_devices_is_a_cpu_plan():
    p = plan(BLOCKS, HEAD, devices("cpu"))
    assert where(p) == ["host"] * 10 and p.head.device == "host" and not p.declines and not p.budgets


def test_gpu_layers_caps_device_blocks_and_keeps_the_head_home():
    p = plan(BLOCKS, HEAD, devices("cuda:1"), gpu_layers=4)
    assert where(p) == ["cuda:1"] * 4 + ["host"] * 6
    assert p.blocks[4].reason == "-gpu-layers 4" and not p.declines
    assert p.head.device == "host"
    assert plan(BLOCKS, HEAD, devices("cuda:1"), gpu_layers=11).head.device == "cuda:1"
    assert where(plan(BLOCKS, HEAD, devices("cuda:1"), gpu_layers=0)) == ["host"] * 10
    with pytest.raises(JitllmError, match="-gpu-layers -1"):
        plan(BLOCKS, HEAD, devices("cuda:1"), gpu_layers=-1)


def test_map_overrides_the_engine():
    p = plan(BLOCKS, HEAD, devices("cuda:0,cuda:1"), parse_placement("0=host,1-3=cuda:1,4=host!,head=cuda:0"))
    assert where(p) == ["host", "cuda:1", "cuda:1", "cuda:1", "host"] + ["cuda:0"] * 5
    assert p.blocks[4].pinned and p.blocks[1].reason == "placement 1-3=cuda:1"
    assert p.head.device == "cuda:0" and p.head.reason == "placement head=cuda:0"


def test_seam_is_where_the_engine_ran_out_not_a_mapped_block():
    p = plan(BLOCKS, HEAD, devices("cuda:1=130M"), parse_placement("9=cuda:1!"))
    assert where(p) == ["cuda:1"] * 2 + ["host"] * 7 + ["cuda:1"]
    assert p.seam == 1 and p.blocks_on("cuda:1") == [0, 1, 9] and p.device_of(9) == "cuda:1"
    assert "seam: after block 1 (7 later blocks on the host)" in p.describe()


def test_map_conflicting_with_budget_is_best_effort():
    chosen = devices("cuda:0=100M,cuda:1=1G")
    p = plan(BLOCKS, HEAD, chosen, parse_placement("0-3=cuda:0"))
    assert where(p)[:4] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert Decline(2, "cuda:0", "block 2 needs 40.0 MiB, cuda:0 has 20.0 MiB left") in p.declines
    assert p.blocks[2].reason == "engine (the map's target declined)"
    assert "block 2 declined by cuda:0: block 2 needs 40.0 MiB" in p.describe()


def test_strict_map_is_all_or_nothing():
    chosen = devices("cuda:0=100M,cuda:1=1G")
    with pytest.raises(
        JitllmError,
        match=r"^placement 3=cuda:0 cannot be honoured: block 3 needs 40.0 MiB, "
        r"cuda:0 has 20.0 MiB left$",
    ):
        plan(BLOCKS, HEAD, chosen, parse_placement("1-2=cuda:0,3=cuda:0"), strict=True)
    with pytest.raises(JitllmError, match=r"^placement head=cuda:0 cannot be honoured: head needs 100.0 MiB"):
        plan(BLOCKS, HEAD, chosen, parse_placement("head=cuda:0"), strict=True)
    ok = plan(BLOCKS, HEAD, chosen, parse_placement("0-1=cuda:0"), strict=True)
    assert where(ok)[:2] == ["cuda:0", "cuda:0"]


def test_map_errors_against_the_model_and_devices():
    with pytest.raises(JitllmError, match=r"^placement 3=cuda:5: cuda:5 is not in -devices$"):
        plan(BLOCKS, HEAD, devices("cuda:0"), parse_placement("3=cuda:5"))
    with pytest.raises(JitllmError, match=r"block 12 is past the model's last block 9$"):
        plan(BLOCKS, HEAD, devices("cuda:0"), parse_placement("12=host"))


def test_map_targets_may_use_any_name_of_a_device():
    p = plan(BLOCKS, HEAD, devices("gpu:1"), parse_placement("0=gpu:1,1=cuda:1,2=GPU:1"))
    assert where(p)[:3] == ["cuda:1"] * 3


def test_streamed_blocks_take_two_slots_of_budget():
    sizes = [40 * MIB, 60 * MIB, 50 * MIB, 60 * MIB]
    p = plan(sizes, HEAD, devices("cuda:0=130M"), parse_placement("*=cuda:0~"))
    assert where(p) == ["cuda:0"] * 4 and all(a.streamed for a in p.blocks)
    assert [a.bytes for a in p.blocks] == sizes
    (budget,) = p.budgets
    assert (budget.used_bytes, budget.slot_bytes) == (120 * MIB, 60 * MIB)
    assert (budget.streamed, budget.upload_bytes_per_token) == (4, 210 * MIB)
    assert p.head.device == "host"  # the head needs 100 MiB, 10 MiB are left
    assert "streamed" in p.describe()
    assert "2 streaming slots of 60.0 MiB (4 blocks stream: 210.0 MiB uploaded per token)" in p.describe()


def test_blocks_that_fit_the_slots_upload_nothing_per_token():
    p = plan([40 * MIB, 60 * MIB, 50 * MIB], 0, devices("cuda:0=200M"), parse_placement("1-2=cuda:0~"))
    (budget,) = p.budgets
    assert (budget.streamed, budget.used_bytes, budget.upload_bytes_per_token) == (2, 160 * MIB, 0)
    assert p.blocks[0].device == "cuda:0" and not p.blocks[0].streamed  # the engine's, beside the slots


@pytest.mark.parametrize("strict", [False, True])
def test_budget_smaller_than_the_slots_is_refused(strict):
    with pytest.raises(JitllmError) as e:
        plan([40 * MIB, 90 * MIB], 0, devices("cuda:0=100M"), parse_placement("*=cuda:0~"), strict=strict)
    assert str(e.value) == ("placement *=cuda:0~: cuda:0 cannot hold 2 streaming slots of 90.0 MiB (the largest "
                            "block streamed there): they need 180.0 MiB, it has 100.0 MiB left")


def test_pinned_entries_claim_budget_first():
    p = plan(BLOCKS, HEAD, devices("cuda:0=100M,cuda:1"), parse_placement("0-1=cuda:0,9=cuda:0!"))
    assert p.blocks[9].device == "cuda:0" and p.blocks[9].pinned
    assert p.blocks[0].device == "cuda:0" and not p.blocks[0].pinned
    assert p.blocks[1].device == "cuda:1" and p.declines[0].block == 1


def test_describe_shows_blocks_seam_declines_and_budgets():
    text = plan(BLOCKS, HEAD, devices("cuda:1=150M"), parse_placement("0=cuda:1!")).describe()
    assert "0         cuda:1     40.0 MiB         pinned" in text
    assert "1-2       cuda:1     40.0 MiB each" in text
    assert "seam: after block 2 (7 later blocks on the host)" in text
    assert "block 3 declined by cuda:1: block 3 needs 40.0 MiB, cuda:1 has 30.0 MiB left" in text
    assert "cuda:1: used 120.0 MiB of 150.0 MiB, 30.0 MiB left" in text
    assert text.splitlines()[-1].startswith("host: holds")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=1, max_size=12),
    st.integers(0, 300),
    st.lists(st.integers(0, 600), min_size=0, max_size=3),
    st.none() | st.integers(0, 14),
    st.sampled_from([None, "*=gpu:0~", "0-1=gpu:1!", "head=gpu:0,2=host", "*=host"]),
)
def test_budgets_are_never_exceeded_and_every_block_is_placed(sizes, head, budgets, gpu_layers, mapping):
    inventory = Inventory.from_views(
        [gpu("cuda", i, f"card {i}", GIB, uuid=f"u{i}") for i in range(3)], cpu()
    )
    text = ",".join(f"gpu:{i}={b * MIB}" for i, b in enumerate(budgets)) or "cpu"
    chosen = parse_devices(text, inventory)
    placement = parse_placement(mapping) if mapping else None
    names = {a for c in chosen for a in c.aliases}
    if placement is not None and any(e.target not in names | {"host"} for e in placement.entries):
        with pytest.raises(JitllmError):
            plan([s * MIB for s in sizes], head * MIB, chosen, placement, gpu_layers)
        return
    try:
        p = plan([s * MIB for s in sizes], head * MIB, chosen, placement, gpu_layers)
    except JitllmError as e:  # only a map past the model's end, or streaming slots a budget cannot hold
        assert "past the model's last block" in str(e) or "streaming slots" in str(e)
        if "streaming slots" in str(e):
            assert 2 * max(sizes) * MIB > budgets[0] * MIB
        return
    assert len(p.blocks) == len(sizes)
    assert all(b.used_bytes <= b.budget_bytes for b in p.budgets)
    engine = [i for i, a in enumerate(p.blocks) if a.device != "host" and a.reason.startswith("engine")]
    assert p.seam == max(engine, default=None)
    if placement is None:
        assert p.seam == max((i for i, a in enumerate(p.blocks) if a.device != "host"), default=None)
    if gpu_layers is not None and placement is None:
        assert sum(a.device != "host" for a in p.blocks) <= gpu_layers


def test_one_card_through_two_apis_charges_one_budget():
    """cuda:0 and vulkan:0 of one card share its 200 MiB: the engine fills the first view, a map's blocks on
    the second are charged to the same budget, and past it they are declined."""
    chosen = parse_devices("cuda:0=200M,vulkan:0", ONE_CARD_TWO_BACKENDS)
    p = plan(BLOCKS, HEAD, chosen, parse_placement("0-1=vulkan:0"))
    assert where(p)[:5] == ["vulkan:0", "vulkan:0", "cuda:0", "cuda:0", "cuda:0"]
    assert where(p)[5:] == ["host"] * 5
    assert sum(b.used_bytes for b in p.budgets) == 200 * MIB
    assert all(b.left_bytes == 0 and b.card_used_bytes == 200 * MIB for b in p.budgets)
    assert "vulkan:0: used 80.0 MiB of 200.0 MiB (one card's, 200.0 MiB used by all its views), 0 B left" in p.describe()
    p = plan(BLOCKS, HEAD, chosen, parse_placement("0-5=vulkan:0"))
    assert where(p)[:5] == ["vulkan:0"] * 5 and p.blocks_on("cuda:0") == []
    assert Decline(5, "vulkan:0", "block 5 needs 40.0 MiB, vulkan:0 has 0 B left") in p.declines
