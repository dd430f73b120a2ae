"""The executor on a tiny random model: paged KV decode equals recomputation, sessions are independent."""

from __future__ import annotations

import numpy as np
import pytest

from jitllm.core.errors import JitllmError
from jitllm.model import load


@pytest.fixture(scope="module")
def model(tiny_model, cache_dir):
    """f32 KV: paged decode is compared with recomputation (an f16 cache rounds the history decode reads)."""
    return load(tiny_model, devices="cpu", ctx=64, cache_dir=cache_dir, cpu_kernels="exact", kv_type="f32")


def test_decode_through_pages_equals_one_prefill(model):
    ex = model.executor
    prompt = list(range(4, 40))  # crosses two 16-position pages
    session = ex.new_session()
    logits = ex.forward(session, prompt[:20])
    for token in prompt[20:]:
        logits = ex.forward(session, [token])
    whole = ex.forward(ex.new_session(), prompt)
    assert np.abs(logits - whole).max() < 1e-4


def test_sessions_do_not_share_history(model):
    ex = model.executor
    a, b = ex.new_session(), ex.new_session()
    ex.forward(a, [5, 6, 7])
    alone = ex.forward(ex.new_session(), [9, 10])
    assert np.array_equal(ex.forward(b, [9, 10]), alone)


def test_pages_are_returned_when_a_session_closes(model):
    ex = model.executor
    pool = ex.pools["host"]
    before = pool.free_pages
    session = ex.new_session()
    ex.forward(session, list(range(4, 30)))
    assert pool.free_pages == before - 2 * model.layout.config.num_blocks
    ex.close_session(session)
    assert pool.free_pages == before


def test_context_limit(model):
    with pytest.raises(JitllmError, match="longer than the context"):
        list(model.generate(list(range(4, 70)), max_tokens=1))


def test_greedy_is_reproducible_and_seeded_sampling_too(model):
    from jitllm.runtime.sampling import SamplingParams

    ids = model.tokenizer.encode("hello")
    assert model.generate_ids(ids, 8) == model.generate_ids(ids, 8)
    s = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=5)
    first = "".join(model.generate("hello", 8, s))
    assert first == "".join(model.generate("hello", 8, s))


def test_decode_steps_reuse_their_input_tensors(model):
    """No per-token allocation of the step's inputs: the same tensors are rewritten every token."""
    ex = model.executor
    session = ex.new_session()
    logits = ex.forward(session, [5, 6, 7])
    ex.forward(session, [int(np.argmax(logits))])
    first = session.step_inputs["host"]
    tensors = (first.x, first.cos, first.sin, first.past)
    for token in (8, 9, 10):
        ex.forward(session, [token])
    now = session.step_inputs["host"]
    assert all(a is b for a, b in zip((now.x, now.cos, now.sin, now.past), tensors))
    assert int(now.past.numpy()[0]) == 6  # the last step's position (3 prompt tokens, then 4 steps)
    ex.close_session(session)



def test_steps_within_the_pages_skip_the_page_bookkeeping(tiny_model, cache_dir, monkeypatch):
    """The per-block page checks run only when a step may need a page (or after a move or reset)."""
    from jitllm.runtime.backends.fake import simulated_device

    model = load(tiny_model, devices="cpu", ctx=64, cache_dir=cache_dir, cpu_kernels="exact",
                 extra_devices=[simulated_device("sim:0")])
    ex = model.executor
    checked = []
    real = ex.pages_for
    monkeypatch.setattr(ex, "pages_for", lambda session, unit, positions: checked.append(positions) or real(
        session, unit, positions))
    session = ex.new_session()
    ex.forward(session, [5, 6, 7])
    blocks, page = len(ex.blocks), ex.blocks[0].kind.page_size
    assert checked == [3] * blocks and session.kv_room == page
    for token in range(8, 8 + page - 3):  # up to the end of the first page
        ex.forward(session, [token])
    assert len(checked) == blocks
    ex.forward(session, [40])  # position 17 needs a second page in every block
    assert checked[blocks:] == [page + 1] * blocks and session.kv_room == 2 * page
    model.move("0", "sim:0")
    assert session.kv_room == 0
    ex.forward(session, [41])
    assert len(checked) == 3 * blocks
    ex.reset_session(session)
    assert session.kv_room == 0


