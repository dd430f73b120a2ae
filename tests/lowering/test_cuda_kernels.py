"""Which CUDA kernel a linear gets (these build the TIR or CUDA source; one test runs nvcc where it exists)."""

from __future__ import annotations

import dataclasses
import re
import shutil

import numpy as np
import pytest

from jitllm.core.errors import JitllmError
from jitllm.lowering.targets.cuda import CudaTarget


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


def test_prefill_linears_fold_the_norm_and_the_residual_add_but_not_swiglu():
    from jitllm.ir.ops import LINEAR_ADD, NORM_LINEAR, SWIGLU_LINEAR_ADD

    for target in (CudaTarget("sm_90", "fast"), CudaTarget("sm_90", "exact")):
        symbol, func = target.prefill_linear_kernel(NORM_LINEAR, "q4_0", 256, 128, 1e-5)
        assert "rmsnormlinear_eps" in symbol and [p.name for p in func.params] == ["x", "nw", "q", "d", "y"]
        symbol, func = target.prefill_linear_kernel(LINEAR_ADD, "f16", 256, 128)
        assert symbol.endswith("_linearadd") and [p.name for p in func.params] == ["x", "q", "res", "y"]
        assert target.prefill_linear_kernel(SWIGLU_LINEAR_ADD, "f16", 256, 128) is None  # SwiGLU stays a pass of its own
    assert "_m128" in CudaTarget("sm_90", "fast").prefill_linear_kernel(NORM_LINEAR, "q4_0", 16384, 128, 1e-5)[0]
    assert CudaTarget("sm_61", "fast").prefill_linear_kernel(LINEAR_ADD, "f16", 256, 128) is None  # no WMMA


def test_fast_prefill_linears_are_an_operand_pass_then_an_mma_sync_gemm():
    from jitllm.ir.ops import LINEAR_ADD, NORM_LINEAR, SWIGLU_LINEAR_ADD

    fast = CudaTarget("sm_90", "fast")
    (operand, prep), (gemm, func), split_sum, _ = fast.prefill_gemm_kernels(NORM_LINEAR, "q4_0", 960, 576, 1e-5)
    assert operand.startswith("jl_gpu_operand_f16_norm_576_eps") and [p.name for p in prep.params] == ["x", "nw", "a"]
    assert gemm == "jl_gpu_gemm_q4_0_960x576_64x64x64w2x2s2" and [p.name for p in func.params] == ["a", "q", "d", "y"]
    assert func.params[0].dtype == "float16" and split_sum is None
    (operand, prep), (gemm, func), _, _ = fast.prefill_gemm_kernels(SWIGLU_LINEAR_ADD, "q4_1", 576, 1536)
    assert operand == "jl_gpu_operand_f16_swiglu_1536" and [int(d) for d in prep.params[0].shape[1:]] == [3072]
    assert gemm.endswith("_add") and [p.name for p in func.params] == ["a", "q", "d", "mn", "res", "y"]
    (operand, _), (gemm, func), _, _ = fast.prefill_gemm_kernels(LINEAR_ADD, "f16", 16384, 3072)
    assert operand == "jl_gpu_operand_f16_convert_3072" and "_128x128x64w2x4s3c_" in gemm  # wide: 128-row tiles
    assert [p.name for p in func.params] == ["a", "q", "res", "y"]
    assert "_64x64x32w2x2s2" in fast.prefill_gemm_kernels(LINEAR_ADD, "q8_0", 256, 96)[1][0]  # K: 32-steps
    assert fast.prefill_gemm_kernels(LINEAR_ADD, "f32", 256, 128) is None  # f32 weights
    assert fast.prefill_gemm_kernels(LINEAR_ADD, "f16", 96, 128) is None  # N not a multiple of 64
    assert CudaTarget("sm_90", "exact").prefill_gemm_kernels(LINEAR_ADD, "f16", 256, 128) is None  # hi + lo: WMMA
    assert CudaTarget("sm_75", "fast").prefill_gemm_kernels(LINEAR_ADD, "f16", 256, 128) is None  # no cp.async


