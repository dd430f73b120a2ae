"""A live move is applied a unit per engine turn (Engine.call_in_pieces, placement.move): the streams step
between two units, their tokens unchanged; a unit that fails mid-move sends back the units already moved."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from solo import alone

from jitllm import model as jm
from jitllm.core.errors import JitllmError
from jitllm.runtime.backends.fake import simulated_device, with_faults
from jitllm.runtime.engine import migration
from jitllm.runtime.sampling import SamplingParams
from jitllm.server import placement
from jitllm.server.engine import Engine, EngineSettings, Finished, Job, Token
from jitllm.server.metrics import Metrics

SPEC = "0-1=sim:0,head=sim:0"


def loaded(tiny_model, cache_dir, sim):
    return jm.load(tiny_model, devices="cpu", cpu_kernels="exact", cache_dir=cache_dir, extra_devices=[sim])


def where(model) -> list[str]:
    return [u.device.name for u in [*model.executor.blocks, model.executor.head]]


def test_a_move_goes_a_unit_per_turn_while_streams_step(tiny_model, cache_dir):
    model = loaded(tiny_model, cache_dir, simulated_device("sim:0"))
    ex = model.executor
    rng = np.random.default_rng(2)
    ps = [[int(t) for t in rng.integers(4, 250, n)] for n in (9, 30)]

    expected = [alone(model, p, 30) for p in ps]
    events: list[str] = []
    move_unit, batched = migration.move_unit, ex.batched_forward

    def moving(executor, index, dest, **kw):
        events.append(f"move {index}")
        return move_unit(executor, index, dest, **kw)

    def stepping(work):
        events.append("step")
        return batched(work)

    migration.move_unit, ex.batched_forward = moving, stepping
    metrics = Metrics()
    engine = Engine(lambda log: model, EngineSettings(parallel=2, queue=2, cache_sessions=4), metrics)
    engine._log = lambda message: None
    tokens: list[list[int]] = [[], []]
    done = [threading.Event(), threading.Event()]
    moved: list = []

    def deliver(i: int):
        def take(event) -> None:
            if isinstance(event, Token):
                tokens[i].append(event.id)
                if i == 0 and len(tokens[0]) == 5:
                    moved.append(engine.call_in_pieces(lambda m: placement.move(m, SPEC, metrics, engine.batching)))
            else:
                assert isinstance(event, Finished), event
                done[i].set()
        return take

    try:
        engine.start()
        while not engine.ready:
            threading.Event().wait(0.01)
        engine.submit([Job(p, 30, SamplingParams(temperature=0.0), None, True, deliver(i)) for i, p in enumerate(ps)])
        assert all(d.wait(120) for d in done)
        answer = moved[0].result(60)
    finally:
        migration.move_unit = move_unit
        engine.stop()
    assert tokens == expected
    assert where(model) == ["sim:0", "sim:0", "sim:0"]
    assert [m["unit"] for m in answer["moves"]] == ["0", "1", "head"]
    first, last = events.index("move 0"), events.index("move head")
    between = events[first:last + 1]
    assert between.count("step") >= 2 and "move 0" in between and "move 1" in between, events
    assert not any(a.startswith("move") and b.startswith("move") for a, b in zip(between, between[1:])), events
    assert metrics.registry.get_sample_value("jitllm_moves_total") == 3


def test_a_unit_failing_mid_move_sends_back_those_moved(tiny_model, cache_dir):
    sim = with_faults(simulated_device("sim:0"))
    model = loaded(tiny_model, cache_dir, sim)
    session = model.executor.new_session()
    model.executor.forward(session, [5, 6, 7, 8, 9])
    pieces = placement.move(model, SPEC, Metrics(), batched=True)
    for _ in range(3):  # (first the three units' programs on sim:0, a turn each)
        next(pieces)
    assert where(model) == ["host", "host", "host"]
    next(pieces)
    assert where(model) == ["sim:0", "host", "host"]
    sim.backend.faults.alloc = True
    with pytest.raises(Exception):
        next(pieces)
    assert where(model) == ["host", "host", "host"]
    with pytest.raises(JitllmError, match="pinned|unknown|no device|sim:9"):
        next(placement.move(model, "0=sim:9", Metrics()))
    assert where(model) == ["host", "host", "host"]
