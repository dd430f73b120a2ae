"""Captured decode steps (step_graphs.py) on the CPU: simulated devices record their segment's calls
with ReplayRecorder, which replays them over the captured tensors the way a CUDA graph replays over
fixed addresses. Output must equal the eager run; moves, pool growth and new sessions re-capture."""

from __future__ import annotations

import numpy as np
import pytest
from simulated_graphs import load_on_simulated

from jitllm.runtime.engine.step_graphs import segments
from jitllm.runtime.model_layout import HEAD

PROMPT = list(range(4, 30))
N = 24


@pytest.fixture(scope="module")
def baseline(tiny_model, cache_dir):
    return load_on_simulated(tiny_model, cache_dir, graphs=False)[0].generate_ids(PROMPT, N)


def test_segments_group_consecutive_units_and_the_head(tiny_model, cache_dir):
    model, _ = load_on_simulated(tiny_model, cache_dir, placement="0=sim:0,1=sim:0,head=sim:1")
    ex = model.executor
    segs = segments(ex.blocks, ex.head)
    assert [(s.device.name, [u.index for u in s.blocks], s.head is not None) for s in segs] == [
        ("sim:0", [0, 1], False), ("sim:1", [], True)]
    model.move("1", "host")
    segs = segments(ex.blocks, ex.head)
    assert [(s.device.name, [u.index for u in s.blocks]) for s in segs] == [("sim:0", [0]), ("host", [1]), ("sim:1", [])]


def test_replayed_steps_give_the_eager_tokens(tiny_model, cache_dir, baseline):
    model, (sim0, _) = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0")
    assert model.generate_ids(PROMPT, N) == baseline
    # one capture for the first decode step, one more when the page pool grew mid-generation; the other
    # steps replayed
    assert 1 <= sim0.graphs.captures <= 3


def test_moves_between_captured_segments_keep_the_output(tiny_model, cache_dir, baseline):
    model, (sim0, sim1) = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:1")
    model.move_schedule = {3: ["0=sim:1"], 6: ["1=host"], 9: ["*=sim:0,head=sim:0"], 13: ["head=sim:1"],
                           17: ["0-1=sim:1"], 21: ["*=host,head=host"]}
    assert model.generate_ids(PROMPT, N) == baseline
    assert sim0.graphs.captures >= 3 and sim1.graphs.captures >= 3


def test_a_device_gaining_the_head_does_not_replay_steps_over_its_old_inputs(tiny_model, cache_dir, baseline):
    """A device's decode inputs are remade when the head comes to it (they gain the logits' host array);
    a segment of blocks there, captured over the old ones, is captured again rather than replayed."""
    model, _ = load_on_simulated(tiny_model, cache_dir, placement="0=sim:1,1=sim:0,head=sim:0")
    model.move_schedule = {5: ["head=sim:1"]}  # then sim:1 runs block 0 and, after sim:0's block 1, the head
    assert model.generate_ids(PROMPT, N) == baseline


def test_a_move_invalidates_the_captured_step(tiny_model, cache_dir):
    model, (sim0, _) = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0",
                                         kv_type="f32")  # (compared with one prefill below)
    ex = model.executor
    session = ex.new_session()
    ex.forward(session, PROMPT)
    ex.forward(session, [7])
    ex.forward(session, [8])
    assert sim0.graphs.captures == 1
    (record,) = ex._graphs.values()
    old_weights = ex.blocks[0].weights
    assert any(kept is old_weights for kept in record.keep)
    model.move("0", "sim:1")
    model.move("0", "sim:0")  # back where it was, but in new buffers
    assert not ex._graphs  # nothing holds the freed buffers
    moved = ex.forward(session, [9])
    assert sim0.graphs.captures == 2
    reference = ex.forward(ex.new_session(), PROMPT + [7, 8, 9])
    assert abs(moved - reference).max() < 1e-4  # decode steps vs one prefill: summation order only


def test_sessions_capture_their_own_steps(tiny_model, cache_dir, baseline):
    model, (sim0, _) = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0")
    ex = model.executor
    a, b = ex.new_session(), ex.new_session()
    la, lb = ex.forward(a, PROMPT), ex.forward(b, PROMPT[:10])
    for _ in range(3):
        la = ex.forward(a, [int(la.argmax())])
        lb = ex.forward(b, [int(lb.argmax())])
    assert sim0.graphs.captures == 2
    ex.close_session(b)
    assert all(key[0] == a.id for key in ex._graphs)


