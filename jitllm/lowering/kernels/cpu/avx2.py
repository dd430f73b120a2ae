"""The AVX2 machinery the fast CPU linear kernels share (kernels/cpu/linear.py, kernels/cpu/linear_wide.py):
intrinsics, the int8 quantization of the activations and the loop nest around a kernel's per-block step.

Byte order the AVX2 kernels rely on (core/layouts.py): a 32-byte load of qs[g, b, 4c:4c+4, :] holds
elements j = 4c..4c+3 (q4: also j+16 in the high nibbles) of the 8 rows, j-major. An in-lane byte
shuffle (W_SHUFFLE) makes each 16-bit pair one row's two consecutive elements, so `vpmaddubsw` against
the activation pairs (prepared once per call in `xe`, X_PATTERN) sums within a row; the 16-bit lanes
are then [rows 0..7 of elements (4c, 4c+1) | rows 0..7 of (4c+2, 4c+3)] and the two halves are added
in 32 bits (widen_halves).
"""

from __future__ import annotations

from tvm.script import tirx as T

from jitllm.core.layouts import ROW_GROUP

R = ROW_GROUP

MT = 4
"""Tokens per weight decode in the fast prefill path."""
MB = 64
"""Tokens per chunk in the fast prefill path (their int8 activations stay in L2 while all rows pass)."""