def test_narrow_prefill_gemms_split_k_and_a_kernel_adds_the_splits():
    """Outputs narrower than 8192 take 128 x 128 tiles with K split: over 4 where K >= 8192 (any weight
    type), over 2 for f16 weights; the GEMM then stores [splits, M, N] and takes no residual, and the sum
    kernel adds the splits and the residual. The imported block calls the three kernels in turn."""
    from jitllm.ir.blocks import build_block_graph
    from jitllm.ir.llama import BLOCK_LINEARS, llama_block_kind
    from jitllm.ir.ops import LINEAR_ADD, NORM_LINEAR, SWIGLU_LINEAR_ADD
    from jitllm.lowering.onnx_import import to_relax
    from jitllm.lowering.target import kind_for_target
    from jitllm.random_model import PRESETS

    fast = CudaTarget("sm_90", "fast")
    _, (gemm, func), (total, add), _ = fast.prefill_gemm_kernels(SWIGLU_LINEAR_ADD, "q4_0", 3072, 8192)
    assert gemm == "jl_gpu_gemm_q4_0_3072x8192_128x128x64w2x4s3ck4" and [p.name for p in func.params] == ["a", "q", "d", "y"]
    assert [str(d) for d in func.params[-1].shape][::2] == ["4", "3072"]
    assert total == "jl_gpu_splitk_sum_3072_s4_add" and [p.name for p in add.params] == ["ws", "res", "y"]
    _, (gemm, _), (total, add), _ = fast.prefill_gemm_kernels(NORM_LINEAR, "f16", 5120, 3072, 1e-5)
    assert gemm.endswith("_128x128x64w2x4s3ck2") and total == "jl_gpu_splitk_sum_5120_s2"
    assert [p.name for p in add.params] == ["ws", "y"]
    assert fast.prefill_gemm_kernels(LINEAR_ADD, "q4_0", 3072, 3072)[2] is None  # quantized, K < 8192: 64 x 64
    assert fast.prefill_gemm_kernels(LINEAR_ADD, "f16", 960, 576)[2] is None  # N not a multiple of 128
    cfg = dataclasses.replace(PRESETS["tiny"], hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=8192)
    kind = kind_for_target(llama_block_kind(cfg, {n: "f16" for n in BLOCK_LINEARS}), fast)
    names = {gv.name_hint for gv in to_relax(kind, build_block_graph(kind), fast).get_global_vars()}
    assert {"jl_gpu_splitk_sum_512_s2", "jl_gpu_splitk_sum_256_s2_add", "jl_gpu_splitk_sum_256_s4_add"} <= names


def test_gpu_heads_carry_an_embedding_gather_and_the_greedy_pick():
    from jitllm.ir.blocks import build_block_graph
    from jitllm.ir.head import head_kind
    from jitllm.ir.llama import BLOCK_LINEARS, llama_block_kind
    from jitllm.lowering import ARGMAX_FUNCTION, EMBED_FUNCTION
    from jitllm.lowering.onnx_import import to_relax
    from jitllm.random_model import PRESETS

    cuda = CudaTarget("sm_90", "fast")
    for wtype, parts in (("f16", ["q"]), ("q8_0", ["q", "d"]), ("q4_1", ["q", "d", "mn"])):
        symbol, func = cuda.embedding_kernel(wtype, 512, 64)
        assert symbol == f"jl_gpu_embedding_{wtype}_512x64" and [p.name for p in func.params] == ["ids", *parts, "x"]
        assert [str(d) for d in func.params[-1].shape] == ["1", "n", "64"] and func.params[0].dtype == "int32"
    cfg = PRESETS["tiny"]
    head = head_kind(cfg, "q4_0")
    names = lambda kind: {gv.name_hint for gv in to_relax(kind, build_block_graph(kind), cuda).get_global_vars()}  # noqa: E731
    assert EMBED_FUNCTION in names(head)
    assert EMBED_FUNCTION not in names(head.decode_variant())  # decode steps take their row from the host
    assert ARGMAX_FUNCTION in names(head.decode_variant()) and ARGMAX_FUNCTION not in names(head)
    from jitllm.lowering.targets.llvm import LlvmTarget

    llvm_names = {gv.name_hint for gv in to_relax(head, build_block_graph(head), LlvmTarget()).get_global_vars()}
    assert EMBED_FUNCTION not in llvm_names and ARGMAX_FUNCTION not in llvm_names
    block = llama_block_kind(cfg, {n: "q4_0" for n in BLOCK_LINEARS})
    assert EMBED_FUNCTION not in names(block) and ARGMAX_FUNCTION not in names(block)
    symbol, func = cuda.argmax_kernel(cfg.vocab)
    assert symbol == f"jl_gpu_argmax_{cfg.vocab}" and [p.name for p in func.params] == ["logits", "token"]


