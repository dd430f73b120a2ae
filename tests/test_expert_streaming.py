"""Expert streaming (JITLLM_GPU_STREAM=1) on a simulated device whose budget holds the MoE blocks' attention
and router, the head and a small expert cache, not the experts: tiny random Qwen3-MoE and Mixtral models
(tests/test_moe.py's) give the resident run's logits bit for bit (a simulated device computes from the
cache's host memory, so a slot holding the wrong expert shows), the charged bytes are the resident parts,
the head and the cache, and each token's uploads are the misses of the router's picks under LRU."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_convert import write_hf_tokenizer
from test_moe import hf_model

from jitllm.cli import main
from jitllm.convert import convert
from jitllm.core.errors import JitllmError
from jitllm.model import load
from jitllm.runtime.backends import fake
from jitllm.runtime.engine.expert_cache import ExpertSlots
from jitllm.runtime.engine.streaming import ExpertCache

PROMPT = list(range(3, 27))
STEPS = 8


@pytest.fixture(autouse=True)
def sim_devices(monkeypatch):
    monkeypatch.setenv(fake.ENABLE, "1")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("experts")
    out = {}
    for i, name in enumerate(("qwen3moe", "mixtral")):
        hf_model(name).save_pretrained(root / f"hf{i}")
        write_hf_tokenizer(root / f"hf{i}")
        convert(str(root / f"hf{i}"), str(root / f"{i}.jlm"), progress=False)
        out[name] = root / f"{i}.jlm"
    return out


def _load(path, cache_dir, devices="cpu", **options):
    return load(path, devices=devices, ctx=128, cache_dir=cache_dir, cpu_kernels="exact", **options)


def _run(model) -> list[np.ndarray]:
    """The prompt's last logits, then STEPS greedy steps'."""
    ex = model.executor
    session = ex.new_session()
    out = [ex.forward(session, PROMPT)]
    for _ in range(STEPS):
        out.append(ex.forward(session, [int(np.argmax(out[-1]))]))
    return out


def _recording(monkeypatch) -> list[tuple[int, np.ndarray]]:
    """Every (block, [rows, k] picks) the expert caches see, read from the router's own output tensor."""
    seen = []
    run = ExpertCache.run

    def recorded(self, index, x, h, ids, weights, shared):
        seen.append((index, ids.numpy().reshape(-1, self.kind.config.experts_used).copy()))
        return run(self, index, x, h, ids, weights, shared)

    monkeypatch.setattr(ExpertCache, "run", recorded)
    return seen


def _lru_misses(index: int, picks: np.ndarray, held: OrderedDict, capacity: int) -> int:
    """The misses of one call of a plain LRU over (block, expert) keys (a call's hits touched first, in
    expert order, then its misses placed, none evicting a key the call wants); `held` is updated."""
    keys = [(index, int(e)) for e in np.unique(picks)]
    misses = [k for k in keys if k not in held]
    for key in keys:
        if key in held:
            held.move_to_end(key)
    for key in misses:
        if len(held) >= capacity:
            del held[next(k for k in held if k not in keys)]
        held[key] = None
    return len(misses)


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_expert_streaming_matches_a_resident_run_within_the_budget(name, models, cache_dir, monkeypatch):
    path = models[name]
    resident = _load(path, cache_dir)
    probe = _load(path, cache_dir, "sim:0", stream_experts=True)
    rest = sum(u.nbytes for u in probe.executor.blocks) + probe.executor.head.nbytes
    expert = probe.executor.streams["sim:0"].experts.expert_bytes
    cfg = probe.executor.layout.config
    slots = cfg.experts_used + 1  # (fewer than one block's experts: tokens miss, the prompt runs in row groups)
    budget = rest + slots * expert + expert // 2
    seen = _recording(monkeypatch)
    model = _load(path, cache_dir, f"sim:0={budget}", stream_experts=True)
    ex, device = model.executor, model.devices["sim:0"]
    cache = ex.streams["sim:0"].experts
    assert cache.count == slots and all(u.experts is cache and u.weights is not None for u in ex.blocks)
    assert rest + cfg.experts * cfg.num_blocks * expert > budget  # the experts do not fit; the cache does
    assert device.used_bytes == rest + slots * expert <= budget
    assert all(np.array_equal(a, b) for a, b in zip(_run(model), _run(resident), strict=True))
    assert seen[0][1].shape == (len(PROMPT), cfg.experts_used)
    assert cache.uploaded_bytes == expert * cache.slots.misses

    # a fresh cache, decode steps only: each token uploads the LRU misses of the router's picks, no more
    model = _load(path, cache_dir, f"sim:0={budget}", stream_experts=True)
    ex, cache = model.executor, model.executor.streams["sim:0"].experts
    session, token, held = ex.new_session(), 5, OrderedDict()
    reference = resident.executor.new_session()
    for _ in range(STEPS):
        before, calls = cache.uploaded_bytes, len(seen)
        got = ex.forward(session, [token])
        want = resident.executor.forward(reference, [token])
        assert np.array_equal(got, want)
        step = seen[calls:]
        assert [i for i, _ in step] == list(range(cfg.num_blocks))
        assert all(len(set(p[0].tolist())) == cfg.experts_used for _, p in step)  # (top-k: distinct experts)
        misses = sum(_lru_misses(i, p, held, slots) for i, p in step)
        assert cache.uploaded_bytes - before == misses * expert
        token = int(np.argmax(got))
    assert cache.slots.misses < STEPS * cfg.num_blocks * cfg.experts_used  # (some hits: the sums above are not all)