def test_a_pool_growth_that_fails_to_allocate_charges_nothing(monkeypatch):
    from jitllm.runtime.backends.fake import simulated_device
    from jitllm.runtime.engine.kv_pages import PagePool

    dev = simulated_device("sim")
    pool = PagePool(dev, 4, 2, 16, 8)
    charged = dev.kv_bytes

    def no_memory(shape, dtype):
        raise JitllmError("sim: out of memory (injected)")

    monkeypatch.setattr(dev, "empty", no_memory)
    with pytest.raises(JitllmError, match="injected"):
        pool.allocate(10)
    assert dev.kv_bytes == charged and pool.num_pages == 4 and pool.free_pages == 4


def test_a_sessions_page_tables_are_rows_of_one_tensor_uploaded_once():
    """Tables that gained pages together are uploaded by one copy; each table's tensor is its row, at a
    fixed address until the arena needs more room (then new tensors, which captured steps notice)."""
    from jitllm.runtime.backends.fake import simulated_device
    from jitllm.runtime.engine.kv_pages import PagePool, PageTable, TableArena

    dev = simulated_device("sim")
    pool, arena = PagePool(dev, 8, 2, 16, 8), TableArena(dev)
    tables = [PageTable(pool, arena=arena) for _ in range(3)]
    for t in tables:
        t.ensure(20)  # two pages each
    views = [t.tensor() for t in tables]
    for t, v in zip(tables, views):
        assert v.numpy()[0, : len(t.ids)].tolist() == t.ids

    class Counting:
        def __init__(self, tensor):
            self.tensor, self.copies = tensor, 0

        def copyfrom(self, source):
            self.copies += 1
            return self.tensor.copyfrom(source)

    arena._tensor = counting = Counting(arena._tensor)
    for t in tables:
        t.ensure(40)  # a third page each
    assert all(t.tensor() is v for t, v in zip(tables, views))  # same tensors, same addresses
    assert counting.copies == 1
    for t, v in zip(tables, views):
        assert v.numpy()[0, :3].tolist() == t.ids
    tables[0].ensure(16 * 70)  # past the room: the arena is laid out afresh
    assert tables[0].tensor() is not views[0] and tables[0].tensor().numpy()[0, :70].tolist() == tables[0].ids
    assert tables[1].tensor().numpy()[0, :3].tolist() == tables[1].ids
    row = tables[2]._row
    tables[2].release()
    reused = PageTable(pool, arena=arena)
    reused.ensure(1)
    assert reused._row == row and reused.tensor().numpy()[0, 0] == reused.ids[0]


def test_a_reset_session_starts_a_new_arena(model):
    ex = model.executor
    session = ex.new_session()
    ex.forward(session, [1, 2, 3])
    assert session.arenas
    ex.reset_session(session)
    assert not session.arenas and not session.tables


def test_a_truncated_session_continues_like_a_fresh_prefill_of_its_prefix(model):
    """truncate_session keeps the first positions' KV and frees the later pages: what follows is computed as if
    the prefix alone had been fed (the server's prefix cache reuses a conversation this way)."""
    ex = model.executor
    pool = ex.pools["host"]
    before = pool.free_pages
    session = ex.new_session()
    ex.forward(session, list(range(4, 44)))  # 40 positions: 3 pages per block
    ex.forward(session, [50])
    assert ex.truncate_session(session, 18) and session.length == 18 and session.tokens == list(range(4, 22))
    assert pool.free_pages == before - 2 * model.layout.config.num_blocks  # 18 positions: 2 pages per block
    continued = ex.forward(session, [60, 61])
    fresh = ex.forward(ex.new_session(), list(range(4, 22)) + [60, 61])
    assert np.abs(continued - fresh).max() < 1e-4
    assert not ex.truncate_session(session, 30) and session.length == 20  # no history to keep that far


def test_a_recurrent_history_is_not_truncated(tiny_hybrid_model, cache_dir):
    hybrid = load(tiny_hybrid_model, devices="cpu", ctx=64, cache_dir=cache_dir, cpu_kernels="exact")
    ex = hybrid.executor
    session = ex.new_session()
    ex.forward(session, [5, 6, 7, 8])
    assert not ex.truncate_session(session, 2) and session.length == 4
    assert ex.truncate_session(session, 4)