def test_fused_decode_steps_rotate_inside_the_split_attention():
    """A fused decode variant has no rotary kernel: the split attention kernel takes the Q/K/V projection
    and the tables, and returns the attention and the rotated k and v (the block's outputs) beside its
    workspace; the prefill kind and an unfused decode variant keep the rotary kernel or ops and the plain
    split kernel. Neither decode variant has a merge kernel: the chunks' last block merges, counted in on
    the module's constant counters (zeros, one per KV head)."""
    from jitllm.ir.blocks import build_block_graph
    from jitllm.ir.llama import BLOCK_LINEARS, fused_kind, llama_block_kind
    from jitllm.lowering.onnx_import import to_relax
    from jitllm.lowering.target import kind_for_target
    from jitllm.random_model import PRESETS

    cuda = CudaTarget("sm_90", "fast")
    block = llama_block_kind(PRESETS["tiny"], {n: "q4_0" for n in BLOCK_LINEARS})

    def kernels(kind):
        return {gv.name_hint for gv in to_relax(kind, build_block_graph(kind), cuda).get_global_vars()}

    decode = kernels(kind_for_target(block, cuda).decode_variant())
    assert any(k.startswith("jl_gpu_split_attention_append_rotary_") for k in decode)
    assert not any(k.startswith("jl_gpu_rotary") for k in decode)
    prefill = kernels(kind_for_target(block, cuda))
    assert any(k.startswith("jl_gpu_rotary") for k in prefill) and not any("split_attention" in k for k in prefill)
    unfused = kernels(block.decode_variant())
    assert any(k.startswith("jl_gpu_split_attention_append_h") for k in unfused)
    assert fused_kind(block) != block
    assert not any("merge" in k for k in decode | unfused)
    decode_kind = kind_for_target(block, cuda).decode_variant()
    decode_main = to_relax(decode_kind, build_block_graph(decode_kind), cuda)["main"]
    split_calls = [call for call in _calls(decode_main) if "split_attention" in str(call.args[0])]
    assert len(split_calls) == 1
    counters = split_calls[0].args[1].fields[-1].value.numpy()
    assert counters.dtype == np.uint32 and counters.tolist() == [0] * PRESETS["tiny"].kv_heads
    symbol, func = cuda.split_attention_kernel(kind_for_target(block, cuda).decode_variant(), rotary=True)
    assert [p.name for p in func.params] == ["qkv", "cos", "sin", "pages", "pt", "past", "counters", "ws", "out",
                                             "k_out", "v_out"]


