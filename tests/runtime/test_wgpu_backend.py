"""Blocks on Vulkan through wgpu (lavapipe in CI: Mesa's CPU Vulkan, slow, so the models are tiny): every
step's logits those of the host's exact kernels, greedy tokens identical, blocks and the head moving
between the host and Vulkan mid-generation with their KV pages, and a decode step one submit whose
dispatches are recorded once and replayed. A missing adapter skips these (with the reason) on a developer's
machine and fails them where CI=true (CI installs lavapipe: .ci/run)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from reference import stepwise_logits

from jitllm.model import load
from jitllm.random_model import write_random_model
from jitllm.runtime.sampling import SamplingParams

pytestmark = pytest.mark.vulkan
PROMPT = list(range(4, 30))
MOVES = {2: "0=vulkan:0", 5: "head=vulkan:0", 9: "*=vulkan:0", 14: "0=host", 19: "*=host,head=host",
         23: "*=vulkan:0,head=vulkan:0"}


@pytest.fixture(scope="module")
def vulkan(setup_failed) -> str:
    try:
        import wgpu  # noqa: F401
    except ImportError:
        setup_failed("wgpu is not installed (pip install 'jitllm[vulkan]')")
    from jitllm.runtime.inventory import wgpu_adapters

    if not any(api == "vulkan" for _, api in wgpu_adapters()):
        setup_failed("no Vulkan adapter (apt-get install mesa-vulkan-drivers libvulkan1 gives lavapipe)")
    return "vulkan:0"


@pytest.fixture
def tvm_compiler() -> None:
    """The tests that build their kernels themselves (not through the cache) need TVM's compiler: skipped
    where TVM runs runtime-only (the GPU machine's install, TVM_USE_RUNTIME_LIB=1)."""
    if os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
        pytest.skip("builds its kernels with TVM's compiler; this TVM is runtime-only (TVM_USE_RUNTIME_LIB=1)")


def _stepwise(model, moves: dict[int, str], steps: int) -> list[np.ndarray]:
    return stepwise_logits(model, PROMPT, moves, steps)


def _close(expected: list[np.ndarray], got: list[np.ndarray]) -> None:
    worst = max(float(np.abs(a - b).max()) for a, b in zip(expected, got))
    assert worst < 1e-4 * max(float(np.abs(a).max()) for a in expected), worst
    assert [int(np.argmax(a)) for a in expected] == [int(np.argmax(b)) for b in got]


@pytest.fixture(scope="module")
def host_logits(tiny_model, cache_dir) -> list[np.ndarray]:
    host = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact")
    return _stepwise(host, {}, 28)


def test_blocks_move_between_vulkan_and_the_host_with_their_pages(vulkan, tiny_model, cache_dir, host_logits):
    moving = load(tiny_model, devices=vulkan, placement="*=host,head=host", ctx=128, cache_dir=cache_dir,
                  cpu_kernels="exact", no_gpu_fallback=True)
    got = _stepwise(moving, MOVES, 28)
    assert [u.device.name for u in moving.executor.blocks] == [vulkan] * len(moving.executor.blocks)
    assert moving.executor.head.device.name == vulkan
    _close(host_logits, got)


def test_greedy_tokens_on_vulkan_are_the_hosts(vulkan, tiny_model, cache_dir):
    greedy = SamplingParams(0.0)
    host = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact")
    on_vulkan = load(tiny_model, devices=vulkan, ctx=128, cache_dir=cache_dir, no_gpu_fallback=True)
    assert {u.device.name for u in on_vulkan.executor.blocks} == {vulkan}
    assert on_vulkan.executor.head.program_for(1).argmax is not None  # (the pick is made on the device)
    expected = list(host.generate_ids(PROMPT, 12, greedy))
    assert list(on_vulkan.generate_ids(PROMPT, 12, greedy)) == expected


def test_a_decode_step_is_one_submit_of_replayed_dispatches(vulkan, tiny_model, cache_dir):
    model = load(tiny_model, devices=vulkan, ctx=128, cache_dir=cache_dir, no_gpu_fallback=True)
    stats = model.devices[vulkan].backend.stats
    ex = model.executor
    session = ex.new_session()
    token = int(np.argmax(ex.forward(session, PROMPT)))
    prefilled = dict(stats)
    token = int(np.argmax(ex.forward(session, [token])))  # (the first decode step records)
    recorded = dict(stats)
    step = recorded["dispatches"] - prefilled["dispatches"]
    assert recorded["submits"] - prefilled["submits"] == 1
    assert step == 6 * len(ex.blocks) + 1  # (a block: norm+QKV, rotary+append+attention, its merge, O+add, norm+gate/up, down)
    for _ in range(3):
        token = int(np.argmax(ex.forward(session, [token])))
    assert stats["submits"] - recorded["submits"] == 3
    assert stats["dispatches"] - recorded["dispatches"] == 3 * step
    assert stats["reads"] - recorded["reads"] == 3  # (the logits, through the kept mappable buffer)
    assert stats["writes"] - recorded["writes"] == 3 * 2  # (x, and cos, sin and past in one buffer)
    assert (stats["pipelines"], stats["bind_groups"], stats["buffers"]) == (
        recorded["pipelines"], recorded["bind_groups"], recorded["buffers"])
    *_, token = ex.greedy_tokens(session, token, 3)  # (pipelined: captures its two slots' steps)
    before = dict(stats)
    assert len(list(ex.greedy_tokens(session, token, 3))) == 3
    assert any("pipelined" in key for key in ex._graphs)
    assert (stats["submits"] - before["submits"], stats["reads"] - before["reads"]) == (3, 3)  # (the token alone)
    assert stats["dispatches"] - before["dispatches"] == 3 * (step + 3)  # (and the embedding gather, the pick's two)


def test_decode_attention_past_one_chunk_of_history_gives_the_hosts_logits(vulkan, tiny_model, cache_dir):
    """The decode attention splits a history over chunks of 32 positions (kernels/webgpu/attention.tile) and
    merges them: steps of four and five chunks, the new position alone in the fifth, through the whole model."""
    prompt = [4 + i % 250 for i in range(126)]
    host = load(tiny_model, devices="cpu", ctx=160, cache_dir=cache_dir, cpu_kernels="exact")
    on_vulkan = load(tiny_model, devices=vulkan, ctx=160, cache_dir=cache_dir, no_gpu_fallback=True)
    _close(stepwise_logits(host, prompt, {}, 4), stepwise_logits(on_vulkan, prompt, {}, 4))


@pytest.mark.parametrize("wtype", ["f32", "f16", "q4_0", "q8_0"])  # (q4_1: the tiny model)
def test_each_weight_type_on_vulkan_gives_the_hosts_logits(vulkan, wtype, tmp_path, cache_dir):
    path = tmp_path / f"tiny-{wtype}.jlm"
    write_random_model(path, "tiny", wtype, seed=2)
    host = load(path, devices="cpu", ctx=64, cache_dir=cache_dir, cpu_kernels="exact")
    on_vulkan = load(path, devices=vulkan, ctx=64, cache_dir=cache_dir, no_gpu_fallback=True)
    _close(_stepwise(host, {}, 3), _stepwise(on_vulkan, {}, 3))


KERNEL_SHAPES = [(1, 1, [0]), (1, 3, [0]), (1, 1, [37]), (2, 3, [16, 5])]
"""(batch, new tokens, history per sequence): decode, a prompt, a page-crossing history, a ragged batch."""


@pytest.mark.parametrize("wtype", ["q4_1", "q8_0"])
def test_block_and_head_kinds_on_vulkan_against_numpy(vulkan, wtype, cache_dir):
    """A block kind's and a head's programs called straight on the backend over random weights and paged
    history, against tests/reference.py; the KV append and page export/import kernels too."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from reference import block_forward, head_forward, paged_inputs, random_weights

    from jitllm.ir.blocks import activation_inputs, weight_inputs
    from jitllm.ir.head import head_kind
    from jitllm.ir.llama import BLOCK_LINEARS, llama_block_kind
    from jitllm.lowering.cache import get_artifact
    from jitllm.lowering.target import kind_for_target
    from jitllm.lowering.targets.webgpu import WebGpuTarget
    from jitllm.random_model import PRESETS
    from jitllm.runtime.backends.wgpu import WgpuBackend

    target, cfg = WebGpuTarget(), PRESETS["tiny"]
    backend = WgpuBackend("vulkan", 0, vulkan, True)
    rng = np.random.default_rng(5)
    kind = kind_for_target(llama_block_kind(cfg, {n: wtype for n in BLOCK_LINEARS}), target)
    program = backend.load(get_artifact(kind, target, cache_dir).path, kind, True)
    weights = random_weights(kind, rng)
    names = [n for n, _, _ in activation_inputs(kind) + weight_inputs(kind)]
    for batch, seq, pasts in KERNEL_SHAPES:
        feeds = {**paged_inputs(kind, rng, batch, seq, pasts), **weights}
        inputs = [backend.upload(feeds[n]) for n in names]
        got = [backend.download(o) for o in program.main(*inputs)]
        ref = block_forward(kind, weights, **{n: feeds[n] for n, _, _ in activation_inputs(kind)})
        for a, b in zip(got, ref):
            assert np.abs(a - b).max() < 5e-5, (batch, seq, pasts)
        pages, table, past = (inputs[names.index(n)] for n in ("pages", "page_table", "past"))
        k, v = (backend.upload(r) for r in ref[1:])
        program.append(pages, k, v, table, past)
        pool = backend.download(pages)
        slot, at = feeds["page_table"][0, pasts[0] // kind.page_size], pasts[0] % kind.page_size
        assert np.array_equal(pool[slot, 0, :, at], ref[1][0, 0]) and np.array_equal(pool[slot, 1, :, at], ref[2][0, 0])
        ids = np.array([slot, 0], np.int32)
        out = backend.empty((2, *pool.shape[1:]), "float32")
        program.export_pages(pages, backend.upload(ids), out)
        assert np.array_equal(backend.download(out), pool[ids])
    head = kind_for_target(head_kind(cfg, wtype), target)
    program = backend.load(get_artifact(head, target, cache_dir).path, head, False)
    weights = random_weights(head, rng)
    x = rng.standard_normal((2, 3, cfg.hidden)).astype(np.float32)
    out = program.main(backend.upload(x), *[backend.upload(weights[n]) for n, _, _ in weight_inputs(head)])
    assert np.abs(backend.download(out) - head_forward(head, weights, x)).max() < 5e-5


def test_a_fault_on_vulkan_finishes_on_the_host(vulkan, tiny_model, cache_dir):
    from jitllm.runtime.backends import make_device
    from jitllm.runtime.backends.fake import with_faults
    from jitllm.runtime.device_spec import parse_devices
    from jitllm.runtime.inventory import detect_inventory

    host = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact")
    expected = list(host.generate_ids(PROMPT, 12, SamplingParams(0.0)))
    device = with_faults(make_device(parse_devices(vulkan, detect_inventory())[0]))
    model = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", extra_devices=[device])
    model.move("*", vulkan)
    model.move("head", vulkan)
    out = []
    for i, token in enumerate(model.generate_tokens(PROMPT, 12, SamplingParams(0.0))):
        out.append(token)
        if i == 3:
            device.backend.faults.launch = True
    assert out == expected
    assert {u.device.name for u in model.executor.blocks} == {"host"}


def test_the_cli_runs_and_moves_blocks_on_vulkan_with_the_hosts_tokens(vulkan, tiny_model, cache_dir):
    import subprocess
    import sys

    def run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "jitllm", "run", "-n", "10", "-temp", "0", "-cpu-kernels", "exact",
                               "-cache", str(cache_dir), *flags, str(tiny_model), "hello"],
                              capture_output=True, text=True, timeout=600)

    host, moving = run("-devices", "cpu"), run("-devices", vulkan, "-move-at", "4:0=host,head=host")
    assert host.returncode == 0 and moving.returncode == 0, moving.stderr
    assert moving.stdout == host.stdout
    assert f"moved block 0 {vulkan} -> host" in moving.stderr and f"moved head {vulkan} -> host" in moving.stderr


def test_speed_measures_vulkan_beside_the_host(vulkan, tiny_model, cache_dir):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "jitllm", "speed", "-targets", "llvm,vulkan", "-p", "8", "-n", "2",
                          "-r", "1", "-cache", str(cache_dir), str(tiny_model)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in out.stdout.splitlines()
            if line.startswith("| tiny")]
    assert [(r[2], r[3], r[4]) for r in rows] == [("llvm", "host", "pp8"), ("llvm", "host", "tg2"),
                                                   ("vulkan", "vulkan", "pp8"), ("vulkan", "vulkan", "tg2")]


@pytest.mark.parametrize("wtype,family", [("f32", "Linear"), ("f16", "RmsNormLinear"), ("q8_0", "SwiGLULinearAdd"),
                                          ("q4_0", "LinearAdd"), ("q4_1", "RmsNormLinear"), ("q4_1", "SwiGLULinearAdd")])
def test_decode_matvecs_against_numpy(vulkan, tvm_compiler, wtype, family):
    """kernels/webgpu/linear.gemv_kernel called straight on the backend: 16-byte loads over a shape with two row
    groups per workgroup (256 groups), several loads a thread and a ragged last step (k = 608), each fold."""
    from jitllm.core.quant import dequantize, parts_from_float
    from jitllm.lowering.kernel_package import build_package
    from jitllm.lowering.kernels.webgpu.linear import gemv_kernel, groups_per_workgroup
    from jitllm.lowering.targets.webgpu import WebGpuTarget
    from jitllm.runtime.backends.wgpu import WgpuBackend
    from jitllm.runtime.backends.wgpu_plan import HostFunction, Kernels

    n, k, eps = 2048, 608, 1e-5
    assert groups_per_workgroup(n // 8) == 2
    rng = np.random.default_rng(3)
    parts = parts_from_float(wtype, rng.standard_normal((n, k)).astype(np.float32) * 0.1)
    w = dequantize(wtype, parts)
    x = rng.standard_normal((1, 2 * k if family == "SwiGLULinearAdd" else k)).astype(np.float32)
    nw, res = rng.standard_normal(k).astype(np.float32), rng.standard_normal((1, n // 8, 8)).astype(np.float32)
    if family == "SwiGLULinearAdd":
        xin = x[:, :k] / (1 + np.exp(-x[:, :k])) * x[:, k:]
    elif family == "RmsNormLinear":
        xin = x / np.sqrt((x * x).mean() + eps) * nw
    else:
        xin = x
    want = (xin @ w.T).reshape(1, n // 8, 8) + (res if family.endswith("Add") else 0)
    symbol, func = gemv_kernel(wtype, n, k, family, eps)
    import tvm

    package = build_package(tvm.IRModule({symbol: func}), WebGpuTarget().tvm_target())
    backend = WgpuBackend("vulkan", 0, vulkan, True)
    run = HostFunction(symbol, package["functions"][symbol], Kernels(backend, package["kernels"]))
    y = backend.empty((1, n // 8, 8), "float32")
    names = [p.name for p in func.params]
    feeds = {"x": x, "nw": nw, "res": res, "w": parts.get("w", parts.get("qs")), "d": parts.get("d"),
             "mn": parts.get("m")}
    run(*[backend.upload(feeds[name]) for name in names[:-1]], y)
    got = backend.download(y)
    assert np.abs(got - want).max() < 2e-5 * max(1.0, float(np.abs(want).max())), np.abs(got - want).max()


def test_a_packages_pipelines_are_created_at_once_and_once(vulkan, monkeypatch):
    """WgpuBackend.pipelines creates the kernels not made yet in parallel (each creation here waits until the
    other one has begun: one after another, the barrier breaks) and none a second time."""
    import threading

    from jitllm.runtime.backends.wgpu import WgpuBackend

    backend = WgpuBackend("vulkan", 0, vulkan, True)
    wgsl = "@group(0) @binding(0) var<storage, read_write> y : array<f32>;\n" \
           "@compute @workgroup_size(1) fn {name}() {{ y[0] = {value}; }}\n"
    kernels = {f"k{i}": wgsl.format(name=f"k{i}", value=f"{i}.0") for i in range(2)}
    both_begun, create = threading.Barrier(2, timeout=20), backend._create_pipeline

    def meeting(name: str, source: str):
        both_begun.wait()
        return create(name, source)

    monkeypatch.setattr(backend, "_create_pipeline", meeting)
    made = backend.pipelines(kernels)
    assert set(made) == set(kernels) and backend.stats["pipelines"] == 2
    assert backend.pipelines(kernels) == made and backend.stats["pipelines"] == 2


@pytest.mark.parametrize("mode", ["timestamps", "submit"])
def test_a_profile_times_every_dispatch_of_a_decode_step_once(vulkan, tiny_model, cache_dir, monkeypatch, mode):
    """bench/vulkan_decode.py -profile: a profiled decode step lists the dispatches an unprofiled one encodes,
    each once and in order, with non-negative times; the timer then leaves the backend as it was."""
    from jitllm.runtime.backends.wgpu_profile import table, timer

    model = load(tiny_model, devices=vulkan, ctx=128, cache_dir=cache_dir, no_gpu_fallback=True)
    backend = model.devices[vulkan].backend
    if mode == "timestamps" and "timestamp-query" not in backend.device.features:
        pytest.skip("the adapter lacks timestamp-query")
    ex = model.executor
    session = ex.new_session()
    token = int(np.argmax(ex.forward(session, PROMPT)))
    token = int(np.argmax(ex.forward(session, [token])))  # (the first decode step records)
    encoded, encode = [], backend._encode
    monkeypatch.setattr(backend, "_encode", lambda ds: (encoded.extend((d.kernel, d.groups) for d in ds), encode(ds)))
    token = int(np.argmax(ex.forward(session, [token])))
    monkeypatch.undo()
    assert len(encoded) == 6 * len(ex.blocks) + 1 and all(kernel for kernel, _ in encoded)
    backend.timer = timer(mode, backend)
    logits = ex.forward(session, [token])
    entries = backend.timer.entries()
    backend.timer = None
    assert [(kernel, groups) for kernel, groups, _ in entries] == encoded
    assert all(seconds >= 0 for *_, seconds in entries) and sum(s for *_, s in entries) > 0
    rows = table(entries, 1)
    assert sum(row[1] for row in rows) == len(encoded) and abs(sum(row[3] for row in rows) - 1) < 1e-9
    before = dict(backend.stats)
    assert int(np.argmax(ex.forward(session, [int(np.argmax(logits))]))) >= 0
    assert backend.stats["submits"] - before["submits"] == 1  # (unprofiled again: one submit a step)


def test_a_profile_without_timestamps_is_one_line_naming_the_fallback():
    from types import SimpleNamespace

    from jitllm.core.errors import JitllmError
    from jitllm.runtime.backends.wgpu_profile import SubmitTimer, timer

    lacking = SimpleNamespace(device=SimpleNamespace(features=set()), device_name="vulkan:0")
    with pytest.raises(JitllmError, match="lacks timestamp-query.*-profile submit"):
        timer("timestamps", lacking)
    assert isinstance(timer("submit", lacking), SubmitTimer)


SPLIT_SHAPES = [(4, 2, 16, True), (4, 2, 16, False), (6, 2, 64, True), (2, 1, 128, True)]
"""(heads, KV heads, head_dim, rotary): the tiny model's (also its variant taking q, k, v already rotated),
SmolLM2's group of three at its head_dim, and a 16-position tile (kernels/webgpu/attention.tile)."""
SPLIT_HISTORIES = [0, 20, 31, 32, 100, 1100]
"""`past`: the new row alone, one chunk crossing a page, one full tile, the new row alone in a second chunk,
four chunks (the last ragged), and 18 chunks of two tiles each (kernels/webgpu/attention.CHUNKS)."""


def _split_attention_case(heads: int, kv_heads: int, head_dim: int, rotary: bool):
    """The decode attention kernel of such a kind as a package function on a backend: (kind, function)."""
    import dataclasses

    import tvm

    from jitllm.ir.llama import BLOCK_LINEARS, llama_block_kind
    from jitllm.lowering.kernel_package import build_package
    from jitllm.lowering.kernels.webgpu.attention import decode_attention_kernel
    from jitllm.lowering.targets.webgpu import WebGpuTarget
    from jitllm.random_model import PRESETS

    cfg = dataclasses.replace(PRESETS["tiny"], heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    kind = llama_block_kind(cfg, {n: "f32" for n in BLOCK_LINEARS}).decode_variant()
    symbol, func = decode_attention_kernel(kind, rotary)
    return kind, build_package(tvm.IRModule({symbol: func}), WebGpuTarget().tvm_target()), symbol


@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary", SPLIT_SHAPES)
def test_split_decode_attention_against_numpy(vulkan, tvm_compiler, heads, kv_heads, head_dim, rotary):
    """kernels/webgpu/attention.py called straight on the backend (rotary, append and the chunks' merge),
    histories of one chunk to many over shuffled pages, against numpy: the output, the rotated k and v, and
    the pages (the new row written, nothing else changed)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from reference import rope, rope_tables

    from jitllm.runtime.backends.wgpu import WgpuBackend
    from jitllm.runtime.backends.wgpu_plan import HostFunction, Kernels

    kind, package, symbol = _split_attention_case(heads, kv_heads, head_dim, rotary)
    backend = WgpuBackend("vulkan", 0, vulkan, True)
    run = HostFunction(symbol, package["functions"][symbol], Kernels(backend, package["kernels"]))
    H, HKV, D, P = heads, kv_heads, head_dim, kind.page_size
    rng = np.random.default_rng(7)
    for past in SPLIT_HISTORIES:
        n_pages = past // P + 1
        pool = rng.standard_normal((n_pages + 2, 2, HKV, P, D)).astype(np.float32)
        table = rng.permutation(n_pages + 2)[None, :n_pages].astype(np.int32)
        qkv = rng.standard_normal((1, 1, (H + 2 * HKV) * D)).astype(np.float32)
        cos, sin = rope_tables(np.array([[past]]), D, 10000.0)
        heads_of = qkv.reshape(1, 1, H + 2 * HKV, D)
        turn = (lambda x: rope(x, cos, sin)) if rotary else (lambda x: x)  # noqa: E731
        q = turn(heads_of[:, :, :H])[0, 0] / np.sqrt(D)
        k_new, v_new = turn(heads_of[:, :, H:H + HKV])[0, 0], heads_of[0, 0, H + HKV:]
        rows = np.arange(past + 1)
        want_pool = pool.copy()
        want_pool[table[0, past // P], 0, :, past % P] = k_new
        want_pool[table[0, past // P], 1, :, past % P] = v_new
        keys = want_pool[table[0, rows // P], 0][np.arange(past + 1), :, rows % P]  # [positions, HKV, D]
        values = want_pool[table[0, rows // P], 1][np.arange(past + 1), :, rows % P]
        group = np.repeat(np.arange(HKV), H // HKV)
        scores = np.einsum("hd,phd->hp", q.astype(np.float64), keys[:, group])
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        want = np.einsum("hp,phd->hd", weights / weights.sum(axis=1, keepdims=True), values[:, group])
        pages = backend.upload(pool)
        shapes = [(H, 32, D + 2), (1, 1, H, D)] + [(1, 1, HKV, D)] * (2 if rotary else 0)
        outs = [backend.empty(s, "float32") for s in shapes]
        if rotary:
            ins = [backend.upload(qkv), backend.upload(cos), backend.upload(sin)]
        else:
            ins = [backend.upload(np.ascontiguousarray(heads_of[:, :, a:b])) for a, b in
                   ((0, H), (H, H + HKV), (H + HKV, H + 2 * HKV))]
        run(*ins, pages, backend.upload(table), backend.upload(np.array([past], np.int32)),
            backend.upload(np.zeros(1, np.uint32)), *outs)
        got = backend.download(outs[1])
        assert np.abs(got[0, 0] - want).max() < 2e-5, (past, np.abs(got[0, 0] - want).max())
        if rotary:
            k_got, v_got = backend.download(outs[2]), backend.download(outs[3])
            assert np.abs(k_got[0, 0] - k_new).max() < 1e-6 and np.array_equal(v_got[0, 0], v_new), past
        assert np.abs(backend.download(pages) - want_pool).max() < 1e-6, past


def test_the_greedy_pick_is_numpys_argmax_ties_to_the_lowest_index(vulkan, tvm_compiler):
    """kernels/webgpu/argmax.py (a workgroup per 1,024 logits, then one over their picks) on the backend:
    random logits, the largest value repeated within a slice and across slices (the lowest index wins),
    the largest in the ragged last slice, and every logit equal."""
    import tvm

    from jitllm.lowering.kernel_package import build_package
    from jitllm.lowering.kernels.webgpu.argmax import SPAN, argmax_kernel
    from jitllm.lowering.targets.webgpu import WebGpuTarget
    from jitllm.runtime.backends.wgpu import WgpuBackend
    from jitllm.runtime.backends.wgpu_plan import HostFunction, Kernels

    vocab = 4 * SPAN + 200
    symbol, func = argmax_kernel(vocab)
    package = build_package(tvm.IRModule({symbol: func}), WebGpuTarget().tvm_target())
    grids = [step[4] for step in package["functions"][symbol]["steps"] if step[0] == "launch"]
    assert grids == [[5, 256], [1, 256]]  # (five slices, the last ragged; then their pick)
    backend = WgpuBackend("vulkan", 0, vulkan, True)
    run = HostFunction(symbol, package["functions"][symbol], Kernels(backend, package["kernels"]))
    rng = np.random.default_rng(11)
    cases = []
    for ties in ([3 * SPAN + 7, 3 * SPAN + 300, SPAN + 900], [SPAN + 5, SPAN + 261, SPAN + 1000], [vocab - 1],
                 [2 * SPAN + 256, 2 * SPAN]):
        logits = rng.standard_normal(vocab).astype(np.float32)
        logits[ties] = 9.0
        cases.append(logits)
    cases.append(np.full(vocab, -2.5, np.float32))
    for logits in cases:
        token = backend.empty((1,), "int32")
        run(backend.upload(logits.reshape(1, 1, vocab)), token)
        assert int(backend.download(token)[0]) == int(np.argmax(logits))
