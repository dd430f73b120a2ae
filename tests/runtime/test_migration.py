"""Live migration on the CPU: a simulated device (own budget, own page pool, llvm kernels) stands for
a second device. Greedy output with moves in the middle equals the run without moves, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from kv_contents import f32_kv_device

from jitllm.core.errors import JitllmError
from jitllm.ir.llama import BLOCK_LINEARS
from jitllm.model import load
from jitllm.runtime.backends.fake import simulated_device
from jitllm.runtime.sampling import SamplingParams

PROMPT = list(range(4, 30))
N = 24


def _load(path, cache_dir, budget=None, placement=None, kv_type="f16"):
    return load(path, devices="cpu", ctx=128, cache_dir=cache_dir, placement=placement, cpu_kernels="exact",
                kv_type=kv_type, extra_devices=[simulated_device("sim:0", budget), simulated_device("sim:1", budget)])


@pytest.fixture(scope="module")
def baseline(tiny_model, cache_dir):
    return _load(tiny_model, cache_dir).generate_ids(PROMPT, N)


@pytest.mark.parametrize("direct_runs", [32, 0], ids=["page-runs-copied", "pages-gathered-and-scattered"])
def test_moves_every_few_tokens_keep_the_output(tiny_model, cache_dir, baseline, direct_runs, monkeypatch):
    """KV pages move as direct copies per run of pages, or (many scattered pages: forced here with 0)
    gathered by the source's export kernel and scattered by the destination's import kernel."""
    monkeypatch.setattr("jitllm.runtime.engine.migration.DIRECT_RUNS", direct_runs)
    model = _load(tiny_model, cache_dir)
    model.move_schedule = {3: ["0=sim:0"], 6: ["1=sim:0,head=sim:1"], 9: ["0-1=sim:1"], 12: ["*=host"],
                           15: ["head=sim:0,0=sim:1"], 20: ["*=host,head=host"]}
    assert model.generate_ids(PROMPT, N) == baseline


def test_move_carries_kv_pages_and_frees_the_source(tiny_model, cache_dir):
    """(f32 KV: the step after the move is compared with one prefill of the whole history, bit for bit,
    which an f16 cache is not: it rounds the history a decode step reads, not the prefill's own keys.)"""
    model = _load(tiny_model, cache_dir, kv_type="f32")
    ex = model.executor
    session = ex.new_session()
    logits_before = ex.forward(session, PROMPT)
    host_pool = ex.pools["host"]
    free_before = host_pool.free_pages
    reports = model.move("0-1", "sim:0")
    assert [r.unit for r in reports] == [0, 1]
    assert all(r.kv_bytes == 2 * host_pool.page_bytes for r in reports)  # 26 positions = 2 pages per block
    assert host_pool.free_pages == free_before + 4
    assert model.devices["sim:0"].used_bytes >= sum(r.weight_bytes for r in reports)
    moved = ex.forward(session, [7])
    reference = ex.forward(ex.new_session(), PROMPT + [7])
    assert np.array_equal(moved, reference)
    assert logits_before.shape == moved.shape


def test_bad_moves_change_nothing(tiny_model, cache_dir):
    model = _load(tiny_model, cache_dir, placement="1=host!")
    where = [u.device.name for u in model.executor.blocks]
    for blocks, target, needle in [("0", "cuda:7", "not in -devices"), ("5", "sim:0", "past the model's last"),
                                   ("1", "sim:0", "pinned"), ("3-1", "sim:0", "backwards")]:
        with pytest.raises(JitllmError, match=needle):
            model.move(blocks, target)
    assert [u.device.name for u in model.executor.blocks] == where
    assert model.generate_ids(PROMPT, 4)  # still generating


def test_move_into_too_small_budget_is_refused(tiny_model, cache_dir):
    model = _load(tiny_model, cache_dir, budget=1000)
    with pytest.raises(JitllmError, match="cannot hold"):
        model.move("0", "sim:0")
    assert model.executor.blocks[0].device.name == "host"


def _greedy(ex, session, logits) -> list[int]:
    """N greedy tokens continuing `session` from its last `logits`."""
    tokens = []
    for _ in range(N):
        tokens.append(int(np.argmax(logits)))
        logits = ex.forward(session, [tokens[-1]])
    return tokens


def test_failure_half_way_leaves_the_block_running_with_its_kv(tiny_model, cache_dir, baseline):
    model = _load(tiny_model, cache_dir)
    ex = model.executor
    session = ex.new_session()
    tokens = list(PROMPT)
    logits = ex.forward(session, tokens)
    sim = model.devices["sim:0"]
    sim.backend.faults.alloc = False
    # weights fit, but the destination's KV pool allocation fails (injected)
    original_reserve = sim.reserve
    calls = []

    def failing_reserve(nbytes, what, kv=False, leaving=0):
        calls.append(what)
        if what.startswith("KV pool"):
            raise JitllmError("sim:0: allocation of KV pool failed (injected fault)")
        return original_reserve(nbytes, what, kv, leaving)

    sim.reserve = failing_reserve
    with pytest.raises(JitllmError, match="injected"):
        model.move("0-1", "sim:0")
    assert [u.device.name for u in ex.blocks] == ["host", "host"] and sim.used_bytes == 0
    assert any(c.startswith("weights") for c in calls)
    assert _greedy(ex, session, logits) == baseline


def test_device_fault_finishes_on_the_host(tiny_model, cache_dir, baseline):
    model = _load(tiny_model, cache_dir, placement=None)
    logs = []
    model.log = logs.append
    model.move("*", "sim:0")
    model.move("head", "sim:0")
    model.move_schedule = {5: []}
    sim = model.devices["sim:0"]
    tokens = []
    for i, token in enumerate(model.generate_tokens(PROMPT, N, SamplingParams(0.0))):
        tokens.append(token)
        if i == 4:
            sim.backend.faults.launch = True
    assert tokens == baseline
    assert any("finishing on the CPU" in line for line in logs)
    assert all(u.device.name == "host" for u in model.executor.blocks)


def test_no_gpu_fallback_fails_clearly(tiny_model, cache_dir):
    model = _load(tiny_model, cache_dir)
    model.no_gpu_fallback = True
    model.move("0", "sim:0")
    model.devices["sim:0"].backend.faults.launch = True
    with pytest.raises(JitllmError, match="sim:0: kernel launch failed .*-no-gpu-fallback"):
        model.generate_ids(PROMPT, 4)


def test_relocate_hands_the_last_block_to_the_host_when_kv_runs_out(tiny_model, cache_dir, baseline):
    model = _load(tiny_model, cache_dir)
    logs = []
    model.log = logs.append
    sim = model.devices["sim:0"]
    model.move("*", "sim:0")
    # room for the pool's first 4 pages only: 2 blocks x 2 pages = 32 positions, the run needs 50
    sim.kv_budget_bytes = 4 * model.executor.pool(sim).page_bytes
    assert model.generate_ids(PROMPT, N) == baseline
    assert [u.device.name for u in model.executor.blocks] == ["sim:0", "host"]
    assert any(line.startswith("relocated: moved block 1 sim:0 -> host") for line in logs)


def test_without_relocate_the_context_stops_growing_with_a_clear_error(tiny_model, cache_dir):
    model = _load(tiny_model, cache_dir)
    model.executor.relocate = None
    sim = model.devices["sim:0"]
    model.move("*", "sim:0")
    sim.kv_budget_bytes = 4 * model.executor.pool(sim).page_bytes
    with pytest.raises(JitllmError, match="sim:0: no room for more KV pages.*-relocate is off"):
        model.generate_ids(PROMPT, N)


def test_gpu_grow_moves_one_block_per_token(tiny_model, cache_dir, baseline):
    model = _load(tiny_model, cache_dir)
    model.grow_queue = [(0, "sim:0"), (1, "sim:0"), ("head", "sim:0")]
    tokens = []
    for i, token in enumerate(model.generate_tokens(PROMPT, N, SamplingParams(0.0))):
        tokens.append(token)
        on_sim = sum(u.device.name == "sim:0" for u in [*model.executor.blocks, model.executor.head])
        assert on_sim == min(i, 3)  # the move for token i follows its delivery
    assert tokens == baseline


def test_tune_seam_tries_seams_and_keeps_output(tiny_model, cache_dir, baseline):
    from jitllm.runtime.seam_tuning import SeamTuner

    model = _load(tiny_model, cache_dir)
    logs = []
    model.log = logs.append
    model.tuner = SeamTuner("sim:0", [0, 1], tokens_per_trial=2)
    assert model.generate_ids(PROMPT, N) == baseline
    assert model.tuner.done and set(model.tuner.results) == {0, 1, 2}
    line = next(l for l in logs if l.startswith("tune-seam:"))
    kept = int(line.rsplit("keeping ", 1)[1])
    assert sum(u.device.name == "sim:0" for u in model.executor.blocks) == kept


def test_moves_between_fused_and_separate_layouts_keep_the_output(tiny_model, cache_dir, baseline):
    """The host stacks Q/K/V and gate/up (as CUDA does); a device whose target keeps them separate gets
    its weights laid out at load and move time; moving to and from it re-lays them out and keeps the
    tokens."""
    from dataclasses import replace

    from jitllm.lowering.targets.llvm import LlvmTarget

    separate = simulated_device("sim:s")
    separate.target = LlvmTarget()
    separate.target.caps = replace(LlvmTarget.caps, fuse_linears=False)
    model = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", extra_devices=[separate])
    model.move_schedule = {2: ["0=sim:s"], 5: ["1=sim:s,head=sim:s"], 9: ["0=host"], 14: ["*=sim:s"], 19: ["*=host"]}
    ex = model.executor
    assert [s.name for s in ex.blocks[0].kind.linears] == ["attn_qkv", "attn_output", "ffn_gate_up", "ffn_down"]
    assert model.generate_ids(PROMPT, N) == baseline
    model.move("0", "sim:s")
    assert [s.name for s in ex.blocks[0].kind.linears] == list(BLOCK_LINEARS)
    assert len(ex.blocks[0].weights) > len(ex.blocks[1].weights)


def test_a_move_finds_the_destination_programs_with_one_lookup(tiny_model, cache_dir, monkeypatch):
    """The unit's kind and programs on a device are worked out once (Executor.placed); later moves of the
    unit there neither derive its kind again nor look its programs up by kind."""
    model = _load(tiny_model, cache_dir)
    ex = model.executor
    model.move("0", "sim:0")
    model.move("0", "host")
    derived = []
    monkeypatch.setattr(ex, "kind_on", lambda *args: derived.append(args))
    monkeypatch.setattr(ex, "programs", lambda *args: derived.append(args))
    model.move("0", "sim:0")
    model.move("0", "host")
    assert derived == [] and ex.blocks[0].program is ex.program(ex.blocks[0].kind, model.devices["host"])


def test_page_runs_group_ids_consecutive_on_both_sides():
    from jitllm.runtime.engine.migration import _joint_runs

    assert _joint_runs([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 5]) == [(3, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert _joint_runs([3, 4, 5], [7, 8, 1]) == [(3, 7, 2), (5, 1, 1)]
    assert _joint_runs([], []) == []


def _with_graphs(model):
    """Give the simulated devices the host's stand-in for CUDA graphs (step_graphs.ReplayRecorder)."""
    from jitllm.runtime.backends.fake import ReplayRecorder

    for name in ("sim:0", "sim:1"):
        model.devices[name].graphs = ReplayRecorder()
    return model


def test_relocation_growth_and_seam_tuning_with_captured_steps(tiny_model, cache_dir, baseline):
    """The serving-time placement changes move blocks between captured decode steps; each move must
    re-capture (never replay a step over freed or stale buffers) and the tokens stay the eager ones."""
    from jitllm.runtime.seam_tuning import SeamTuner

    relocating = _with_graphs(_load(tiny_model, cache_dir))
    sim = relocating.devices["sim:0"]
    relocating.move("*", "sim:0")
    sim.kv_budget_bytes = 4 * relocating.executor.pool(sim).page_bytes
    assert relocating.generate_ids(PROMPT, N) == baseline
    assert [u.device.name for u in relocating.executor.blocks] == ["sim:0", "host"]
    assert sim.graphs.captures >= 2  # before and after the relocation

    growing = _with_graphs(_load(tiny_model, cache_dir))
    growing.grow_queue = [(0, "sim:0"), (1, "sim:0"), ("head", "sim:0")]
    assert growing.generate_ids(PROMPT, N) == baseline
    assert growing.devices["sim:0"].graphs.captures >= 3  # one per placement the growth went through

    tuning = _with_graphs(_load(tiny_model, cache_dir))
    tuning.tuner = SeamTuner("sim:0", [0, 1], tokens_per_trial=2)
    assert tuning.generate_ids(PROMPT, N) == baseline
    assert tuning.tuner.done


def test_failure_after_the_copies_waits_for_them_before_giving_memory_back(tiny_model, cache_dir, baseline,
                                                                            monkeypatch):
    """A move failing once its copies are issued (asynchronous with page-locked memory on a GPU) waits for
    the destination before its pages and weights buffer go back to be reused; the block keeps running."""
    import jitllm.runtime.engine.migration as migration

    model = _load(tiny_model, cache_dir)
    ex = model.executor
    session = ex.new_session()
    logits = ex.forward(session, list(PROMPT))
    sim = model.devices["sim:0"]
    events = []
    copy_pages = migration._copy_pages

    def copy_then_fail(*args):
        copy_pages(*args)
        events.append("copied")
        raise JitllmError("sim:0: copy failed (injected fault)")

    monkeypatch.setattr(migration, "_copy_pages", copy_then_fail)
    monkeypatch.setattr(sim, "synchronize", lambda: events.append("sync"))
    with pytest.raises(JitllmError, match="injected"):
        model.move("0", "sim:0")
    assert events == ["copied", "sync"] and ex.blocks[0].device.name == "host" and sim.used_bytes == 0
    assert _greedy(ex, session, logits) == baseline


def test_a_device_fault_brings_only_that_devices_blocks_home(tiny_model, cache_dir, baseline):
    model = _load(tiny_model, cache_dir, placement=None)
    logs = []
    model.log = logs.append
    model.move("0", "sim:0")
    model.move("1", "sim:1")
    tokens = []
    for i, token in enumerate(model.generate_tokens(PROMPT, N, SamplingParams(0.0))):
        tokens.append(token)
        if i == 4:
            model.devices["sim:1"].backend.faults.launch = True
    assert tokens == baseline
    assert any(line.startswith("warning: sim:1: ") and "finishing on the CPU" in line for line in logs)
    assert [u.device.name for u in model.executor.blocks] == ["sim:0", "host"]



def test_moves_between_f16_and_f32_only_devices_convert_the_pages(tiny_model, cache_dir):
    """A device whose target stores no f16 KV keeps an f32 pool and f32 kinds; a block moving there and
    back has its pages widened and rounded again on the way, so each step after the moves computes what
    the same steps compute on the host alone. f16 pages are half the bytes moved."""
    model = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type="f16",
                 extra_devices=[f32_kv_device()])
    ex = model.executor
    moved, alone = ex.new_session(), ex.new_session()
    ex.forward(moved, PROMPT)
    ex.forward(alone, PROMPT)
    host_pool = ex.pools["host"]
    assert host_pool.dtype == "float16"
    (report,) = model.move("0", "sim:f32")
    assert ex.pools["sim:f32"].dtype == "float32" and ex.blocks[0].kind.kv_type == "f32"
    assert ex.blocks[1].kind.kv_type == "f16"
    assert report.kv_bytes == 4 * host_pool.page_bytes  # (two sessions of 26 positions: 2 pages each, as f16)
    for token in (7, 8):
        assert np.array_equal(ex.forward(moved, [token]), ex.forward(alone, [token]))
        model.move("0", "host" if token == 7 else "sim:f32")
    assert ex.blocks[0].kind.kv_type == "f32"
    assert np.array_equal(ex.forward(moved, [9]), ex.forward(alone, [9]))


def test_a_spilled_session_resumes_where_its_block_moved_to_another_kv_dtype(tiny_model, cache_dir):
    """Spilled f16 pages resume into an f32 pool (the block moved meanwhile), widened on the way."""
    from jitllm.runtime.engine.spill import resume, spill

    model = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type="f16",
                 extra_devices=[f32_kv_device()])
    ex = model.executor
    spilled, alone = ex.new_session(), ex.new_session()
    ex.forward(spilled, PROMPT)
    ex.forward(alone, PROMPT)
    kept = spill(ex, spilled)
    assert kept.pages[0].dtype == np.float16
    model.move("0", "sim:f32")
    assert resume(ex, spilled, kept)
    assert ex.pools["sim:f32"].dtype == "float32"
    assert np.array_equal(ex.forward(spilled, [7]), ex.forward(alone, [7]))


def test_moves_between_the_host_and_cuda_copy_the_weights_they_share():
    """CUDA's kinds fold their prefill ops (`folded`) where the host's do not: the weight inputs are the
    same, so a move copies the packed allocation instead of reading the file again (it did, from stop 16:
    host <-> cuda:0 moves of a 3B block ran at pageable-copy speed). Fused and separate layouts do not
    share a packing."""
    from dataclasses import replace

    from jitllm.lowering.target import kind_for_target
    from jitllm.lowering.targets.cuda import CudaTarget
    from jitllm.lowering.targets.llvm import LlvmTarget
    from jitllm.random_model import preset_layout
    from jitllm.runtime.engine.migration import same_packing

    layout = preset_layout("smollm2-135m", "f16")
    host = kind_for_target(layout.block_kinds[0], LlvmTarget("exact"))
    cuda = kind_for_target(layout.block_kinds[0], CudaTarget("sm_90", "fast"))
    assert host != cuda and cuda.folded and not host.folded
    assert same_packing(layout, 0, host, cuda) and same_packing(layout, 0, cuda, host)
    assert same_packing(layout, 0, host, replace(host, kv_type="f32"))
    separate = layout.block_kinds[0]  # (the file's kind: Q/K/V and gate/up apart)
    assert separate.linears != host.linears and not same_packing(layout, 0, host, separate)
