"""A device failing mid-generation: only its blocks' KV (or recurrent state) is computed again, from each
session's history, on the host (runtime/engine/rebuild.py). The other blocks' pages stay as they were, the
tokens are those of a run without the fault, and the log names the device, the blocks and the positions."""

from __future__ import annotations

import numpy as np
import pytest
from kv_contents import kv_of

from jitllm.core.errors import DeviceFault
from jitllm.model import load
from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.sampling import SamplingParams

PROMPT = list(range(4, 30))
N = 16
FAULT_AT = 5
"""Tokens yielded before the device fails."""


def _load(path, cache_dir, graphs=False):
    return load(path, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact",
                extra_devices=[simulated_device("sim:0", graphs=graphs), simulated_device("sim:1", graphs=graphs)])


def _recorded(model) -> list:
    """Model.fall_back_to_host, its reports kept."""
    reports, fall_back = [], model.fall_back_to_host

    def recording(failed=None):
        reports.append(fall_back(failed))
        return reports[-1]

    model.fall_back_to_host = recording
    return reports


def _run_with_fault(model, failing: str, kept: list[int]):
    """Generate, failing `failing` after FAULT_AT tokens; the kept blocks' KV of the history at the fault
    before and after, and the history length then."""
    session, logs = model.new_session(), []
    model.log = logs.append
    tokens, before, length = [], {}, 0
    for i, token in enumerate(model.generate_tokens(PROMPT, N, SamplingParams(0.0), session)):
        tokens.append(token)
        if i == FAULT_AT - 1:
            length = session.length
            before = {b: kv_of(session, b, length) for b in kept}
            model.devices[failing].backend.faults.launch = True
    after = {b: kv_of(session, b, length) for b in kept}
    return tokens, before, after, length, logs


@pytest.mark.parametrize("graphs", [False, True], ids=["plain-steps", "captured-steps"])
def test_only_the_lost_blocks_kv_is_computed_again(tiny_four_blocks, cache_dir, graphs):
    """Block 1 of four on sim:0, which fails: block 1's KV comes back from the history through block 0
    (whose pages are only read); blocks 2, 3 and the head do not run; every kept block's pages are as
    they were."""
    baseline = _load(tiny_four_blocks, cache_dir).generate_ids(PROMPT, N)
    model = _load(tiny_four_blocks, cache_dir, graphs)
    model.move("1", "sim:0")
    reports = _recorded(model)
    tokens, before, after, length, logs = _run_with_fault(model, "sim:0", kept=[0, 2, 3])
    assert tokens == baseline
    assert length == len(PROMPT) + FAULT_AT - 1
    [report] = reports
    assert report.recomputed == {1: length} and report.block_positions == length and report.passed == (0,)
    assert report.devices == ("sim:0",) and report.units == (1,)
    for block in before:
        assert np.array_equal(before[block], after[block]), f"block {block}'s KV changed"
    assert [u.device.name for u in model.executor.blocks] == ["host"] * 4
    [line] = [x for x in logs if x.startswith("warning: sim:0: ")]
    assert (f"recomputed only block 1 for 1 session ({length} positions, {length} block-positions)" in line
            and "block 0 ran over them without writing their KV" in line and "finishing on the CPU" in line)


def test_a_fault_leaves_the_other_devices_blocks_and_kv_where_they_are(tiny_four_blocks, cache_dir):
    """Blocks 1 on sim:0 and 2 on sim:1; sim:1 fails: only block 2 is computed again (through blocks 0 and
    1, hidden states crossing sim:0 -> host), block 1 stays on sim:0 with its pages untouched."""
    baseline = _load(tiny_four_blocks, cache_dir).generate_ids(PROMPT, N)
    model = _load(tiny_four_blocks, cache_dir)
    model.move("1", "sim:0")
    model.move("2", "sim:1")
    reports = _recorded(model)
    tokens, before, after, length, _ = _run_with_fault(model, "sim:1", kept=[0, 1, 3])
    assert tokens == baseline
    [report] = reports
    assert report.recomputed == {2: length} and report.passed == (0, 1)
    for block in before:
        assert np.array_equal(before[block], after[block]), f"block {block}'s KV changed"
    assert [u.device.name for u in model.executor.blocks] == ["host", "sim:0", "host", "host"]


def test_recurrent_state_is_rebuilt_from_position_0(tiny_hybrid_model, cache_dir):
    """Blocks llama, gla, llama, gla with block 2 on sim:0. Session B holds a history; session A's step
    fails on block 2 after block 1 (gla, host) folded A's new tokens in. The fall-back computes block 2's
    KV again for both and A's block-1 state from position 0; B's block-1 state is untouched (block 1 ran
    for B over a scratch state). Both then go on with the tokens of a run without the fault."""
    model = _load(tiny_hybrid_model, cache_dir)
    ex = model.executor
    feed_a, history_b, x = PROMPT[:9], PROMPT[5:], 7
    reference = []
    for ids in (feed_a + [x] * 3, history_b + [x]):
        alone = ex.new_session()
        reference.append(_greedy(ex, alone, ex.forward(alone, ids), 6))
        ex.close_session(alone)
    model.move("2", "sim:0")
    a, b = ex.new_session(), ex.new_session()
    ex.forward(a, feed_a)
    ex.forward(b, history_b)
    state_b, kv_b = b.states[1].tensor.numpy().copy(), kv_of(b, 0, b.length)
    model.devices["sim:0"].backend.faults.launch = True
    with pytest.raises(DeviceFault):
        ex.forward(a, [x] * 3)
    assert a.states[1].positions == 12 != a.length == 9  # (block 1 folded the failed step in)
    report = model.fall_back_to_host("sim:0")
    assert report.recomputed == {1: len(feed_a), 2: len(feed_a) + len(history_b)}
    assert report.sessions == 2 and report.passed == (0,)
    assert np.array_equal(b.states[1].tensor.numpy(), state_b) and np.array_equal(kv_of(b, 0, b.length), kv_b)
    assert _greedy(ex, a, ex.forward(a, [x] * 3), 6) == reference[0]
    assert _greedy(ex, b, ex.forward(b, [x]), 6) == reference[1]


def _greedy(ex, session, logits, count):
    tokens = []
    for _ in range(count):
        tokens.append(int(np.argmax(logits)))
        logits = ex.forward(session, [tokens[-1]])
    return tokens
