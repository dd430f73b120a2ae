"""Batched steps over many sessions (engine/batched.py, batch_runner.py): every session of a batch gets
exactly what it gets alone (logits bit for bit, so greedy tokens too), in both CPU kernel families, with
ragged prompts, sessions joining and finishing mid-run, chunked prefill beside decode, a move in the
middle, and a forced spill and resume; each block's program runs once per step; a resume runs no prefill."""

from __future__ import annotations

import numpy as np
import pytest
from kv_contents import kv_of

from jitllm import model as jm
from jitllm.core.errors import JitllmError
from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.engine.batch_runner import DONE_LENGTH, BatchRunner
from jitllm.runtime.sampling import Sampler, SamplingParams

PROMPT_LENGTHS = (5, 23, 40, 17)


def prompts(count: int = len(PROMPT_LENGTHS), seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, 250, n)] for n in PROMPT_LENGTHS[:count]]


def greedy() -> Sampler:
    return Sampler(SamplingParams(temperature=0.0))


def alone(model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and each step's logits of one session on its own (the batch-1 path)."""
    ex = model.executor
    session = ex.new_session()
    logits = [ex.forward(session, prompt)]
    tokens = [int(np.argmax(logits[-1]))]
    for _ in range(steps - 1):
        logits.append(ex.forward(session, [tokens[-1]]))
        tokens.append(int(np.argmax(logits[-1])))
    ex.close_session(session)
    return tokens, logits


@pytest.fixture(scope="module", params=["exact", "fast"])
def cpu_model(request, tiny_model, cache_dir):
    return jm.load(tiny_model, devices="cpu", cpu_kernels=request.param, cache_dir=cache_dir)


def test_batched_steps_match_each_session_alone(cpu_model):
    """One prefill step of four ragged prompts, then decode steps of all four: bit-identical logits."""
    ex = cpu_model.executor
    ps = prompts()
    expected = [alone(cpu_model, p, 8)[1] for p in ps]
    sessions = [ex.new_session() for _ in ps]
    out = ex.batched_forward(list(zip(sessions, ps)))
    got = [[row] for row in out]
    for _ in range(7):
        out = ex.batched_forward([(s, [int(np.argmax(g[-1]))]) for s, g in zip(sessions, got)])
        for g, row in zip(got, out):
            g.append(row)
    for want, have in zip(expected, got):
        assert np.array_equal(np.array(want), np.array(have))
    for s in sessions:
        ex.close_session(s)


def test_runner_joining_finishing_and_chunked_prefill(cpu_model):
    """Requests of different lengths and limits under a small token budget: prompts are chunked beside
    decoding requests, requests finish at different steps and a late one joins; tokens as alone."""
    ps = prompts()
    limits = [3, 9, 6, 12]
    expected = [alone(cpu_model, p, n)[0] for p, n in zip(ps, limits)]
    runner = BatchRunner(cpu_model.executor, token_budget=16)
    requests = [runner.submit(p, n, greedy()) for p, n in zip(ps[:3], limits[:3])]
    for _ in range(4):
        runner.step()
    requests.append(runner.submit(ps[3], limits[3], greedy()))  # joins mid-run
    runner.run()
    assert [r.output for r in requests] == expected
    assert all(r.finished == DONE_LENGTH for r in requests)
    assert runner.stats.prefill_tokens == sum(len(p) for p in ps)
    assert runner.stats.largest_step >= 2


def test_one_program_call_per_block_per_step(cpu_model, monkeypatch):
    """Whatever the batch, each block's (ragged) program runs once per step."""
    from jitllm.runtime.engine import batched

    calls: list[int] = []
    real = batched.ragged_program

    def counting(ex, unit):
        program = real(ex, unit)
        calls.append(unit.index)
        return program

    monkeypatch.setattr(batched, "ragged_program", counting)
    ex = cpu_model.executor
    sessions = [ex.new_session() for _ in range(3)]
    ex.batched_forward(list(zip(sessions, prompts(3))))
    assert sorted(calls, key=str) == sorted([*range(len(ex.blocks)), "head"], key=str)
    for s in sessions:
        ex.close_session(s)


def test_spill_and_resume_without_recompute(tiny_model, cache_dir):
    """A KV budget too small for every request at once: requests admitted last are spilled to the host and
    resumed from there; every request's tokens are what it gets alone, and no prefill runs on a resume."""
    model = jm.load(tiny_model, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir)
    ps = prompts()
    limits = [20, 20, 20, 20]
    expected = [alone(model, p, n)[0] for p, n in zip(ps, limits)]
    host = model.executor.blocks[0].device
    pool = model.executor.pools[host.name]
    # room for ~ 1.5 requests' full histories: (40 + 20) positions = 4 pages per block at most
    pool.max_pages = 2 * 6
    runner = BatchRunner(model.executor, token_budget=64)
    requests = [runner.submit(p, n, greedy()) for p, n in zip(ps, limits)]
    runner.run()
    assert [r.output for r in requests] == expected
    assert runner.stats.spills >= 1 and runner.stats.resumes == runner.stats.spills
    assert runner.stats.prefill_tokens == sum(len(p) for p in ps)  # nothing prefilled twice
    assert runner.stats.recomputed_block_positions == 0


def test_move_in_the_middle_of_a_batch(tiny_model, cache_dir):
    """Blocks moved (with every session's pages) between batched steps change no token."""
    model = jm.load(tiny_model, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir,
                    extra_devices=[simulated_device("sim:0")])
    ps = prompts(3)
    expected = [alone(model, p, 10)[0] for p in ps]
    runner = BatchRunner(model.executor)
    requests = [runner.submit(p, 10, greedy()) for p in ps]
    for _ in range(4):
        runner.step()
    model.move("0", "sim:0")
    model.move("head", "sim:0")
    runner.step()
    model.move("*", "host")
    runner.run()
    assert [r.output for r in requests] == expected


def test_recurrent_blocks_are_refused(tiny_hybrid_model, cache_dir):
    model = jm.load(tiny_hybrid_model, devices="cpu", cache_dir=cache_dir)
    with pytest.raises(JitllmError, match="recurrent state"):
        BatchRunner(model.executor)


def test_device_failure_mid_batch_recomputes_only_the_lost_block(tiny_four_blocks, cache_dir):
    """A device whose launch fails mid-step: its block comes home and only that block's KV is computed
    again for each request (counted in block-positions, said in the log); the other blocks' pages stay as
    they were and every request still gets the tokens it gets alone."""
    from jitllm.runtime.backends.fake import with_faults

    sim = with_faults(simulated_device("sim:0"))
    model = jm.load(tiny_four_blocks, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir, extra_devices=[sim])
    model.move("1", "sim:0")
    ps = prompts(3)
    expected = [alone(model, p, 8)[0] for p in ps]
    logged: list[str] = []
    runner = BatchRunner(model.executor, log=logged.append, fall_back=model.fall_back_to_host)
    requests = [runner.submit(p, 8, greedy()) for p in ps]
    for _ in range(3):
        runner.step()
    lengths = [r.session.length for r in requests]
    kept = [{b: kv_of(r.session, b, n) for b in (0, 2, 3)} for r, n in zip(requests, lengths)]
    sim.backend.faults.launch = True
    assert runner.step() == []  # (the step that failed: the fall-back, then it is planned again)
    assert runner.stats.recomputed_block_positions == sum(lengths)  # (one lost block)
    assert [r.session.length for r in requests] == lengths
    for r, n, before in zip(requests, lengths, kept):
        assert all(np.array_equal(kv_of(r.session, b, n), kv) for b, kv in before.items())
    runner.run()
    assert [r.output for r in requests] == expected
    assert all(u.device.name == "host" for u in [*model.executor.blocks, model.executor.head])
    [line] = [x for x in logged if x.startswith("warning: sim:0: ")]
    assert (f"recomputed only block 1 for 3 sessions ({sum(lengths)} positions, {sum(lengths)} block-positions)"
            in line)
