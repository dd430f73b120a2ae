"""Which CUDA kernel a linear gets (compiling CUDA needs nvcc; these only build the TIR)."""

from __future__ import annotations

import pytest

from jitllm.errors import JitllmError
from jitllm.lowering.cuda import CudaTarget


def test_prefill_linears_take_tensor_cores_where_the_shape_and_arch_allow():
    sm90 = CudaTarget("sm_90")
    for wtype in ("f16", "q8_0", "q4_0", "q4_1"):
        assert sm90.linear_kernel(wtype, 128, 64)[0] == f"jl_gpu_mma_linear_{wtype}_128x64"
        assert sm90.linear_kernel(wtype, 576, 1536)[0].startswith("jl_gpu_mma_linear")
    assert not sm90.linear_kernel("f32", 128, 64)[0].startswith("jl_gpu_mma")  # f32 weights: CUDA cores
    assert not sm90.linear_kernel("f16", 96, 64)[0].startswith("jl_gpu_mma")  # N not a multiple of 64
    assert not sm90.linear_kernel("f16", 128, 64, rows=1)[0].startswith("jl_gpu_mma")  # decode: GEMV
    assert not CudaTarget("sm_61").linear_kernel("f16", 128, 64)[0].startswith("jl_gpu_mma")  # no WMMA
    assert CudaTarget("sm_90a").linear_kernel("f16", 128, 64)[0].startswith("jl_gpu_mma")


def test_bad_arch_is_a_clear_error():
    for arch in ("sm_", "sm_x9", "compute_90", "90"):
        with pytest.raises(JitllmError, match="bad CUDA arch"):
            CudaTarget(arch)


def test_tensor_core_kernel_keeps_symbolic_rows():
    _, func = CudaTarget("sm_90").linear_kernel("q4_1", 256, 128)
    x, *parts, y = func.params
    assert str(x.shape[0]) == str(y.shape[0]) == "M" and [int(d) for d in y.shape[1:]] == [256]
    assert len(parts) == 3  # quants, scales, minimums
