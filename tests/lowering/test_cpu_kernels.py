"""CPU kernels (jitllm/kernels/cpu/linear.py, kernels/cpu/attention.py) against numpy.

Tolerances, relative to the largest |output|:
- exact kernels (f32 activations, exactly dequantized weights): 1e-5 against x @ W.T in float64;
- fast kernels on GGML formats (int8 activations): 1e-5 against a numpy emulation of the same int8
  quantization (per 32-block, scale max|x|/127, round half to even), 3e-2 against x @ W.T
  (the 8-bit activation error itself: ~5e-3 on these random inputs);
- attention (f32, online softmax, polynomial exp): 1e-5 against a numpy softmax attention.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from jitllm.core.layouts import FLOAT_TYPES, K_QUANTS, WEIGHT_TYPES, weight_parts
from jitllm.core.quant import dequantize, parts_from_float
from jitllm.ir.config import BlockKind, ModelConfig
from jitllm.lowering.kernels.cpu import linear
from jitllm.lowering.targets import llvm
from jitllm.lowering.targets.llvm import LlvmTarget, host_isa, host_isas, isa_target_dict

AVX2 = host_isa() in ("avx2", "avx512vnni")
FAST_ISAS = [isa for isa in host_isas() if isa != "generic"]
"""Every instruction set this host runs fast kernels for (each one checked: the highest is the default)."""
needs_avx2 = pytest.mark.skipif(not AVX2, reason="host has no AVX2/FMA/F16C")
needs_aarch64_llvm = pytest.mark.skipif("aarch64" not in tvm.target.codegen.llvm_get_targets(),
                                        reason="TVM's LLVM has no AArch64 backend")
SHAPES = [(64, 96), (1544, 576)]  # 193 row groups: a ragged split over 2 or 3 workers
K_SHAPES = [(64, 256), (1544, 512)]  # the K-quants take inputs in multiples of 256
TOKENS = (1, 3, 4, 9, 70)  # 70: two chunks of the prefill path (64 tokens each) and a ragged tail


def _build(funcs: dict, target: tvm.target.Target):
    return tvm.compile(tvm.IRModule(funcs), target=target)


def _int8_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv)
    return ((q * (amax / np.float32(127))).reshape(m, k).astype(np.float64)) @ w.T.astype(np.float64)


def _run_linear(lib, symbol, wtype, n, k, parts, x):
    m = x.shape[0]
    xin = x if wtype in FLOAT_TYPES else x.reshape(m, k // 32, 32)
    y = tvm.runtime.tensor(np.zeros((m, n // 8, 8), np.float32))
    args = [tvm.runtime.tensor(parts[name]) for name, _, _ in weight_parts(wtype, n, k)]
    lib[symbol](tvm.runtime.tensor(np.ascontiguousarray(xin)), *args, y)
    return y.numpy().reshape(m, n)


_POOL_THREADS: dict[int, ThreadPoolExecutor] = {}
"""One long-lived thread per pool size: TVM keeps a thread's pool until the process ends (its thread-local
store is not freed when the thread exits), so a fresh thread per call leaked a spinning pool each time
(hundreds of threads over this module)."""


def in_pool_of(workers: int, fn):
    """fn() on a thread whose TVM pool has `workers` workers (a pool is per thread and sized when it starts;
    config_threadpool's mode -3 lets its threads share the process's CPUs, so 3 workers run even on a 2-CPU
    machine)."""
    def body():
        cpus = sorted(os.sched_getaffinity(0))
        tvm.get_global_func("runtime.config_threadpool")(-3, workers, [str(cpus[i % len(cpus)]) for i in range(workers)])
        assert tvm.get_global_func("runtime.NumThreads")() == workers
        return fn()

    if workers not in _POOL_THREADS:
        _POOL_THREADS[workers] = ThreadPoolExecutor(1, thread_name_prefix=f"tvm-pool-{workers}")
    return _POOL_THREADS[workers].submit(body).result()


def _check_linears(target_obj: LlvmTarget, tvm_target, wtypes, fast_expected: bool, workers=(None,)):
    """`workers`: also run every quantized kernel in pools of these sizes (None: the calling thread's pool):
    the fast decode path splits its rows over the workers it finds when it runs, and one artifact must give
    the same outputs under any of them."""
    rng = np.random.default_rng(0)
    funcs, cases = {}, []
    for wtype in wtypes:
        for n, k in K_SHAPES if wtype in K_QUANTS else SHAPES:
            symbol, func = target_obj.linear_kernel(wtype, n, k)
            funcs[symbol] = func
            w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
            parts = parts_from_float(wtype, w)
            cases.append((symbol, wtype, n, k, parts, dequantize(wtype, parts)))
    lib = _build(funcs, tvm_target)
    for symbol, wtype, n, k, parts, w in cases:
        quantized_path = fast_expected and wtype.startswith("q")
        assert symbol.endswith(("_avx2", "_vnni", "_sdot")) == quantized_path, symbol
        for m in TOKENS:
            x = rng.standard_normal((m, k)).astype(np.float32)
            def run(symbol=symbol, wtype=wtype, n=n, k=k, parts=parts, x=x):
                return _run_linear(lib, symbol, wtype, n, k, parts, x)

            outs = [run() if nt is None else in_pool_of(nt, run) for nt in (workers if wtype.startswith("q") else (None,))]
            out = outs[0]
            for other in outs[1:]:
                assert np.array_equal(other, out), (symbol, m)  # each output row is one task's sum
            exact = x.astype(np.float64) @ w.T.astype(np.float64)
            scale = np.abs(exact).max()
            err = np.abs(out - exact).max() / scale
            if quantized_path:
                assert np.abs(out - _int8_reference(x, w)).max() / scale < 1e-5, (symbol, m)
                assert err < 3e-2, (symbol, m, err)
            else:
                assert err < 1e-5, (symbol, m, err)


def test_exact_kernels_match_numpy():
    t = LlvmTarget("exact")
    _check_linears(t, t.tvm_target(), WEIGHT_TYPES, fast_expected=False)


@pytest.mark.parametrize("isa", FAST_ISAS)
def test_fast_kernels_match_numpy_int8_emulation(isa):
    t = LlvmTarget("fast", isa=isa)
    _check_linears(t, t.tvm_target(), ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"), fast_expected=True,
                   workers=(1, 2, 3))


@pytest.mark.skipif("avx512vnni" not in host_isas(), reason="host has no AVX-512 VNNI/VBMI")
def test_vnni_q4_kernels_give_the_avx2_kernels_integers_bit_for_bit():
    """vpdpbusd sums the same int8 products as vpmaddubsw/vpmaddwd: outputs identical, prefill and decode."""
    rng = np.random.default_rng(5)
    for wtype in ("q4_0", "q4_1"):
        n, k = 64, 256
        parts = parts_from_float(wtype, (rng.standard_normal((n, k)) * 0.1).astype(np.float32))
        x = rng.standard_normal((70, k)).astype(np.float32)
        outs = {}
        for isa in ("avx2", "avx512vnni"):
            t = LlvmTarget("fast", isa=isa)
            symbol, func = t.linear_kernel(wtype, n, k)
            assert symbol.endswith("_vnni" if isa == "avx512vnni" else "_avx2"), symbol
            lib = _build({symbol: func}, t.tvm_target())
            outs[isa] = [_run_linear(lib, symbol, wtype, n, k, parts, x[:m]) for m in (1, 70)]
        for a, b in zip(outs["avx2"], outs["avx512vnni"], strict=True):
            np.testing.assert_array_equal(a, b)


def test_an_isa_is_chosen_from_the_host_or_named_lower(monkeypatch):
    from jitllm.core.errors import JitllmError
    from jitllm.lowering.targets.llvm import host_target_dict

    monkeypatch.setenv("JITLLM_CPU_ISA", "generic")
    assert host_isa() == "generic" and LlvmTarget("fast").isa == "generic"
    assert host_target_dict().get("mcpu") in ("x86-64", "generic", None)
    monkeypatch.setenv("JITLLM_CPU_ISA", "mmx")
    with pytest.raises(JitllmError, match="JITLLM_CPU_ISA=mmx: this host runs generic"):
        host_isa()
    monkeypatch.delenv("JITLLM_CPU_ISA")
    assert host_isa() == host_isas()[-1]
    assert LlvmTarget("fast", isa="generic").cache_key() != LlvmTarget("fast").cache_key() or not AVX2


@needs_avx2
@pytest.mark.parametrize("wtype", ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"])
def test_fast_kernels_of_the_5_6_bit_and_k_quant_formats(wtype):
    t = LlvmTarget("fast")
    _check_linears(t, t.tvm_target(), (wtype,), fast_expected=True, workers=(1, 2, 3))


GRAVITON2_CPUINFO = """processor	: 0
BogoMIPS	: 243.75
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer	: 0x41
CPU part	: 0xd0c
"""
A72_FEATURES = "fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid"  # Graviton 1 / Raspberry Pi 4: no dot product


def test_an_aarch64_host_gets_neon_dotprod_from_asimddp(monkeypatch):
    monkeypatch.setattr(llvm.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv("JITLLM_CPU_ISA", raising=False)
    monkeypatch.setattr(llvm, "host_cpu_flags", lambda: llvm.cpuinfo_flags(GRAVITON2_CPUINFO))
    assert host_isas() == ("generic", "neon-dotprod") and host_isa() == "neon-dotprod"
    assert isa_target_dict("neon-dotprod") == {"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                               "mattr": ["+neon", "+dotprod"]}
    dotprod = LlvmTarget("fast")
    assert dotprod.isa == "neon-dotprod" and dotprod.linear_kernel("q4_0", 64, 256)[0].endswith("_sdot")
    monkeypatch.setenv("JITLLM_CPU_ISA", "avx2")
    with pytest.raises(Exception, match="JITLLM_CPU_ISA=avx2: this host runs generic, neon-dotprod"):
        host_isa()
    monkeypatch.setenv("JITLLM_CPU_ISA", "generic")
    assert LlvmTarget("fast").cache_key() != dotprod.cache_key()
    monkeypatch.delenv("JITLLM_CPU_ISA")
    monkeypatch.setattr(llvm, "host_cpu_flags", lambda: llvm.cpuinfo_flags(f"Features\t: {A72_FEATURES}\n"))
    assert host_isas() == ("generic",)
    assert isa_target_dict("generic") == {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "generic"}
    assert not LlvmTarget("fast").linear_kernel("q4_0", 64, 256)[0].endswith("_sdot")


def _functions(asm: str) -> dict[str, str]:
    """Assembly text per function (`.type NAME,@function` ... up to the next one)."""
    parts = re.split(r"^\s*\.type\s+([^,\s]+),@function$", asm, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@needs_aarch64_llvm
def test_neon_dotprod_kernels_compile_to_sdot():
    """Built here for aarch64 (they never run on this host): each Q4_0/Q4_1/Q8_0 fast kernel's own code
    holds sdot (a one-token call of a small matrix runs in the function itself, not a parallel lambda)."""
    funcs = dict(linear.linear_kernel(w, 16, 64, "fast", "neon-dotprod") for w in ("q4_0", "q4_1", "q8_0"))
    assert all(s.endswith("_sdot") for s in funcs), list(funcs)
    asm = _build(funcs, tvm.target.Target(isa_target_dict("neon-dotprod"))).mod.inspect_source("asm")
    code = _functions(asm)
    for symbol in funcs:
        assert re.search(r"^\s+sdot\s+v\d+\.4s, v\d+\.16b, v\d+\.16b$", code[f"{symbol}_compute_"], re.M), symbol
        assert re.search(r"^\s+tbl\s", code[f"{symbol}_compute_"], re.M), symbol  # the VNNI byte order


def _sdot_portable(acc, a, b):
    """sdot8's integers (lane i += sum over k of a[4i + k] * b[4i + k]) in portable TIR."""
    p = T.Cast("int32x32", a) * T.Cast("int32x32", b)
    for k in range(4):
        acc = acc + T.Shuffle([p], [4 * i + k for i in range(8)])
    return acc


class _KernelsOf:
    """The linear kernels of one ISA, whichever host builds them."""

    def __init__(self, isa: str):
        self.isa = isa

    def linear_kernel(self, wtype, n, k):
        return linear.linear_kernel(wtype, n, k, "fast", self.isa)


def test_neon_dotprod_kernels_match_numpy_with_a_portable_sdot(monkeypatch):
    """The neon-dotprod kernels' TIR with sdot replaced by the same integers in portable TIR, built for this
    host's generic target and run: byte order, activation quantization, scales and loop nest checked
    (only the intrinsic itself, never run here, is not)."""
    monkeypatch.setitem(linear.DOT4, "sdot", _sdot_portable)
    _check_linears(_KernelsOf("neon-dotprod"), tvm.target.Target(isa_target_dict("generic")),
                   ("q8_0", "q4_0", "q4_1"), fast_expected=True, workers=(1, 2))


def test_fast_without_avx2_uses_portable_kernels_on_a_generic_target():
    """isa="generic" (what a host without AVX2 gets) never emits x86 intrinsics: the same kernels build
    for plain x86-64 (SSE2) and stay exact for the GGML formats."""
    t = LlvmTarget("fast", isa="generic")
    assert t.cache_key()["isa"] == "generic"
    target = t.tvm_target()
    if AVX2:
        target = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"})
    _check_linears(t, target, ("f16", "bf16", "q4_1", "q5_1", "q6_k"), fast_expected=False)


def test_kernel_choice_is_part_of_the_cache_key():
    exact, fast = LlvmTarget("exact"), LlvmTarget("fast")
    assert exact.cache_key() != fast.cache_key()
    assert fast.cache_key()["kernels"] == "fast"
    with pytest.raises(Exception):
        LlvmTarget("turbo")


def _attention_reference(q, k, v, pages, pt, past, groups):
    b_, s_, h_, d_ = q.shape
    hkv = k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for b in range(b_):
        n = past[b]
        hist = pages[pt[b]]  # [MP, 2, Hkv, P, D]
        hk = hist[:, 0].transpose(1, 0, 2, 3).reshape(hkv, -1, d_)[:, :n]
        hv = hist[:, 1].transpose(1, 0, 2, 3).reshape(hkv, -1, d_)[:, :n]
        keys = np.concatenate([hk, k[b].transpose(1, 0, 2)], 1).astype(np.float64)
        vals = np.concatenate([hv, v[b].transpose(1, 0, 2)], 1).astype(np.float64)
        for s in range(s_):
            for h in range(h_):
                kv = h // groups
                sc = keys[kv, :n + s + 1] @ q[b, s, h] / np.sqrt(d_)
                p = np.exp(sc - sc.max())
                out[b, s, h] = (p / p.sum()) @ vals[kv, :n + s + 1]
    return out


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("batch,seq,pasts", [(1, 1, [0]), (1, 1, [37]), (2, 1, [15, 100]), (1, 7, [20]),
                                             (2, 40, [0, 33])])
def test_paged_attention_matches_numpy(batch, seq, pasts, kv_type):
    """Over an f16 pool too: the kernels read its values as f32, so they match numpy over the same values."""
    from jitllm.lowering.kernels.cpu.attention import (
        _attention_serial,
        attention_kernel,
    )

    cfg = ModelConfig("llama", 1, 576, 9, 3, 64, 1536, 100, 8192, 1e5, 1e-5)
    kind = BlockKind("llama", cfg, (), 16, kv_type=kv_type)
    t = LlvmTarget("exact")
    (s1, f1), (s2, f2) = attention_kernel(kind), _attention_serial(kind)
    lib = _build({s1: f1, s2: f2}, t.tvm_target())
    rng = np.random.default_rng(1)
    H, HKV, D, P = 9, 3, 64, 16
    mp = (max(pasts) + seq + P - 1) // P + 1
    num_pages = batch * mp + 3
    pages = rng.standard_normal((num_pages, 2, HKV, P, D)).astype(kind.kv_dtype)
    pt = rng.permutation(num_pages)[:batch * mp].reshape(batch, mp).astype(np.int32)
    q = rng.standard_normal((batch, seq, H, D)).astype(np.float32)
    k = rng.standard_normal((batch, seq, HKV, D)).astype(np.float32)
    v = rng.standard_normal((batch, seq, HKV, D)).astype(np.float32)
    past = np.array(pasts, np.int32)
    ref = _attention_reference(q, k, v, pages.astype(np.float32), pt, past, H // HKV)
    for symbol in (s1, s2):
        out = tvm.runtime.tensor(np.zeros_like(q))
        lib[symbol](*[tvm.runtime.tensor(a) for a in (q, k, v, pages, pt, past)], out)
        assert np.abs(out.numpy() - ref).max() < 1e-5, symbol


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_append_and_page_kernels_store_the_pool_dtype(kv_type):
    """The append rounds f32 K/V as numpy's astype does (to nearest even); export and import move pages
    in the pool's dtype, unchanged."""
    from jitllm.lowering import EXPORT_PAGES, IMPORT_PAGES
    from jitllm.lowering.kernels.cpu.attention import append_kernel, ragged_append_kernel
    from jitllm.lowering.kernels.cpu.pages import page_kernels

    cfg = ModelConfig("llama", 1, 64, 4, 2, 16, 128, 100, 512, 1e4, 1e-5)
    kind = BlockKind("llama", cfg, (), 4, kv_type=kv_type)
    (s1, f1), (s2, f2) = append_kernel(kind), ragged_append_kernel(kind)
    lib = _build({s1: f1, s2: f2, **page_kernels(kind)}, LlvmTarget("exact").tvm_target())
    rng = np.random.default_rng(3)
    pool = np.zeros((6, 2, 2, 4, 16), kind.kv_dtype)
    k = rng.standard_normal((1, 5, 2, 16)).astype(np.float32)
    v = rng.standard_normal((1, 5, 2, 16)).astype(np.float32)
    pt, past = np.array([[4, 1]], np.int32), np.array([2], np.int32)
    pages = tvm.runtime.tensor(pool)
    lib[s1](pages, *[tvm.runtime.tensor(a) for a in (k, v, pt, past)])
    want = pool.copy()
    for s in range(5):
        pos = 2 + s
        want[pt[0, pos // 4], 0, :, pos % 4] = k[0, s]
        want[pt[0, pos // 4], 1, :, pos % 4] = v[0, s]
    assert np.array_equal(pages.numpy(), want)
    ragged = tvm.runtime.tensor(pool)
    lib[s2](ragged, *[tvm.runtime.tensor(a) for a in (k, v, pt, past, np.array([0, 5], np.int32))])
    assert np.array_equal(ragged.numpy(), want)
    ids = tvm.runtime.tensor(np.array([4, 1], np.int32))
    out = tvm.runtime.tensor(np.zeros((2, 2, 2, 4, 16), kind.kv_dtype))
    lib[EXPORT_PAGES](pages, ids, out)
    assert out.numpy().dtype == np.dtype(kind.kv_dtype) and np.array_equal(out.numpy(), want[[4, 1]])
    other = tvm.runtime.tensor(np.zeros_like(pool))
    lib[IMPORT_PAGES](other, tvm.runtime.tensor(np.array([0, 5], np.int32)), out)
    assert np.array_equal(other.numpy()[[0, 5]], want[[4, 1]])


def test_q8_0_append_attention_and_page_kernels():
    """A q8_0 pool (head dim 64: two blocks a row): both appends quantize as gguf's Q8_0 does, bit for bit
    (ties at .5 and an all-zero block among the rows); both attention kernels read d * q, matching numpy over
    gguf's dequantization of the same pool; export and import move the rows' bytes unchanged."""
    from reference import pool_rows, pool_values

    from jitllm.lowering import EXPORT_PAGES, IMPORT_PAGES
    from jitllm.lowering.kernels.cpu.attention import (
        _attention_serial,
        append_kernel,
        attention_kernel,
        ragged_append_kernel,
    )
    from jitllm.lowering.kernels.cpu.pages import page_kernels

    cfg = ModelConfig("llama", 1, 128, 2, 1, 64, 128, 100, 512, 1e4, 1e-5)
    kind = BlockKind("llama", cfg, (), 4, kv_type="q8_0")
    funcs = dict([append_kernel(kind), ragged_append_kernel(kind), attention_kernel(kind), _attention_serial(kind)])
    lib = _build({**funcs, **page_kernels(kind)}, LlvmTarget("exact").tvm_target())
    (s1, s2, s3, s4) = funcs
    rng = np.random.default_rng(3)
    pool = np.zeros((6, 2, 1, 4, 68), np.int8)
    k = (rng.standard_normal((1, 5, 1, 64)) * 3).astype(np.float32)
    k[0, 0, 0, :32] = 0
    k[0, 1, 0, :32] = np.arange(32) / 2 - 8
    v = rng.standard_normal((1, 5, 1, 64)).astype(np.float32)
    pt, past = np.array([[4, 1]], np.int32), np.array([2], np.int32)
    want = pool.copy()
    for s in range(5):
        pos = 2 + s
        want[pt[0, pos // 4], 0, :, pos % 4] = pool_rows(kind, k[0, s])
        want[pt[0, pos // 4], 1, :, pos % 4] = pool_rows(kind, v[0, s])
    pages, ragged = tvm.runtime.tensor(pool), tvm.runtime.tensor(pool)
    lib[s1](pages, *[tvm.runtime.tensor(a) for a in (k, v, pt, past)])
    lib[s2](ragged, *[tvm.runtime.tensor(a) for a in (k, v, pt, past, np.array([0, 5], np.int32))])
    assert np.array_equal(pages.numpy(), want) and np.array_equal(ragged.numpy(), want)
    q = rng.standard_normal((1, 1, 2, 64)).astype(np.float32)
    k1, v1 = (rng.standard_normal((1, 1, 1, 64)).astype(np.float32) for _ in range(2))
    ref = _attention_reference(q, k1, v1, pool_values(kind, want), pt, np.array([7], np.int32), 2)
    for symbol in (s3, s4):
        out = tvm.runtime.tensor(np.zeros_like(q))
        lib[symbol](*[tvm.runtime.tensor(a) for a in (q, k1, v1, want, pt, np.array([7], np.int32))], out)
        assert np.abs(out.numpy() - ref).max() < 1e-5, symbol
    out = tvm.runtime.tensor(np.zeros((2, 2, 1, 4, 68), np.int8))
    lib[EXPORT_PAGES](pages, tvm.runtime.tensor(np.array([4, 1], np.int32)), out)
    assert np.array_equal(out.numpy(), want[[4, 1]])
    other = tvm.runtime.tensor(np.zeros_like(pool))
    lib[IMPORT_PAGES](other, tvm.runtime.tensor(np.array([0, 5], np.int32)), out)
    assert np.array_equal(other.numpy()[[0, 5]], want[[4, 1]])
