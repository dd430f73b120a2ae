"""Hybrid models: GLA blocks carry a recurrent state per session that moves with the block.

On the tiny hybrid random model (blocks llama, gla, llama, gla) with simulated devices standing for
other devices: prefill-then-decode equals one pass, greedy output with moves of the GLA blocks in the
middle equals the run without moves bit for bit, and a move that fails half-way leaves the block
running where it was with its state intact."""

from __future__ import annotations

import numpy as np
import pytest

from jitllm.core.errors import DeviceFault, JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.model import load
from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.model_layout import ModelLayout

N = 20
STATE_BYTES = 4 * 16 * 16 * 4  # heads x head_dim x head_dim float32


def _load(path, cache_dir):
    """(f32 KV: prefill-then-decode is compared with one pass, which an f16 cache's rounded history is not.)"""
    return load(path, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type="f32",
                extra_devices=[simulated_device("sim:0"), simulated_device("sim:1")])


@pytest.fixture(scope="module")
def model(tiny_hybrid_model, cache_dir):
    return _load(tiny_hybrid_model, cache_dir)


@pytest.fixture(scope="module")
def prompt(model):
    return model.tokenizer.encode("The quick brown fox jumps over the lazy dog")


@pytest.fixture(scope="module")
def baseline(model, prompt):
    return model.generate_ids(prompt, N)


def _greedy(ex, session, logits, count):
    tokens = []
    for _ in range(count):
        tokens.append(int(np.argmax(logits)))
        logits = ex.forward(session, [tokens[-1]])
    return tokens


def test_layout_carries_per_block_kinds(tiny_hybrid_model, tiny_model):
    hybrid = ModelLayout.from_file(JlmFile(tiny_hybrid_model))
    assert [k.kind for k in hybrid.block_kinds] == ["llama", "gla", "llama", "gla"]
    assert "blk.1.attn_gate.qs" in hybrid.tensor_names(1)
    plain = ModelLayout.from_file(JlmFile(tiny_model))  # headers without block types: every block is llama
    assert [k.kind for k in plain.block_kinds] == ["llama", "llama"]
    assert "block_types" not in JlmFile(tiny_model).header["config"]


def test_prefill_then_decode_equals_one_pass(model, prompt):
    ex = model.executor
    session = ex.new_session()
    logits = ex.forward(session, prompt[:20])
    for token in prompt[20:]:
        logits = ex.forward(session, [token])
    other = ex.new_session()
    whole = ex.forward(other, prompt)
    ex.close_session(other)
    assert np.abs(logits - whole).max() < 1e-4
    assert sorted(session.states) == [1, 3] and all(s.positions == len(prompt) for s in session.states.values())
    ex.close_session(session)


def test_gla_moves_every_few_tokens_keep_the_output(model, prompt, baseline):
    logs = []
    model.log = logs.append
    model.move_schedule = {2: ["1=sim:0"], 4: ["3=sim:0"], 6: ["1=sim:1,3=host"], 9: ["0-3=sim:1"],
                           12: ["1=host,3=sim:0"], 15: ["*=host"]}
    try:
        assert model.generate_ids(prompt, N) == baseline
    finally:
        model.move_schedule, model.log = {}, None
    assert any("moved block 1 host -> sim:0" in line and "state 4.0 KiB" in line for line in logs)
    assert all(u.device.name == "host" for u in model.executor.blocks)


def test_move_carries_the_state_and_frees_the_source(tiny_hybrid_model, cache_dir, prompt):
    model = _load(tiny_hybrid_model, cache_dir)
    ex, host, sim = model.executor, model.devices["host"], model.devices["sim:0"]
    session = ex.new_session()
    ex.forward(session, prompt)
    before = session.states[1].tensor.numpy()
    host_kv = host.kv_bytes
    (report,) = model.move("1", "sim:0")
    assert report.state_bytes == STATE_BYTES and report.kv_bytes == 0
    state = session.states[1]
    assert state.device is sim and state.tensor.device == sim.backend.tvm_device
    assert np.array_equal(state.tensor.numpy(), before)
    assert host.kv_bytes == host_kv - STATE_BYTES and sim.kv_bytes == STATE_BYTES
    moved = ex.forward(session, [7])
    reference = ex.new_session()
    assert np.array_equal(moved, ex.forward(reference, prompt + [7]))
    ex.close_session(session)
    ex.close_session(reference)
    assert sim.kv_bytes == 0


def test_failure_half_way_leaves_the_block_running_with_its_state(tiny_hybrid_model, cache_dir, prompt, baseline):
    model = _load(tiny_hybrid_model, cache_dir)
    ex, sim = model.executor, model.devices["sim:0"]
    session = ex.new_session()
    logits = ex.forward(session, prompt)
    state, before = session.states[3], session.states[3].tensor.numpy()
    original_reserve = sim.reserve

    def failing_reserve(nbytes, what, kv=False, leaving=0):
        if what.startswith("recurrent state"):
            raise JitllmError("sim:0: allocation of recurrent state failed (injected fault)")
        return original_reserve(nbytes, what, kv, leaving)

    sim.reserve = failing_reserve
    with pytest.raises(JitllmError, match="injected"):
        model.move("2-3", "sim:0")  # block 2 (llama) moves, block 3's state cannot: both stay home
    assert [u.device.name for u in ex.blocks] == ["host"] * 4
    pool = ex.pools["sim:0"]  # block 2's move made sim:0's page pool, which stays for later moves
    assert sim.used_bytes == 0 and sim.kv_bytes == pool.num_pages * pool.page_bytes  # no state left charged
    assert pool.free_pages == pool.num_pages
    assert session.states[3] is state and state.device.name == "host"
    assert np.array_equal(state.tensor.numpy(), before)
    assert _greedy(ex, session, logits, N) == baseline


def test_a_failed_step_is_caught_and_a_reset_recovers(tiny_hybrid_model, cache_dir, prompt):
    model = _load(tiny_hybrid_model, cache_dir)
    ex, sim = model.executor, model.devices["sim:0"]
    model.move("2", "sim:0")
    session = ex.new_session()
    ex.forward(session, prompt[:5])
    sim.backend.faults.launch = True  # block 1 (gla) has folded the tokens in, block 2 fails
    with pytest.raises(DeviceFault):
        ex.forward(session, prompt[5:])
    with pytest.raises(JitllmError, match="recurrent state does not match its 5 positions.*reset the session"):
        ex.forward(session, prompt[5:])
    ex.reset_session(session)
    assert session.states == {} and model.devices["host"].kv_bytes == sum(
        p.num_pages * p.page_bytes for name, p in ex.pools.items() if name == "host")
    assert np.array_equal(ex.forward(session, prompt), ex.forward(ex.new_session(), prompt))
