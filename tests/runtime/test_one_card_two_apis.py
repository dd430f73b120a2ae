"""One card named through two APIs (`-devices cuda:0,vulkan:0`): two devices charged to one budget, blocks
moving between the views with their KV pages (a move between the views is charged net: the card holds
both copies only while it runs). The views are simulated devices here (host memory and
kernels, each with its own accounting) behind a fake inventory that folds a CUDA and a Vulkan view of one
card; the H200 runs the real pair (docs/vulkan-metal.md)."""

from __future__ import annotations

import numpy as np
import pytest
from reference import stepwise_logits

from jitllm.core.errors import JitllmError
from jitllm.model import load
from jitllm.runtime import inventory as inv
from jitllm.runtime import loading
from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.inventory import CpuInfo, GpuDevice, Inventory

GIB = 1 << 30
PROMPT = list(range(4, 20))


def _card(backend: str) -> GpuDevice:
    return GpuDevice(-1, backend, 0, "NVIDIA H200", 4 * GIB, 4 * GIB, uuid="GPU-h", speed=4000.0)


@pytest.fixture
def one_card(monkeypatch) -> None:
    fake = Inventory.from_views([_card("cuda"), _card("vulkan")],
                                CpuInfo("Fake CPU", [0], [], [], {0: [0]}, [0], 64 * GIB, 32 * GIB))
    monkeypatch.setattr(inv, "detect_inventory", lambda software=True: fake)
    monkeypatch.setattr(loading, "make_device",
                        lambda choice, cpu, gpu: simulated_device(choice.name, choice.budget_bytes, cpu))


def test_both_views_charge_the_cards_budget_and_blocks_move_between_them(one_card, tiny_model, cache_dir):
    host = load(tiny_model, devices="cpu", ctx=64, cache_dir=cache_dir, cpu_kernels="exact")
    expected = stepwise_logits(host, PROMPT, {}, 8)
    budget = 2 * host.executor.blocks[0].nbytes  # (room for the tiny model's two blocks, not its head)
    model = load(tiny_model, devices=f"cuda:0={budget},vulkan:0", placement="0=cuda:0,1=vulkan:0,*=host,head=host",
                 ctx=64, cache_dir=cache_dir, cpu_kernels="exact")
    cuda, vulkan = model.devices["cuda:0"], model.devices["vulkan:0"]
    assert cuda.twins == [vulkan] and vulkan.twins == [cuda]
    assert cuda.room() == vulkan.room() == 0
    with pytest.raises(JitllmError, match=r"^move head=vulkan:0: vulkan:0 cannot hold"):
        model.move("head", "vulkan:0")
    got = stepwise_logits(model, PROMPT, {2: "0=vulkan:0", 4: "1=cuda:0", 6: "0=host"}, 8)
    assert [u.device.name for u in model.executor.blocks] == ["host", "cuda:0"]
    assert cuda.room() == vulkan.room() == budget // 2
    for a, b in zip(expected, got):
        assert np.array_equal(a, b)