def test_ragged_variants_take_the_ragged_attention_and_append_on_the_gpu():
    """Batched steps' kinds (BlockKind.ragged): the ragged attention (rows of several sessions) beside the
    rotary kernel, and the ragged append as the module's append, both thread-bound GPU kernels."""
    from jitllm.ir.blocks import build_block_graph
    from jitllm.ir.llama import BLOCK_LINEARS, llama_block_kind
    from jitllm.lowering import APPEND_FUNCTION
    from jitllm.lowering.onnx_import import to_relax
    from jitllm.lowering.target import kind_for_target
    from jitllm.random_model import PRESETS

    cuda = CudaTarget("sm_90", "fast")
    assert cuda.caps.ragged_batches
    kind = kind_for_target(llama_block_kind(PRESETS["tiny"], {n: "q4_0" for n in BLOCK_LINEARS}), cuda).ragged_variant()
    mod = to_relax(kind, build_block_graph(kind), cuda)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert any(k.startswith("jl_gpu_ragged_attention_h") for k in names)
    assert not any("paged_attention" in k or "split_attention" in k for k in names)
    assert any(k.startswith("jl_gpu_rotary") for k in names)
    attention = next(mod[k] for k in names if k.startswith("jl_gpu_ragged_attention"))
    append = mod[APPEND_FUNCTION]
    assert [p.name for p in append.params] == ["pages", "k", "v", "pt", "past", "starts"]
    assert all('thread="blockIdx.x"' in func.script() for func in (attention, append))


def test_q8_0_appends_store_each_scale_as_one_16_bit_store():
    """CUDA declares q8_0 KV, and its appends (the general one, the decode step's inside the split attention,
    the ragged one) write each block's f16 scale as one 2-byte store of the half's bits, never a byte of
    it: nvcc 13.0's ptxas compiles `(signed char)(bits & 255)` of a half's bits as F2I.U8.F16 (the half's
    value truncated), which stored every scale below 1 without its low byte on the H200 (kv_store)."""
    import tvm

    from jitllm.ir.blocks import build_block_graph
    from jitllm.ir.llama import BLOCK_LINEARS, llama_block_kind
    from jitllm.lowering.onnx_import import to_relax
    from jitllm.lowering.target import kind_for_target
    from jitllm.lowering.targets.cuda import _pipeline
    from jitllm.random_model import PRESETS

    target = CudaTarget("sm_90")
    block = kind_for_target(dataclasses.replace(llama_block_kind(PRESETS["tiny-d32"], {n: "q4_1" for n in BLOCK_LINEARS}),
                                                kv_type="q8_0"), target)
    assert block.kv_type == "q8_0" and "q8_0" in target.caps.kv_types
    tvm_target = target.tvm_target()
    for kind, appends in ((block, 1), (block.decode_variant(), 2), (block.ragged_variant(), 1)):
        with tvm_target, tvm.transform.PassContext(opt_level=3):
            built = tvm.compile(to_relax(kind, build_block_graph(kind), target), target=tvm_target,
                                relax_pipeline=_pipeline(tvm_target))
        source = built.mod.imports[0].imports[0].inspect_source("")
        scale_stores = re.findall(r"\*\(char2\*\)\(pages_ptr \+ [^;]*\) = \(\*\(char2 \*\)\(&", source)
        assert len(scale_stores) == 2 * appends, kind  # K's and V's scale (one block a row) in each append
        assert "(signed char)((*(ushort *)" not in source and "ushort bits" not in source, kind


