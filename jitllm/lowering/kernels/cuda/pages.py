"""Page export/import kernels for CUDA: one thread block per page row, one thread per element of a row (a
head-dim value, or a q8_0 row's byte; see kernels/cpu/pages.py for what they do; pages travel in the pool's type)."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind
from jitllm.lowering import EXPORT_PAGES, IMPORT_PAGES


def page_kernels(kind: BlockKind) -> dict[str, tvm.tirx.PrimFunc]:
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    HKV = c.kv_heads
    ROW = 2 * HKV * P  # rows of W elements (head_dim values, or q8_0's bytes) per page
    SHAPE = (2, HKV, P, W)

    @T.prim_func
    def export_pages(pages_h: T.handle, ids_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        NP = T.int64()
        N = T.int64()
        pages = T.match_buffer(pages_h, (NP, *SHAPE), KV)
        ids = T.match_buffer(ids_h, (N,), "int32")
        out = T.match_buffer(out_h, (N, *SHAPE), KV)
        for i in T.thread_binding(N * ROW, thread="blockIdx.x"):
            for dd in T.thread_binding(T.int64(W), thread="threadIdx.x"):
                out[i // ROW, i % ROW // (HKV * P), i % (HKV * P) // P, i % P, dd] = pages[
                    T.Cast("int64", ids[i // ROW]), i % ROW // (HKV * P), i % (HKV * P) // P, i % P, dd]

    @T.prim_func
    def import_pages(pages_h: T.handle, ids_h: T.handle, data_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        NP = T.int64()
        N = T.int64()
        pages = T.match_buffer(pages_h, (NP, *SHAPE), KV)
        ids = T.match_buffer(ids_h, (N,), "int32")
        data = T.match_buffer(data_h, (N, *SHAPE), KV)
        for i in T.thread_binding(N * ROW, thread="blockIdx.x"):
            for dd in T.thread_binding(T.int64(W), thread="threadIdx.x"):
                pages[T.Cast("int64", ids[i // ROW]), i % ROW // (HKV * P), i % (HKV * P) // P, i % P, dd] = data[
                    i // ROW, i % ROW // (HKV * P), i % (HKV * P) // P, i % P, dd]

    return {EXPORT_PAGES: export_pages.with_attr("global_symbol", EXPORT_PAGES),
            IMPORT_PAGES: import_pages.with_attr("global_symbol", IMPORT_PAGES)}