def test_a_captured_step_moves_its_inputs_and_logits_itself(tiny_model, cache_dir):
    """The host only writes host arrays; the step's first call copies them in and its last copies the
    logits out, so a replay needs nothing else (on CUDA both are graph nodes over pinned memory)."""
    model, (sim0, _) = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0")
    ex = model.executor
    session = ex.new_session()
    ex.forward(session, PROMPT)
    ex.forward(session, [7])
    (record,) = ex._graphs.values()
    step = session.step_inputs["sim:0"]
    calls = [fn for fn, _, _ in record.graph.calls]
    assert calls[0] == step.upload and calls[-1] == step.download
    logits = ex.forward(session, [8])
    assert sim0.graphs.captures == 1
    assert np.array_equal(logits, step.staging.logits[0, -1])
    assert int(step.past.numpy()[0]) == len(PROMPT) + 1


def test_a_segment_fed_from_another_device_does_not_upload_the_hidden_state(tiny_model, cache_dir, baseline):
    model, _ = load_on_simulated(tiny_model, cache_dir, placement="0=sim:0,1=sim:1,head=sim:1")
    ex = model.executor
    session = ex.new_session()
    ex.forward(session, PROMPT)
    ex.forward(session, [7])
    first, second = session.step_inputs["sim:0"].staging, session.step_inputs["sim:1"].staging
    assert first.x_staged and not second.x_staged
    assert first.logits is None and second.logits is not None
    assert model.generate_ids(PROMPT, N) == baseline


def test_a_pool_grown_by_another_session_recaptures_the_step(tiny_model, cache_dir, baseline):
    """Steps within a session's pages replay without rebuilding their signature; pages handed out to any
    session (here another one, whose prefill grows the shared pool) make the next step check it again."""
    model, (sim0, _) = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0")
    ex = model.executor
    a = ex.new_session()
    logits, tokens = ex.forward(a, PROMPT), []
    for i in range(N):
        tokens.append(int(logits.argmax()))
        if i == 6:
            pages = ex.pools["sim:0"].pages
            ex.forward(ex.new_session(), list(range(3, 3 + 100)))  # another session: the pool grows
            assert ex.pools["sim:0"].pages is not pages
            before = sim0.graphs.captures
        logits = ex.forward(a, [tokens[-1]])
        if i == 6:
            assert sim0.graphs.captures == before + 1  # a's step baked the old pool: captured again
    assert tokens == baseline  # (a page boundary later, a stale step would have left its K/V in the old pool)


def test_segments_are_found_again_after_a_move(tiny_model, cache_dir):
    model, _ = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:0")
    ex = model.executor
    session = ex.new_session()
    ex.forward(session, PROMPT)
    ex.forward(session, [7])
    (first,) = ex._segments[1]
    ex.forward(session, [8])
    assert ex._segments[1][0] is first  # within the session's pages: the same segments
    model.move("1", "sim:1")
    ex.forward(session, [9])
    assert [(s.device.name, [u.index for u in s.blocks]) for s in ex._segments[1]] == [("sim:0", [0]), ("sim:1", [1]), ("sim:0", [])]


def test_greedy_steps_end_with_the_heads_own_pick(tiny_model, cache_dir):
    """Where the head's program can pick the greedy token (GPU heads; here a stand-in that writes the
    device tensor as the kernel does), a greedy step ends with the pick and brings back the token alone:
    its own captured graph, the logits never downloaded, the tokens those of picking from the logits."""
    model, (_, sim1) = load_on_simulated(tiny_model, cache_dir, placement="*=sim:0,head=sim:1")
    ex = model.executor
    reference, session = ex.new_session(), ex.new_session()
    expected = [int(np.argmax(ex.forward(reference, PROMPT)))]
    for _ in range(N - 1):
        expected.append(int(np.argmax(ex.forward(reference, [expected[-1]]))))
    picks = []

    def pick(logits, token):
        picks.append(token)
        token.copyfrom(np.array([np.argmax(logits.numpy()[0, -1])], np.int32))

    ex.head.program_for(1).argmax = pick
    got = [ex.next_token(session, PROMPT)]
    for _ in range(N - 1):
        got.append(ex.next_token(session, [got[-1]]))
    assert got == expected
    assert len(picks) >= N  # the prompt's, then every step's (captured once, replayed after)
    step = session.step_inputs["sim:1"]
    assert picks[-1] is step.token and not step.staging.logits.any()
    # the head's segment (the head alone on sim:1): a graph ending with the pick for the greedy session
    assert {key[2] for key in ex._graphs if key[:2] == (session.id, HEAD)} == {True}
    assert {key[2] for key in ex._graphs if key[:2] == (reference.id, HEAD)} == {False}
