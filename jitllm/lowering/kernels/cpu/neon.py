"""The Arm intrinsics of the fast CPU linear kernels on `neon-dotprod` hosts (Armv8.2-A's dot product,
FEAT_DotProd: Graviton 2+, Apple M1+, Cortex-A76+), used by kernels/cpu/linear.py's Q4_0/Q4_1/Q8_0 kernels.

They take the VNNI byte order of kernels/cpu/avx2.py (W_VNNI, X_VNNI: each row's 4 consecutive elements in
4 adjacent bytes), since sdot sums 4 adjacent byte products into a 32-bit lane as vpdpbusd does; the
cross-lane permutation of a 32-byte weight chunk becomes two `tbl` lookups. Q4 nibbles (0..15) are read as
signed bytes, so sdot (s8 x s8) gives the same integers as vpdpbusd (u8 x s8); udot (u8 x u8) has no
use here, since the activations are signed.
"""

from __future__ import annotations

from tvm.script import tirx as T


def sdot(acc, a, b):
    """sdot (128-bit): s8 x s8 products, each 4 adjacent summed into acc's int32 lanes."""
    return T.call_llvm_pure_intrin("int32x4", "llvm.aarch64.neon.sdot", acc, a, b)


def sdot8(acc, a, b):
    """The 256-bit shape of avx2.dpbusd over two sdot: int32x8 acc, 32 bytes of a (int8, or Q4 nibbles as
    uint8) and b (int8)."""
    a = T.reinterpret("int8x32", a)
    halves = [sdot(T.Shuffle([acc], list(range(4 * h, 4 * h + 4))), T.Shuffle([a], list(range(16 * h, 16 * h + 16))),
                   T.Shuffle([b], list(range(16 * h, 16 * h + 16)))) for h in (0, 1)]
    return T.Shuffle(halves, list(range(8)))