def _calls(func) -> list:
    """The relax calls (call_tir and the rest) in `func`'s body."""
    from tvm import relax

    calls = []
    relax.analysis.post_order_visit(func.body, lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    return calls


def test_bad_arch_is_a_clear_error():
    for arch in ("sm_", "sm_x9", "compute_90", "90"):
        with pytest.raises(JitllmError, match="bad CUDA arch"):
            CudaTarget(arch)


def test_tensor_core_kernel_keeps_symbolic_rows():
    _, func = CudaTarget("sm_90").linear_kernel("q4_1", 256, 128)
    x, *parts, y = func.params
    assert str(x.shape[0]) == str(y.shape[0]) == "M" and [int(d) for d in y.shape[1:]] == [256]
    assert len(parts) == 3  # quants, scales, minimums


def test_fast_family_takes_int8_matvecs_for_quantized_decode_and_f16_tensor_core_products():
    from jitllm.ir.ops import LINEAR_ADD, NORM_LINEAR, SWIGLU_LINEAR_ADD

    fast, exact = CudaTarget("sm_90", "fast"), CudaTarget("sm_90", "exact")
    for wtype in ("q8_0", "q4_0", "q4_1"):
        assert fast.linear_kernel(wtype, 128, 64, rows=1)[0].startswith(f"jl_gpu_gemv8_{wtype}_128x64")
        assert exact.linear_kernel(wtype, 128, 64, rows=1)[0].startswith(f"jl_gpu_gemv_{wtype}_128x64")
        for family in (NORM_LINEAR, LINEAR_ADD, SWIGLU_LINEAR_ADD):
            assert fast.folded_linear_kernel(family, wtype, 128, 64, 1e-5)[0].startswith("jl_gpu_gemv8_")
            assert exact.folded_linear_kernel(family, wtype, 128, 64, 1e-5)[0].startswith("jl_gpu_gemv_")
        # prefill: the same tensor-core kernel, f16 operands alone instead of hi + lo halves
        assert fast.linear_kernel(wtype, 128, 64)[0] == exact.linear_kernel(wtype, 128, 64)[0] + "_f16"
    for wtype in ("f32", "f16"):  # float weights keep f32 activations in both families
        assert fast.linear_kernel(wtype, 128, 64, rows=1)[0] == exact.linear_kernel(wtype, 128, 64, rows=1)[0]
    assert CudaTarget("sm_52", "fast").linear_kernel("q4_0", 128, 64, rows=1)[0].startswith("jl_gpu_gemv_")  # no dp4a
    assert fast.cache_key() != exact.cache_key() and fast.cache_key()["kernels"] == "fast"
    assert CudaTarget("sm_90").kernels == "exact"


def test_fast_family_takes_tensor_core_prefill_attention_where_the_head_dim_fits():
    from jitllm.random_model import preset_layout

    for preset in ("smollm2-135m", "llama-3.2-3b", "tiny"):
        kind = preset_layout(preset, "f16").block_kinds[0]
        assert CudaTarget("sm_90", "fast").attention_kernel(kind)[0].startswith("jl_gpu_mma_attention_")
        assert CudaTarget("sm_90", "exact").attention_kernel(kind)[0].startswith("jl_gpu_paged_attention_")
        assert CudaTarget("sm_61", "fast").attention_kernel(kind)[0].startswith("jl_gpu_paged_attention_")
    kind = preset_layout("tiny", "f16").block_kinds[0]
    odd = dataclasses.replace(kind, config=dataclasses.replace(kind.config, head_dim=8))  # not a fragment's width
    assert CudaTarget("sm_90", "fast").attention_kernel(odd)[0].startswith("jl_gpu_paged_attention_")


def test_int8_matvec_shares_the_quantized_input_over_row_groups():
    from jitllm.lowering.kernels.cuda.gemv_int8 import groups_per_block, int8_gemv_kernel

    assert [groups_per_block(g) for g in (2048, 640, 384, 72, 16032)] == [4, 2, 1, 1, 4]
    symbol, func = int8_gemv_kernel("q4_1", 16384, 3072)
    assert "_g4" in symbol and [p.name for p in func.params] == ["x", "qs", "d", "mn", "y"]
    _, func = int8_gemv_kernel("q4_0", 3072, 8192, "SwiGLULinearAdd")
    assert [p.name for p in func.params] == ["x", "qs", "d", "res", "y"]
    assert [int(d) for d in func.params[0].shape] == [1, 16384]  # gate then up
    with pytest.raises(ValueError, match="int8-activation"):
        int8_gemv_kernel("f16", 128, 64)


def test_unknown_gpu_kernels_is_a_clear_error():
    with pytest.raises(JitllmError, match="unknown GPU kernels 'turbo'"):
        CudaTarget("sm_90", "turbo")


def test_hopper_decode_kernels_launch_dependent_and_wait_before_reading_the_step():
    """sm_90 on, every decode kernel (both families' matvecs, the split attention, the greedy
    pick) asks for programmatic dependent launch and waits for the kernel before it before reading its
    input; float matvecs load their first weight columns before the wait (weights are no kernel's
    output), and the split attention its first tile of history after letting the next kernel launch.
    Older arches launch them as before: no wait, no launch tag."""
    from jitllm.ir.ops import LINEAR_ADD, NORM_LINEAR
    from jitllm.lowering.kernels.cuda.basic import DEPENDENT_LAUNCH
    from jitllm.random_model import preset_layout

    kind = preset_layout("tiny", "f16").block_kinds[0].decode_variant()

    def decode_kernels(target):
        return [target.folded_linear_kernel(NORM_LINEAR, "f16", 128, 64, 1e-5),
                target.linear_kernel("q4_0", 128, 64, rows=1),
                target.folded_linear_kernel(LINEAR_ADD, "q4_1", 128, 64),
                target.split_attention_kernel(kind, rotary=True), target.argmax_kernel(512)]

    for target in (CudaTarget("sm_90", "exact"), CudaTarget("sm_90", "fast")):
        for symbol, func in decode_kernels(target):
            assert DEPENDENT_LAUNCH in list(func.attrs["tirx.kernel_launch_params"]), symbol
            text = func.script()
            first_input = re.search(r"\b(x|qkv|ws|logits)\[", text).start()  # what the kernel before wrote
            assert 0 < text.index('griddepcontrol("wait"') < first_input, symbol
    _, func = CudaTarget("sm_90").folded_linear_kernel(NORM_LINEAR, "f16", 128, 64, 1e-5)
    text = func.script()
    assert 0 < text.index("wpre[") < text.index('griddepcontrol("wait"')
    # only the split attention lets the next kernel launch early, and its blocks read the history first
    for target in (CudaTarget("sm_90", "exact"), CudaTarget("sm_90", "fast")):
        for symbol, func in decode_kernels(target):
            text = func.script()
            assert ("launch_dependents" in text) == ("split_attention" in symbol), symbol
            if "split_attention" in symbol:
                assert 0 < text.index("launch_dependents") < text.index("pages[") < text.index('griddepcontrol("wait"')
    for symbol, func in decode_kernels(CudaTarget("sm_80", "fast")):
        assert "tirx.kernel_launch_params" not in (func.attrs or {}) and "griddepcontrol" not in func.script(), symbol


NEWER_TYPES = ("bf16", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def _param_names(wtype: str) -> list[str]:
    """A kernel's weight parameters for `wtype`'s parts (kernels/formats.UNION; bf16 as a float type)."""
    from jitllm.core.layouts import weight_parts

    names = [name for name, _, _ in weight_parts(wtype, 8, 256)]
    return ["w"] if wtype == "bf16" else ["d2" if n in ("m", "dmin") else n for n in names]


def test_newer_formats_take_their_own_matvecs_and_a_te_prefill_linear_in_both_families():
    """bf16 and the 5/6-bit and K-quant formats: decode matvecs (folds included) from kernels/cuda/gemv.py
    and wide.py, prefill linears as the TE definition dlight schedules (dp4a and the tensor-core paths take
    the GGML 32-block formats only), and the embedding gather."""
    from jitllm.ir.ops import LINEAR_ADD, NORM_LINEAR, SWIGLU_LINEAR_ADD

    for wtype in NEWER_TYPES:
        names = _param_names(wtype)
        for target in (CudaTarget("sm_90", "exact"), CudaTarget("sm_90", "fast")):
            symbol, func = target.linear_kernel(wtype, 256, 512, rows=1)
            assert symbol == f"jl_gpu_gemv_{wtype}_256x512" and [p.name for p in func.params] == ["x", *names, "y"]
            symbol, func = target.folded_linear_kernel(NORM_LINEAR, wtype, 256, 512, 1e-5)
            assert "rmsnormlinear_eps" in symbol and [p.name for p in func.params] == ["x", "nw", *names, "y"]
            _, func = target.folded_linear_kernel(SWIGLU_LINEAR_ADD, wtype, 256, 512)
            assert [p.name for p in func.params] == ["x", *names, "res", "y"] and int(func.params[0].shape[1]) == 1024
            symbol, func = target.linear_kernel(wtype, 256, 512)
            assert symbol == f"jl_gpu_linear_{wtype}_256x512" and len(func.params) == len(names) + 2
            assert target.prefill_linear_kernel(LINEAR_ADD, wtype, 256, 512) is None
            assert target.prefill_gemm_kernels(LINEAR_ADD, wtype, 256, 512) is None
        symbol, func = CudaTarget("sm_90").embedding_kernel(wtype, 512, 256)
        assert [p.name for p in func.params] == ["ids", *(["q"] if wtype == "bf16" else names), "x"]


def test_a_q4_k_m_block_and_a_q6_k_head_build_cuda_code():
    """llama.cpp's Q4_K_M mix (Q4_K, with Q6_K for attn_v and ffn_down: Q/K/V unfused, so decode steps take
    plain matvecs) and its Q6_K head, prefill and decode, through TVM's CUDA pipeline to CUDA source (nvcc
    not run)."""
    import tvm

    from jitllm.ir.blocks import build_block_graph
    from jitllm.ir.head import head_kind
    from jitllm.ir.llama import llama_block_kind
    from jitllm.lowering.onnx_import import to_relax
    from jitllm.lowering.target import kind_for_target
    from jitllm.lowering.targets.cuda import _pipeline
    from jitllm.random_model import PRESETS

    cfg = dataclasses.replace(PRESETS["tiny"], hidden=256, head_dim=64, ffn=512)
    mix = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q4_k", "ffn_gate": "q4_k",
           "ffn_up": "q4_k", "ffn_down": "q6_k"}
    target = CudaTarget("sm_90", "fast")
    block, head = kind_for_target(llama_block_kind(cfg, mix), target), kind_for_target(head_kind(cfg, "q6_k"), target)
    assert not block.fused
    tvm_target = target.tvm_target()
    for kind, kernels in ((block, ["jl_gpu_linear_q4_k_256x256", "jl_gpu_linear_q6_k_256x512"]),
                          (block.decode_variant(), ["jl_gpu_gemv_q4_k_256x256", "jl_gpu_gemv_q6_k_128x256",
                                                    "jl_gpu_gemv_q6_k_256x512"]),
                          (head, ["jl_gpu_linear_q6_k_320x256", "embed"]),
                          (head.decode_variant(), ["jl_gpu_gemv_q6_k_320x256_rmsnormlinear_eps"])):
        with tvm_target, tvm.transform.PassContext(opt_level=3):
            built = tvm.compile(to_relax(kind, build_block_graph(kind), target), target=tvm_target,
                                relax_pipeline=_pipeline(tvm_target))
        source = built.mod.imports[0].imports[0].inspect_source("")
        assert all(re.search(rf"__global__ void .*\b{name}\w*_kernel\(", source) for name in kernels), kind


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_newer_formats_compile_to_gpu_code_with_nvcc(tmp_path):
    """nvcc takes what TVM generates for them (an 8-wide float vector, say, it would not): a Q4_K_M decode
    block, a Q5_1 head's decode matvec and a BF16 head's prefill linear and embedding gather, as cubins."""
    from jitllm.ir.head import head_kind
    from jitllm.ir.llama import llama_block_kind
    from jitllm.lowering.cache import get_artifact
    from jitllm.lowering.target import kind_for_target
    from jitllm.random_model import PRESETS

    cfg = dataclasses.replace(PRESETS["tiny"], hidden=256, head_dim=64, ffn=512)
    mix = {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q4_k", "ffn_gate": "q4_k",
           "ffn_up": "q4_k", "ffn_down": "q6_k"}
    target = CudaTarget("sm_90")
    for kind in (llama_block_kind(cfg, mix).decode_variant(), head_kind(cfg, "q5_1").decode_variant(),
                 head_kind(cfg, "bf16")):
        artifact = get_artifact(kind_for_target(kind, target), target, tmp_path)
        assert artifact.path.read_bytes().count(b"\x7fELF") >= 2  # the host library and a cubin inside it
