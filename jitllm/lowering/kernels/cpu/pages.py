"""Page export/import kernels for the host: copy a block's KV pages out of a pool into one contiguous
tensor, and into another pool at other page ids. Migration is export (source device) + one transfer + import.
Pages travel in the pool's type and row layout (BlockKind.kv_type, kv_row): conversion between pools of two
types is the caller's."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from jitllm.ir.config import BlockKind
from jitllm.lowering import EXPORT_PAGES, IMPORT_PAGES


def page_kernels(kind: BlockKind) -> dict[str, tvm.tirx.PrimFunc]:
    c, P, KV, W = kind.config, kind.page_size, kind.kv_dtype, kind.kv_row
    HKV = c.kv_heads
    SHAPE = (2, HKV, P, W)

    @T.prim_func
    def export_pages(pages_h: T.handle, ids_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        NP = T.int64()
        N = T.int64()
        pages = T.match_buffer(pages_h, (NP, *SHAPE), KV)
        ids = T.match_buffer(ids_h, (N,), "int32")
        out = T.match_buffer(out_h, (N, *SHAPE), KV)
        for i, two, h, p in T.grid(N, 2, HKV, P):
            for dd in T.vectorized(W):
                out[i, two, h, p, dd] = pages[T.Cast("int64", ids[i]), two, h, p, dd]

    @T.prim_func
    def import_pages(pages_h: T.handle, ids_h: T.handle, data_h: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        NP = T.int64()
        N = T.int64()
        pages = T.match_buffer(pages_h, (NP, *SHAPE), KV)
        ids = T.match_buffer(ids_h, (N,), "int32")
        data = T.match_buffer(data_h, (N, *SHAPE), KV)
        for i, two, h, p in T.grid(N, 2, HKV, P):
            for dd in T.vectorized(W):
                pages[T.Cast("int64", ids[i]), two, h, p, dd] = data[i, two, h, p, dd]

    return {EXPORT_PAGES: export_pages.with_attr("global_symbol", EXPORT_PAGES),
            IMPORT_PAGES: import_pages.with_attr("global_symbol", IMPORT_PAGES)}
