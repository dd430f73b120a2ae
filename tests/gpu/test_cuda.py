"""CUDA: every block kind against the numpy reference, the tiny model split across host and GPU, and
live migration host <-> cuda:0 with identical greedy tokens. Skipped where no CUDA device exists."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from kinds import f16_kv_test_kinds, format_test_kinds, gpu_test_kinds, q8_kv_test_kinds
from reference import block_forward, head_forward, paged_inputs, pool_values, random_weights, rows_with_q8_scales

from jitllm.ir.blocks import activation_inputs, weight_inputs

from cuda_check import cuda_available

pytestmark = pytest.mark.gpu


if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

TOL = 5e-5


@pytest.mark.parametrize("kind", gpu_test_kinds()[:10] + gpu_test_kinds()[12:22] + format_test_kinds()
                         + f16_kv_test_kinds() + q8_kv_test_kinds(),
                         ids=lambda k: f"{k.kind}-{'+'.join(sorted({s.wtype for s in k.linears}))}"
                                       f"{'-decode' if k.decode else ''}{'-kv_' + k.kv_type if k.kv_type != 'f32' else ''}"
                                       f"{'-' + str(k.config.hidden) if k.kv_type != 'f32' else ''}")
def test_block_kind_on_cuda(kind, cache_dir):
    """Every kind's kernels against numpy; bf16 and the 5/6-bit and K-quant formats (format_test_kinds)
    through their own decode matvecs, TE prefill linears and embedding gathers (kernels/cuda/wide.py); kinds
    over an f16 KV pool (f16_kv_test_kinds: the reference reads the same f16 values, so the same TOL) and over
    a q8_0 one (q8_kv_test_kinds: the reference dequantizes the same rows with gguf's Q8_0)."""
    from jitllm.lowering.cache import get_artifact
    from jitllm.lowering.targets.cuda import CudaTarget
    from jitllm.runtime.backends.cuda import cuda_arch
    from jitllm.runtime.backends.tvm_tensors import load_program

    dev = tvm.cuda(0)
    program = load_program(get_artifact(kind, CudaTarget(cuda_arch(0)), cache_dir).path, dev, kind.kind == "llama")
    rng = np.random.default_rng(5)
    weights = random_weights(kind, rng)
    up = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
    # decode: 1, 2, 10 and 33 chunks of history, then 10 again (the split attention's arrival counters are
    # back at 0 after every launch)
    shapes = [(1, 1, [0]), (1, 1, [37]), (1, 1, [300]), (1, 1, [2100]), (1, 1, [300])] if kind.decode else [(1, 5, [0]), (1, 1, [37]), (2, 3, [16, 5]), (1, 1, [300])]
    if kind.kind == "head":
        x = rng.standard_normal((1, 1, kind.config.hidden) if kind.decode else (2, 3, kind.config.hidden)).astype(np.float32)
        out = program.main(up(x), *[up(weights[n]) for n, _, _ in weight_inputs(kind)]).numpy()
        assert np.abs(out - head_forward(kind, weights, x)).max() < TOL
        assert (program.embed is None) == kind.decode  # the general head gathers embedding rows too
        if program.embed is not None:  # rows of its weight (a tied head's = the embedding table), as the host
            from jitllm.core.quant import dequantize_rows

            names = [n for n, _, _ in weight_inputs(kind)][1:]
            ids = np.array([[0, 7, 8, kind.config.vocab - 1, kind.config.vocab // 2 + 3, 7]], np.int32)
            rows = tvm.runtime.empty((1, 6, kind.config.hidden), "float32", dev)
            program.embed(up(ids), *[up(weights[n]) for n in names], rows)
            host = dequantize_rows(kind.linears[0].wtype, {n.split("_", 1)[1]: weights[n] for n in names}, ids[0])
            np.testing.assert_allclose(rows.numpy()[0], host, rtol=1e-6, atol=1e-7)  # (GPU: d * q + m as one FMA)
        return
    for batch, seq, pasts in shapes:
        feeds = {**paged_inputs(kind, rng, batch, seq, pasts), **weights}
        names = [n for n, _, _ in activation_inputs(kind) + weight_inputs(kind)]
        inputs = [up(feeds[n]) for n in names]
        got = [o.numpy() for o in program.main(*inputs)]
        ref = block_forward(kind, weights, **{n: feeds[n] for n, _, _ in activation_inputs(kind)})
        for a, b in zip(got, ref):
            assert np.abs(a - b).max() < TOL, (batch, seq, pasts)
        if kind.decode:  # the decode main appends the step's K and V to the pages itself
            pages, past = inputs[names.index("pages")].numpy(), pasts[0]
            slot = feeds["page_table"][0, past // kind.page_size]
            for two, new in ((0, got[1][0, 0]), (1, got[2][0, 0])):
                row = pages[slot, two, :, past % kind.page_size]
                if kind.kv_type == "q8_0":  # each value within half a step of its block's scale, plus what
                    # storing the scale as f16 moves the largest quant (127 of them: ggml quantizes with the f32 d)
                    step = np.abs(new).reshape(*new.shape[:-1], -1, 32).max(-1, keepdims=True) / 127
                    f16_error = 127 * np.abs(step.astype(np.float16).astype(np.float32) - step)
                    err = np.abs(pool_values(kind, row) - new).reshape(step.shape[:-1] + (32,))
                    assert (err <= 0.5 * step * 1.002 + f16_error + 1e-30).all(), (two, pasts)
                else:
                    assert np.array_equal(row, new.astype(pages.dtype))


SCALE_BITS = np.array([0x26DA, 0x2612, 0x2680, 0x267F, 0x2600, 0x20FF, 0x2A01, 0x1C80, 0x3C00, 0x4A3F, 0x0000],
                      np.uint16)
"""f16 scales whose low bytes lie below and at or above 0x80 (0x26DA: the one the H200 stored as 0x2600 on
2026-12-03), scales of 1 and 12.49 (low bytes 0x00, 0x3F), and a block of zeros."""


def _stored_scales(kind, rows: np.ndarray) -> np.ndarray:
    """The f16 bits of q8_0 rows' scales [..., blocks]."""
    return np.ascontiguousarray(rows[..., kind.config.head_dim:]).view("<u2")


@pytest.mark.parametrize("kind", [k for k in q8_kv_test_kinds() if not k.decode], ids=lambda k: f"d{k.config.head_dim}")
def test_kv_q8_0_append_stores_each_scale_bit_for_bit(kind, cache_dir):
    """The append kernel's q8_0 rows byte for byte against numpy's (quants and each block's f16 scale bits,
    low bytes both below and from 0x80): nvcc 13.0's ptxas turned the byte store of a half's low byte into
    a float-to-integer conversion of the half (docs/model-format.md), which this fails on."""
    from jitllm.lowering.cache import get_artifact
    from jitllm.lowering.targets.cuda import CudaTarget
    from jitllm.runtime.backends.cuda import cuda_arch
    from jitllm.runtime.backends.tvm_tensors import load_program

    dev = tvm.cuda(0)
    program = load_program(get_artifact(kind, CudaTarget(cuda_arch(0)), cache_dir).path, dev, True)
    c, p, rng = kind.config, kind.page_size, np.random.default_rng(11)
    seq, blocks = 5, c.head_dim // 32
    bits = np.resize(SCALE_BITS, (2, 1, seq, c.kv_heads, blocks))  # K and V of 5 positions
    assert ((bits & 0xFF) < 0x80).any() and ((bits & 0xFF) >= 0x80).any()
    values, expected = rows_with_q8_scales(bits, rng)
    pages = np.zeros((3, 2, c.kv_heads, p, kind.kv_row), np.int8)
    past, table = 13, np.array([[2, 0]], np.int32)  # positions 13..17: the end of page 2, the start of page 0
    up = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
    pool = up(pages)
    program.append(pool, up(values[0]), up(values[1]), up(table), up(np.array([past], np.int32)))
    got = pool.numpy()
    for s in range(seq):
        page, slot = table[0, (past + s) // p], (past + s) % p
        for two in range(2):
            np.testing.assert_array_equal(_stored_scales(kind, got[page, two, :, slot]), bits[two, 0, s])
            np.testing.assert_array_equal(got[page, two, :, slot], expected[two, 0, s])


@pytest.mark.parametrize("kind", [k for k in q8_kv_test_kinds() if k.decode], ids=lambda k: f"d{k.config.head_dim}")
def test_kv_q8_0_decode_append_stores_each_scale_bit_for_bit(kind, cache_dir):
    """The decode step's own append (inside the split attention): each stored scale is the f16 of its block's
    amax / 127 over the step's returned K and V rows, bit for bit (either f32 division: nvcc's fast math
    multiplies by 1 / 127; amax within an ulp: the kernel recomputes the rotated values for the max, maybe
    contracted otherwise), over steps whose scales' low bytes fall on both sides of 0x80."""
    from jitllm.lowering.cache import get_artifact
    from jitllm.lowering.targets.cuda import CudaTarget
    from jitllm.runtime.backends.cuda import cuda_arch
    from jitllm.runtime.backends.tvm_tensors import load_program

    dev = tvm.cuda(0)
    program = load_program(get_artifact(kind, CudaTarget(cuda_arch(0)), cache_dir).path, dev, False)
    rng = np.random.default_rng(13)
    weights = random_weights(kind, rng)
    up = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
    names = [n for n, _, _ in activation_inputs(kind) + weight_inputs(kind)]
    low = []
    for past in (0, 5, 37, 300):
        feeds = {**paged_inputs(kind, rng, 1, 1, [past]), **weights}
        inputs = [up(feeds[n]) for n in names]
        got = [o.numpy() for o in program.main(*inputs)]
        pages = inputs[names.index("pages")].numpy()
        slot = feeds["page_table"][0, past // kind.page_size]
        for two, new in ((0, got[1][0, 0]), (1, got[2][0, 0])):
            amax = np.abs(new).reshape(*new.shape[:-1], -1, 32).max(-1)
            stored = _stored_scales(kind, pages[slot, two, :, past % kind.page_size])
            near = [amax, np.nextafter(amax, np.float32(0)), np.nextafter(amax, np.float32(np.inf))]
            ok = [(a / np.float32(127)).astype(np.float16).view("<u2") == stored for a in near] + \
                 [(a * (np.float32(1) / np.float32(127))).astype(np.float16).view("<u2") == stored for a in near]
            assert np.logical_or.reduce(ok).all(), (past, two, stored, (amax / 127).astype(np.float16).view("<u2"))
            low += list((stored & 0xFF).ravel())
    assert min(low) < 0x80 <= max(low)  # (the data covers both halves of the low byte)


FAST_TOL = 3e-2
"""The fast family (int8 activations in decode, f16 tensor-core operands in prefill): error relative to
the largest output, as the CPU fast kernels' tests allow (tests/lowering/test_cpu_kernels.py)."""


def _fast_kinds():
    """Kinds whose fast-family kernels differ from the exact ones: quantized decode steps (int8
    activations) and every prefill block (f16 tensor-core operands in the linears and the attention)."""
    kinds = gpu_test_kinds()
    return [k for k in kinds if k.decode and k.linears[0].wtype.startswith("q")] + \
        [k for k in kinds if not k.decode and k.kind != "head"]


@pytest.mark.parametrize("kind", _fast_kinds(),
                         ids=lambda k: f"{k.kind}-{k.linears[0].wtype}-{k.config.hidden}{'-decode' if k.decode else ''}")
def test_fast_kinds_on_cuda(kind, cache_dir):
    """The fast family's kinds against the numpy reference, and against the exact family's kernels on the
    same inputs: close, but not the same numbers (the fast path ran). Prefill runs two tiles of queries
    over a history and a batch of two sequences with different histories."""
    from jitllm.lowering.cache import get_artifact
    from jitllm.lowering.targets.cuda import CudaTarget
    from jitllm.runtime.backends.cuda import cuda_arch
    from jitllm.runtime.backends.tvm_tensors import load_program

    dev = tvm.cuda(0)
    fast, exact = (load_program(get_artifact(kind, CudaTarget(cuda_arch(0), k), cache_dir).path, dev,
                                kind.kind == "llama") for k in ("fast", "exact"))
    rng = np.random.default_rng(7)
    weights = random_weights(kind, rng)
    up = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
    if kind.kind == "head":
        x = rng.standard_normal((1, 1, kind.config.hidden)).astype(np.float32)
        args = lambda: [up(x), *[up(weights[n]) for n, _, _ in weight_inputs(kind)]]  # noqa: E731
        got, base, ref = fast.main(*args()).numpy(), exact.main(*args()).numpy(), head_forward(kind, weights, x)
        assert np.abs(got - ref).max() < FAST_TOL * np.abs(ref).max()
        assert 0 < np.abs(got - base).max() < FAST_TOL * np.abs(ref).max()
        return
    for batch, seq, pasts in [(1, 1, [37])] if kind.decode else [(1, 70, [33]), (2, 3, [16, 5])]:
        feeds = {**paged_inputs(kind, rng, batch, seq, pasts), **weights}
        names = [n for n, _, _ in activation_inputs(kind) + weight_inputs(kind)]
        got, base = (program.main(*[up(feeds[n]) for n in names])[0].numpy() for program in (fast, exact))
        ref = block_forward(kind, weights, **{n: feeds[n] for n, _, _ in activation_inputs(kind)})[0]
        scale = np.abs(ref - feeds["x"]).max()  # the block's own contribution, beside the residual
        assert np.abs(got - ref).max() < FAST_TOL * scale, (batch, seq, pasts)
        assert 0 < np.abs(got - base).max() < FAST_TOL * scale, (batch, seq, pasts)


def test_tiny_model_split_and_migration_match_the_host(tiny_model, cache_dir):
    from jitllm.model import load

    prompt = list(range(4, 30))
    host = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact").generate_ids(prompt, 24)
    on_gpu = load(tiny_model, devices="cuda:0", ctx=128, cache_dir=cache_dir, cpu_kernels="exact",
                  gpu_kernels="exact")
    assert all(u.device.name == "cuda:0" for u in on_gpu.executor.blocks)
    assert on_gpu.devices["cuda:0"].target.kernels == "exact"
    assert on_gpu.generate_ids(prompt, 24) == host
    split = load(tiny_model, devices="cuda:0", placement="0=cuda:0,1=host,head=cuda:0", ctx=128, cache_dir=cache_dir,
                 cpu_kernels="exact", gpu_kernels="exact")
    assert split.generate_ids(prompt, 24) == host
    split.move_schedule = {3: ["1=cuda:0"], 6: ["0=host,head=host"], 10: ["*=cuda:0,head=cuda:0"], 15: ["0=host"]}
    assert split.generate_ids(prompt, 24) == host


def test_q8_0_kv_on_cuda_matches_the_host(tiny_d32, cache_dir):
    """q8_0 pages on the GPU (the appends quantize as the host's do) give the host's greedy tokens, alone,
    split, and through moves (q8_0 pages copied between the two pools)."""
    from jitllm.model import load

    prompt, opts = list(range(4, 30)), dict(ctx=128, cache_dir=cache_dir, cpu_kernels="exact", kv_type="q8_0")
    host = load(tiny_d32, devices="cpu", **opts).generate_ids(prompt, 24)
    on_gpu = load(tiny_d32, devices="cuda:0", gpu_kernels="exact", **opts)
    assert on_gpu.executor.pools["cuda:0"].dtype == "int8"
    assert on_gpu.generate_ids(prompt, 24) == host
    split = load(tiny_d32, devices="cuda:0", placement="0=cuda:0,1=host,head=cuda:0", gpu_kernels="exact", **opts)
    split.move_schedule = {3: ["1=cuda:0"], 6: ["0=host,head=host"], 10: ["*=cuda:0,head=cuda:0"], 15: ["0=host"]}
    assert split.generate_ids(prompt, 24) == host


def test_captured_steps_carry_their_inputs_and_logits(tiny_model, cache_dir):
    """Replayed decode steps (inputs and logits through pinned host arrays, copied by the graph's own
    nodes) give the logits of eager steps, token by token."""
    from jitllm.model import load

    prompt = list(range(4, 30))
    graphs = load(tiny_model, devices="cuda:0", ctx=128, cache_dir=cache_dir).executor
    eager = load(tiny_model, devices="cuda:0", ctx=128, cache_dir=cache_dir).executor
    eager.graphs = False
    a_session, b_session = graphs.new_session(), eager.new_session()
    a, b = graphs.forward(a_session, prompt), eager.forward(b_session, prompt)
    for _ in range(8):
        token = int(b.argmax())
        a, b = graphs.forward(a_session, [token]), eager.forward(b_session, [token])
        assert np.abs(a - b).max() < 1e-5
    assert len(graphs._graphs) == 1
    assert graphs.head.device.target.kernels == "fast"  # the default family: int8 matvecs in the graph
    assert a_session.step_inputs["cuda:0"].staging.transfers is graphs.head.device.graphs


def test_the_device_picks_the_greedy_token_as_numpy_does(tiny_model, cache_dir):
    """The GPU head's greedy pick (lowering.ARGMAX_FUNCTION) is numpy's argmax of the logits (ties to the
    first index, all -inf to 0), and greedy steps (their own captured graphs, ending with the pick) give
    the tokens of picking from the downloaded logits."""
    from jitllm.model import load

    ex = load(tiny_model, devices="cuda:0", ctx=128, cache_dir=cache_dir).executor
    pick, dev, vocab = ex.head.program_for(1).argmax, ex.head.device, ex.layout.config.vocab
    assert pick is not None
    rng = np.random.default_rng(0)
    tied, last = rng.standard_normal(vocab), rng.standard_normal(vocab)
    tied[[7, vocab - 3]] = tied.max() + 1
    last[-1] = 100
    for logits in (rng.standard_normal(vocab), np.full(vocab, -np.inf), np.zeros(vocab), tied, last):
        token = dev.empty((1,), "int32")
        pick(dev.upload(logits.astype(np.float32)[None, None]), token)
        assert int(token.numpy()[0]) == int(np.argmax(logits))
    greedy, reference = ex.new_session(), ex.new_session()
    prompt = list(range(4, 30))
    a, b = ex.next_token(greedy, prompt), int(np.argmax(ex.forward(reference, prompt)))
    for _ in range(8):
        assert a == b
        a, b = ex.next_token(greedy, [a]), int(np.argmax(ex.forward(reference, [b])))
    assert {key[2] for key in ex._graphs} == {True, False}  # (one segment: the blocks and the head)


def test_pipelined_greedy_steps_match_plain_ones_through_moves(tiny_model, cache_dir):
    """Greedy decode launches each step before reading the token of the one before (Executor.greedy_tokens:
    the graph gathers its input row from the pick on the device). Its tokens and the KV it leaves are those
    of plain eager steps, with a block moved to the host and back while a step is in flight (the move waits
    for it; steps with the block away are plain ones, and the pipeline is captured again after it comes
    back, over the moved buffers), and after the consumer stops early (the step in flight is uncounted)."""
    from jitllm.model import load

    prompt = list(range(4, 30))
    model = load(tiny_model, devices="cuda:0", ctx=128, cache_dir=cache_dir, cpu_kernels="exact")
    eager = load(tiny_model, devices="cuda:0", ctx=128, cache_dir=cache_dir, cpu_kernels="exact")
    eager.executor.graphs = False
    moves = {8: ("1", "host"), 12: ("1", "cuda:0"), 20: ("*", "cuda:0")}
    ex, ref = model.executor, eager.executor
    session, reference = ex.new_session(), ref.new_session()
    first = ex.next_token(session, prompt)
    assert first == ref.next_token(reference, prompt)
    got, in_flight, stream = [], [], ex.greedy_tokens(session, first, 60)
    for i, token in enumerate(stream):
        got.append(token)
        if i in moves:
            in_flight.append(len(ex._inflight))
            model.move(*moves[i])
        if i == 40:
            break
    stream.close()
    assert in_flight == [1, 0, 1]  # (plain steps while block 1 is on the host)
    assert not ex._inflight and session.length == len(prompt) + 41
    expected, token = [], first
    for i in range(41):
        token = ref.next_token(reference, [token])
        expected.append(token)
        if i in moves:
            eager.move(*moves[i])
    assert got == expected and reference.length == session.length
    a, b = ex.forward(session, [got[-1]]), ref.forward(reference, [expected[-1]])
    # the KV of every position as the plain steps left it (to rounding: pipelined steps gather their row on
    # the GPU, plain ones take the host's)
    assert np.abs(a - b).max() < 2e-6 * np.abs(b).max()
    assert any(key[2] == "pipelined" for key in ex._graphs)


def test_fault_on_cuda_finishes_on_host(tiny_model, cache_dir):
    from jitllm.model import load
    from jitllm.runtime.backends.cuda import cuda_device
    from jitllm.runtime.backends.fake import with_faults
    from jitllm.runtime.device_spec import parse_devices
    from jitllm.runtime.inventory import detect_inventory
    from jitllm.runtime.sampling import SamplingParams

    prompt = list(range(4, 30))
    host = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact").generate_ids(prompt, 16)
    cuda = with_faults(cuda_device(parse_devices("cuda:0", detect_inventory())[0], "exact"))
    model = load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact", extra_devices=[cuda])
    model.move("*", "cuda:0")
    model.move("head", "cuda:0")
    out = []
    for i, token in enumerate(model.generate_tokens(prompt, 16, SamplingParams(0.0))):
        out.append(token)
        if i == 3:
            cuda.backend.faults.launch = True
    assert out == host
