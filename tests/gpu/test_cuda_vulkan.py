"""One card through two APIs (`-devices cuda:0,vulkan:0`, the H200 here): Vulkan's own UUID of the card is
NVML's, the two views share one budget, and blocks and the head move between them (through the host) with
their KV pages, each step's logits those of the host's exact kernels. Needs CUDA and the card's hardware
Vulkan adapter: skipped where either is missing."""

from __future__ import annotations

import numpy as np
import pytest
from reference import stepwise_logits

from jitllm.model import load
from jitllm.runtime.inventory import detect_inventory
from jitllm.runtime.vulkan_ids import vulkan_cards

from cuda_check import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.vulkan]

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

PROMPT = list(range(4, 30))
MOVES = {2: "0=vulkan:0", 5: "head=vulkan:0", 9: "1=vulkan:0", 12: "0=cuda:0", 16: "*=cuda:0,head=cuda:0"}


@pytest.fixture(scope="module")
def twin() -> str:
    inventory = detect_inventory()
    cuda = next(g for g in inventory.gpus if g.spec_name == "cuda:0")
    also = [v for v in inventory.other_backends if v.index == cuda.index and v.backend == "vulkan"]
    if not also:
        pytest.skip("cuda:0 has no hardware Vulkan view here")
    return also[0].spec_name


def test_vulkan_reads_the_cards_cuda_uuid(twin):
    inventory = detect_inventory()
    cuda = next(g for g in inventory.gpus if g.spec_name == "cuda:0")
    assert cuda.uuid.removeprefix("GPU-").lower() in {c.uuid for c in vulkan_cards()}
    assert next(v for v in inventory.other_backends if v.spec_name == twin).uuid == cuda.uuid


def test_blocks_move_between_the_two_apis_of_one_card(twin, tiny_model, cache_dir):
    host = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact")
    expected = stepwise_logits(host, PROMPT, {}, 20)
    model = load(tiny_model, devices=f"cuda:0,{twin}", placement=f"0=cuda:0,1={twin},head=cuda:0", ctx=128,
                 cache_dir=cache_dir, cpu_kernels="exact", gpu_kernels="exact", no_gpu_fallback=True)
    cuda, vulkan = model.devices["cuda:0"], model.devices[twin]
    assert cuda.twins == [vulkan] and cuda.budget_bytes == vulkan.budget_bytes
    got = stepwise_logits(model, PROMPT, {k: v.replace("vulkan:0", twin) for k, v in MOVES.items()}, 20)
    assert [u.device.name for u in model.executor.blocks] == ["cuda:0", "cuda:0"]
    assert cuda.room() == vulkan.room() == cuda.budget_bytes - sum(u.nbytes for u in model.executor.blocks) \
        - model.executor.head.nbytes
    worst = max(float(np.abs(a - b).max()) for a, b in zip(expected, got))
    assert worst < 1e-4 * max(float(np.abs(a).max()) for a in expected), worst
    assert [int(np.argmax(a)) for a in expected] == [int(np.argmax(b)) for b in got]