def test_a_cache_for_every_expert_misses_once_per_expert(models, cache_dir, monkeypatch):
    seen = _recording(monkeypatch)
    model = _load(models["mixtral"], cache_dir, "sim:0=10M", stream_experts=True)
    cfg, cache = model.executor.layout.config, model.executor.streams["sim:0"].experts
    assert cache.count == cfg.num_blocks * cfg.experts  # (capped at every expert: the rest of 10M stays free)
    _run(model)
    picked = {(i, int(e)) for i, p in seen for e in p.ravel()}
    assert cache.slots.misses == cache.uploads == len(picked)
    assert cache.uploaded_bytes == len(picked) * cache.expert_bytes
    assert cache.slots.hits > 0


def test_expert_streaming_through_streamed_blocks(models, cache_dir):
    """`~` and expert streaming at once: the blocks' attention and router pass through the two slots, their
    experts through the cache of the same pool."""
    path = models["qwen3moe"]
    resident = _run(_load(path, cache_dir))
    model = _load(path, cache_dir, "sim:0=400k", stream_experts=True, placement="*=sim:0~")
    pool = model.executor.streams["sim:0"]
    assert sorted(pool.members) == [0, 1] and sorted(pool.experts.members) == [0, 1]
    assert all(np.array_equal(a, b) for a, b in zip(_run(model), resident, strict=True))
    assert pool.stats()["experts"]["misses"] == pool.experts.slots.misses > 0


def test_a_budget_without_room_for_one_tokens_experts_is_one_line(models, cache_dir):
    probe = _load(models["qwen3moe"], cache_dir, "sim:0", stream_experts=True)
    rest = sum(u.nbytes for u in probe.executor.blocks) + probe.executor.head.nbytes
    expert = probe.executor.streams["sim:0"].experts.expert_bytes
    with pytest.raises(JitllmError) as e:
        _load(models["qwen3moe"], cache_dir, f"sim:0={rest + expert + 100}", stream_experts=True)
    message = str(e.value)
    assert "\n" not in message and "room for 1 experts of 24.0 KiB, but a token routes to 2" in message


def test_cli_streams_experts_and_says_so(models, cache_dir, monkeypatch):
    monkeypatch.setenv("JITLLM_CACHE_DIR", str(cache_dir))

    def run(*flags):
        return CliRunner().invoke(main, ["run", "-n", "4", "-temp", "0", str(models["mixtral"]), "hello",
                                         "-cpu-kernels", "exact", *flags])

    monkeypatch.setenv("JITLLM_GPU_STREAM", "1")
    ok = run("-devices", "sim:0=300k", "-v")
    assert ok.exit_code == 0, ok.stderr
    assert "experts-streamed" in ok.stderr and "expert cache of 5 experts of 24.0 KiB" in ok.stderr
    assert "jitllm: experts streamed sim:0: 2 blocks stream their experts through a cache of 5 experts" in ok.stderr
    plain = run("-devices", "cpu")
    assert plain.stdout == ok.stdout
    small = run("-devices", "sim:0=200k")
    assert small.exit_code != 0 and small.stderr.strip().count("\n") == 0, small.stderr
    assert small.stderr.startswith("jitllm: error: JITLLM_GPU_STREAM=1: sim:0 has")
    monkeypatch.setenv("JITLLM_GPU_STREAM", "yes")
    bad = run("-devices", "sim:0=300k")
    assert bad.exit_code != 0 and "JITLLM_GPU_STREAM='yes': must be 0 or 1" in bad.stderr


@pytest.mark.parametrize("policy", ["lru", "decay"])
def test_expert_slots_keep_what_their_policy_says(policy):
    slots = ExpertSlots(3, policy)
    assert slots.place([(0, 1), (0, 2)])[1] == [((0, 1), 0), ((0, 2), 1)]
    for _ in range(3):
        slots.place([(0, 1), (0, 3)])  # (0, 1) picked often, (0, 2) once
    where, uploads = slots.place([(0, 2), (0, 4)])
    assert [k for k, _ in uploads] == [(0, 4)]
    # lru gives up (0, 1) (used before (0, 3)); decay gives up (0, 3) (used as recently but less often)
    assert uploads[0][1] == (0 if policy == "lru" else 2)
    assert slots.hits == 6 and slots.misses == 4
    with pytest.raises(JitllmError, match="4 experts at once do not fit"):
        slots.place([(1, 0), (1, 1), (1, 2), (1, 3)])