# In-lane byte shuffle of a 32-byte weight chunk: [j0: r0..r7, j1: r0..r7] -> [r0: j0 j1, r1: j0 j1, ...].
_PAIRS = [(p % 2) * 8 + p // 2 for p in range(16)]
W_SHUFFLE = _PAIRS + [16 + i for i in _PAIRS]
# Activation bytes matching W_SHUFFLE for the elements 4c..4c+3 of a 32-block (c = 0..7).
X_PATTERN = [[4 * c + 2 * (p // 16) + p % 2 for p in range(32)] for c in range(8)]
# VNNI (vpdpbusd sums 4 adjacent bytes into one 32-bit lane): a cross-lane byte permutation (vpermb,
# AVX-512 VBMI) of the same chunk -> [r0: j0 j1 j2 j3, r1: ..., r7: ...], and activation bytes to match.
W_VNNI = [8 * (p % 4) + p // 4 for p in range(32)]
X_VNNI = [[4 * c + p % 4 for p in range(32)] for c in range(8)]
# 16-bit interleave of two vectors within each 128-bit lane (vpunpcklwd / vpunpckhwd).
UNPACK_LO = [0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27]
UNPACK_HI = [4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31]


def shuffle_reduce(v, lanes: int, op):
    """Reduce a vector expression to a scalar with a halving tree of shuffles."""
    while lanes > 1:
        half = lanes // 2
        v = op(T.Shuffle([v], list(range(half))), T.Shuffle([v], list(range(half, lanes))))
        lanes = half
    return v


def hmax(v, lanes):
    return shuffle_reduce(v, lanes, T.max)


def hsum(v, lanes):
    return shuffle_reduce(v, lanes, lambda a, b: a + b)


def maddubs(a, b):
    """vpmaddubsw: u8 x s8 products, adjacent pairs summed to s16 (no saturation for our ranges)."""
    return T.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", a, b)


def dpbusd(acc, a, b):
    """vpdpbusd (AVX-512 VNNI, 256-bit): u8 x s8 products, each 4 adjacent summed into acc's int32 lanes."""
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256", acc, a, b)


def maddwd(a, b):
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", a, b)


def psign(a, b):
    return T.call_llvm_pure_intrin("int8x32", "llvm.x86.avx2.psign.b", a, b)


def prefetch(buf, idx):
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(buf[tuple(idx)]), T.int32(0), T.int32(3),
                              T.int32(1))


def widen_halves(s16):
    """[rows 0..7 | rows 0..7] int16x16 -> int32x8 row sums."""
    return (T.Cast("int32x8", T.Shuffle([s16], list(range(8))))
            + T.Cast("int32x8", T.Shuffle([s16], list(range(8, 16)))))


def quantize_activations(half_sums: bool = False, pattern: list[list[int]] = X_PATTERN):
    """A macro quantizing the 32-block x[m, b] to int8: scale xd, xs = xd * sum(q), and the activation byte
    patterns xe[t, b, c] (X_PATTERN[c]) the AVX2 dot products read, stored at row t. With `half_sums`,
    xs[t, 2b + h] = xd * sum(q) over the block's half h (elements 16h..16h+15) instead."""
    P = pattern

    @T.macro
    def quantize(x, xe, xd, xs, m, t, b):
        v: T.let = x.vload([m, b, 0], "float32x32")
        amax: T.let = hmax(T.abs(v), 32)
        qf: T.let = T.nearbyint(v * T.Broadcast(T.if_then_else(amax > T.float32(0), T.float32(127) / amax,
                                                                 T.float32(0)), 32))
        xd[t, b] = amax / T.float32(127)
        if half_sums:
            xs[t, 2 * b] = hsum(T.Shuffle([qf], list(range(16))), 16) * (amax / T.float32(127))
            xs[t, 2 * b + 1] = hsum(T.Shuffle([qf], list(range(16, 32))), 16) * (amax / T.float32(127))
        else:
            xs[t, b] = hsum(qf, 32) * (amax / T.float32(127))
        q8: T.let = T.Cast("int8x32", T.Cast("int32x32", qf))
        xe[t, b, 0, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[0])
        xe[t, b, 1, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[1])
        xe[t, b, 2, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[2])
        xe[t, b, 3, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[3])
        xe[t, b, 4, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[4])
        xe[t, b, 5, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[5])
        xe[t, b, 6, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[6])
        xe[t, b, 7, T.ramp(0, 1, 32)] = T.Shuffle([q8], P[7])

    return quantize


SERIAL_BYTES = 160 * 1024
"""Decode (one token) runs single-threaded below this many weight bytes: a parallel launch costs ~2.5 us
on the 2-vCPU VM, more than it saves on the k/v projections."""
PREFETCH_BYTES = 6 * 1024
"""Software prefetch distance in the AVX2 kernels (a 1536x576 Q4_1 matvec: 41 -> 32 us on one thread)."""


MAX_TASKS = 64
"""Most tasks a one-token call splits its rows over (its activation scratch has a row per task)."""


def worker_count():
    """The calling thread's TVM pool size, read at run time (at most MAX_TASKS): one artifact serves any
    worker count, so TVM_NUM_THREADS, the CPU mask or the core count never change a cache key."""
    return T.min(T.call_packed("runtime.NumThreads"), MAX_TASKS)


def avx2_driver(G: int, NB: int, weight_bytes: int, row_block, warm=None, warm_groups: int = 0,
                half_sums: bool = False, pattern: list[list[int]] = X_PATTERN):
    """The loop nest shared by the AVX2 kernels around `row_block(qs, d, mn, xe, xd, xs, y, g, b, m0, t0, cnt)`
    (cnt tokens: y rows m0.., activation rows t0..). It is portable TIR (the NEON kernels use it too).

    One token: each of the pool's workers (counted when the kernel runs, worker_count) is one task that
    quantizes x itself (no serial section, no barrier) and takes an equal contiguous share of the row groups;
    small matrices and a one-worker pool run on the calling thread alone. Several tokens: x is quantized in
    parallel, then the tokens are walked in chunks of MB (their activations stay in L2) with MT tokens per
    weight decode, parallel over row groups.

    `warm(qs, d, mn, g, b)` prefetches one block of a row group: each one-token task first requests its
    first `warm_groups` groups, so their DRAM reads overlap the activation quantization instead of
    starting when the loop reaches them (every call starts its streams cold). `half_sums`: xs holds the
    activation sums per half block (quantize_activations)."""
    quantize = quantize_activations(half_sums, pattern)
    small = weight_bytes < SERIAL_BYTES
    NBP = (NB + 15) // 16 * 16 + 16  # per-token scale rows padded to whole cache lines (no false sharing)

    @T.macro
    def one_token_serial(x, qs, d, mn, y, xe, xd, xs):
        for g in T.serial(min(warm_groups, G)):
            for b in T.serial(NB):
                warm(qs, d, mn, g, b)
        for b in T.serial(NB):
            quantize(x, xe, xd, xs, 0, 0, b)
        for g in T.serial(G):
            for r in T.vectorized(R):
                y[0, g, r] = T.float32(0)
            for b in T.serial(NB):
                row_block(qs, d, mn, xe, xd, xs, y, g, b, 0, 0, 1)

    @T.macro
    def body(x, qs, d, mn, y):
        M = x.shape[0]
        xe = T.alloc_buffer((T.max(M, T.int64(MAX_TASKS)), NB, 8, 32), "int8")
        xd = T.alloc_buffer((T.max(M, T.int64(MAX_TASKS)), NBP), "float32")
        xs = T.alloc_buffer((T.max(M, T.int64(MAX_TASKS)), NBP * (2 if half_sums else 1)), "float32")
        if M == 1:
            if small:
                one_token_serial(x, qs, d, mn, y, xe, xd, xs)
            else:
                nt: T.let = T.min(worker_count(), G)
                if nt < 2:
                    one_token_serial(x, qs, d, mn, y, xe, xd, xs)
                else:
                    share: T.let = (G + nt - 1) // nt
                    for task in T.parallel(nt):
                        for g in T.serial(task * share, T.min(task * share + T.min(warm_groups, share), G)):
                            for b in T.serial(NB):
                                warm(qs, d, mn, g, b)
                        for b in T.serial(NB):
                            quantize(x, xe, xd, xs, 0, task, b)
                        for g in T.serial(task * share, T.min((task + 1) * share, G)):
                            for r in T.vectorized(R):
                                y[0, g, r] = T.float32(0)
                            for b in T.serial(NB):
                                row_block(qs, d, mn, xe, xd, xs, y, g, b, 0, task, 1)
        else:
            for m in T.parallel(M):
                for b in T.serial(NB):
                    quantize(x, xe, xd, xs, m, m, b)
            for mb in T.serial((M + MB - 1) // MB):
                for g in T.parallel(G):
                    cnt: T.let = T.min(M - mb * MB, T.int64(MB))
                    for t in T.serial(cnt // MT):
                        for i in T.unroll(MT):
                            for r in T.vectorized(R):
                                y[mb * MB + t * MT + i, g, r] = T.float32(0)
                        for b in T.serial(NB):
                            row_block(qs, d, mn, xe, xd, xs, y, g, b, mb * MB + t * MT, mb * MB + t * MT, MT)
                    for t in T.serial(cnt % MT):
                        for r in T.vectorized(R):
                            y[mb * MB + cnt // MT * MT + t, g, r] = T.float32(0)
                        for b in T.serial(NB):
                            row_block(qs, d, mn, xe, xd, xs, y, g, b, mb * MB + cnt // MT * MT + t,
                                      mb * MB + cnt // MT * MT + t, 1)

    return body
