"""ONNX Runtime as the second lowering: `-devices ort` runs the block graphs themselves, with KV in the
same page-table form as the TVM devices, so blocks (and the head) move between an ONNX Runtime device and
the host, pages and recurrent state and all, and every step's logits stay those of the host alone."""

from __future__ import annotations

import numpy as np
import pytest
from reference import stepwise_logits

from jitllm.core.errors import JitllmError
from jitllm.model import load
from jitllm.runtime.backends import make_device
from jitllm.runtime.device_spec import parse_devices
from jitllm.runtime.inventory import CpuInfo, GpuDevice, Inventory

PROMPT = list(range(4, 30))
MOVES = {2: "0=ort", 5: "head=ort", 9: "*=ort", 14: "0=host", 19: "*=host,head=host", 23: "*=ort,head=ort"}


def _inventory(cuda: bool = False) -> Inventory:
    views = [GpuDevice(-1, "cuda", 0, "Card", 8 << 30, 8 << 30, uuid="GPU-a")] if cuda else []
    return Inventory.from_views(views, CpuInfo("cpu", [0], [], [], {0: [0]}, [0], 16 << 30, 8 << 30))


def test_the_grammar_names_onnx_runtime_devices():
    (cpu,) = parse_devices("ort", _inventory())
    assert cpu.name == "ort" and cpu.aliases == {"ort"} and cpu.device.unified
    assert parse_devices("ort:cpu=1G", _inventory())[0].budget_bytes == 1 << 30
    (gpu,) = parse_devices("ort:cuda", _inventory(cuda=True))
    assert gpu.name == "ort:cuda:0" and "ort:cuda" in gpu.aliases
    with pytest.raises(JitllmError, match="ort:cuda: no CUDA device 0"):
        parse_devices("ort:cuda", _inventory())
    with pytest.raises(JitllmError, match="unknown ONNX Runtime device 'tpu'"):
        parse_devices("ort:tpu", _inventory())


def test_a_missing_execution_provider_is_one_clear_line():
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this ONNX Runtime has the CUDA provider")
    (choice,) = parse_devices("ort:cuda", _inventory(cuda=True))
    with pytest.raises(JitllmError, match="ort:cuda:0: this ONNX Runtime has no CUDAExecutionProvider"):
        make_device(choice)


def _stepwise(model, moves: dict[int, str], steps: int) -> list[np.ndarray]:
    return stepwise_logits(model, PROMPT, moves, steps)


@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_hybrid_model"])
def test_blocks_move_between_onnx_runtime_and_the_host_with_their_state(model_name, request, cache_dir):
    path = request.getfixturevalue(model_name)
    host = load(path, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact")
    moving = load(path, devices="ort", placement="*=host,head=host", ctx=128, cache_dir=cache_dir,
                  cpu_kernels="exact")
    assert moving.devices["ort"].backend.caps.tensors == "numpy"
    expected, got = _stepwise(host, {}, 28), _stepwise(moving, MOVES, 28)
    assert [u.device.name for u in moving.executor.blocks] == ["ort"] * len(moving.executor.blocks)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(expected, got))
    assert worst < 2e-4 * max(float(np.abs(a).max()) for a in expected)
    assert [int(np.argmax(a)) for a in expected] == [int(np.argmax(b)) for b in got]


def test_a_prompts_logits_from_onnx_runtime_are_the_last_positions_row(tiny_model, cache_dir):
    """ONNX Runtime's outputs are host arrays already: a prompt's logits are still the last position's row
    (a sampled first token read the whole [1, 1, vocab] block before, and failed)."""
    ort = load(tiny_model, devices="ort", placement="*=ort,head=ort", ctx=128, cache_dir=cache_dir, kv_type="f32")
    host = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type="f32")
    prompt = list(range(4, 20))
    got = ort.executor.forward(ort.executor.new_session(), prompt)
    want = host.executor.forward(host.executor.new_session(), prompt)
    assert got.shape == want.shape == (host.layout.config.vocab,)
    assert np.allclose(got, want, atol=1e-3)
