"""Pipelined greedy decode (Executor.greedy_tokens) on the CPU: simulated devices record their steps with
ReplayRecorder (a launch runs at once there, so a step launched ahead has run by the time its token is
read), and the head gets host stand-ins for the GPU head's embedding gather and greedy pick. The tokens
must be those of one `next_token` per step, through moves, page growth and a consumer that stops early.

The random tiny model's greedy pick repeats its input token (its tied head sees mostly the embedding),
so the stand-in pick is a permutation of the largest logit's index: every step's token then differs
from the step before's, and a step fed the wrong token or position shows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from simulated_graphs import load_on_simulated

from jitllm.runtime.engine.executor import Executor

PROMPT = list(range(4, 30))
N = 40  # past two pages of 16 positions: the pipeline stops for page bookkeeping on the way


@pytest.fixture
def plain_steps(monkeypatch):
    """Heads gather embedding rows and pick greedy tokens "on the device", as GPU heads do
    (lowering.EMBED_FUNCTION, ARGMAX_FUNCTION); counts the plain steps (`next_token` calls)."""
    original, original_next = Executor.programs, Executor.next_token
    calls = []

    def next_token(self, session, ids):
        calls.append(len(ids))
        return original_next(self, session, ids)

    def programs(self, kind, device):
        program, decode = original(self, kind, device)
        if kind.kind != "head":
            return program, decode

        def embed(rows, *parts):
            parts[-1].copyfrom(self.embed(rows.numpy()[0].tolist())[None].astype(np.float32))

        def argmax(logits, token):
            vocab = logits.shape[-1]
            token.copyfrom(np.array([(np.argmax(logits.numpy()[0, -1]) * 7 + 3) % vocab], np.int32))

        return dataclasses.replace(program, embed=embed), dataclasses.replace(decode or program, argmax=argmax)

    monkeypatch.setattr(Executor, "programs", programs)
    monkeypatch.setattr(Executor, "next_token", next_token)
    return calls


def _load(path, cache_dir, placement="*=sim:0,head=sim:0", graphs=True):
    return load_on_simulated(path, cache_dir, placement, graphs)[0]


@pytest.fixture
def baseline(tiny_model, cache_dir, plain_steps):
    """The tokens of plain steps (the same devices without captured steps: no pipeline)."""
    tokens = _load(tiny_model, cache_dir, graphs=False).generate_ids(PROMPT, N)
    assert len(plain_steps) == N and len(set(tokens)) > 8
    plain_steps.clear()
    return tokens


def test_pipelined_steps_give_the_tokens_of_plain_steps(tiny_model, cache_dir, baseline, plain_steps):
    model = _load(tiny_model, cache_dir)
    ex = model.executor
    assert model.generate_ids(PROMPT, N) == baseline
    assert plain_steps == [len(PROMPT)]  # the prompt's; every decode step ran pipelined
    assert not ex._inflight and not ex._graphs  # (the session closed: its graphs went with it)


def test_the_next_step_runs_ahead_except_where_it_needs_a_page(tiny_model, cache_dir, baseline, plain_steps):
    """A step that needs a new page waits for the one before (page bookkeeping may move blocks), as does the
    second step (its slot's first capture) and the one after a pool growth (both slots are captured again
    over the new pool); every other step is launched while the one before runs."""
    ex = _load(tiny_model, cache_dir).executor
    session = ex.new_session()
    first = ex.next_token(session, PROMPT)
    page = ex.layout.block_kinds[0].page_size
    ahead, pools = [], []
    for token in ex.greedy_tokens(session, first, N - 1):
        ahead.append(len(ex._inflight))
        pools.append(ex.pools["sim:0"].pages)
    positions = [len(PROMPT) + k + 1 for k in range(N - 1)]  # of the step after each
    grew = [k for k in range(1, N - 1) if pools[k] is not pools[k - 1]]
    assert grew and len(grew) < len([p for p in positions if p % page == 0])  # (the test covers both cases)
    assert ahead == [0 if k in (0, N - 2) or p % page == 0 or k in grew else 1 for k, p in enumerate(positions)]


def test_moves_while_a_step_is_in_flight_keep_the_tokens(tiny_model, cache_dir, baseline, plain_steps):
    model = _load(tiny_model, cache_dir)
    # each move comes while the next step runs ahead: the move waits for it, and the pipeline takes it up
    # again, or steps plainly where the model is no longer one captured segment with a picking head
    model.move_schedule = {3: ["0=sim:1"], 9: ["0=sim:0"], 14: ["head=host"], 20: ["*=sim:1,head=sim:1"],
                           30: ["1=sim:0"]}
    assert model.generate_ids(PROMPT, N) == baseline
    assert 1 < len(plain_steps) < N  # steps with the head on the host are plain ones


def test_a_consumer_that_stops_early_leaves_the_session_as_plain_steps_do(tiny_model, cache_dir, baseline,
                                                                         plain_steps):
    model = _load(tiny_model, cache_dir)
    ex = model.executor
    session = ex.new_session()
    first = ex.next_token(session, PROMPT)
    stream = ex.greedy_tokens(session, first, 30)
    taken = [next(stream) for _ in range(5)]
    assert len(ex._inflight) == 1  # the sixth step runs ahead
    stream.close()
    assert not ex._inflight
    assert [first, *taken] == baseline[:6]
    assert session.length == len(PROMPT) + 5 and session.tokens == PROMPT + baseline[:5]
    # the session goes on from there as if the sixth step had never run
    rest = list(ex.greedy_tokens(session, taken[-1], N - 6))
    assert [first, *taken, *rest] == baseline
    with pytest.raises(Exception, match="context full"):
        list(ex.greedy_tokens(session, rest[-1], 200))




