"""The container checks of a .jlm header, run when the file is opened and before any tensor is read.

Every region entry is typed; regions follow the header in file order, start on an ALIGN boundary, do not
overlap and end inside the file. A region's nested pages (version 2) are typed, ALIGN-aligned, in order,
apart and inside it, and every tensor lies wholly inside one page or outside them all. Every tensor entry is typed (a known dtype, a shape of non-negative
integers) and its bytes (shape x dtype) lie inside its region, 64-byte aligned, overlapping no other
tensor's. This is header arithmetic only: the weights themselves are never read (they carry no checksum).
What the model needs of these tensors (names, shapes and dtypes from its config) is checked where the
config is read (jitllm.runtime.model_layout).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from jitllm.core.errors import JitllmError, shown


def tensor_nbytes(shape, dtype: str) -> int:
    """A tensor's size in the file (Python integers: a fuzzed shape cannot overflow it)."""
    return math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize

TENSOR_DTYPES = ("float32", "float16", "uint16", "int8", "uint8", "int16", "int32", "uint32", "float64",
                 "int64", "uint64")
"""numpy dtype names a tensor may have (plain fixed-width numbers; the layouts use the first five)."""


def check_container(header: object, data_start: int, file_size: int, align: int, tensor_align: int,
                    pages: bool = True) -> None:
    """Raise a one-line JitllmError (without the file's name) where the header's regions or tensors are not
    a valid layout of a file of `file_size` bytes whose header ends at `data_start`. `pages`: regions may
    nest pages (format version 2)."""
    if not isinstance(header, dict):
        raise JitllmError("corrupt .jlm header (not a JSON object)")
    regions = _regions(header.get("regions"), data_start, file_size, align)
    nested = _pages(header.get("regions"), regions, align, pages)
    _tensors(header.get("tensors"), regions, file_size, tensor_align, nested)


def _regions(entries: object, data_start: int, file_size: int, align: int) -> dict[str, int]:
    """The size of each region by name, after checking their order, alignment and extent."""
    if not isinstance(entries, list):
        raise JitllmError(f"corrupt .jlm header: regions must be a list (got {shown(entries)})")
    sizes: dict[str, int] = {}
    end, previous = data_start, "the header"
    for i, entry in enumerate(entries):
        what = f"region {i}"
        fields = _fields(entry, what, ("name", "offset", "size"))
        name = fields["name"]
        if not isinstance(name, str) or not name:
            raise JitllmError(f"corrupt .jlm header: {what} name must be a non-empty string (got {shown(name)})")
        what = f"region {name!r}"
        if name in sizes:
            raise JitllmError(f"corrupt .jlm header: {what} is listed twice")
        offset, size = _count(fields["offset"], f"{what} offset"), _count(fields["size"], f"{what} size")
        if offset % align:
            raise JitllmError(f"corrupt .jlm header: {what} offset {offset} is not a multiple of {align}")
        if offset < end:
            raise JitllmError(f"corrupt .jlm header: {what} starts at byte {offset}, inside {previous} "
                              f"(which ends at byte {end})")
        end, previous = offset + size, what
        if end > file_size:
            raise JitllmError(f"truncated .jlm file ({file_size} bytes; {what} ends at byte {end})")
        sizes[name] = size
    return sizes


def _pages(entries: list, regions: Mapping[str, int], align: int, allowed: bool) -> dict[str, list[tuple[int, int, str]]]:
    """Each region's nested pages as (start, end, name), after checking they are typed, aligned, in order,
    apart and inside their region."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for entry in entries:
        region, pages = entry["name"], entry.get("pages")
        if pages is None:
            continue
        what = f"region {region!r}"
        if not allowed:
            raise JitllmError(f"corrupt .jlm header: {what} nests pages, which .jlm version 1 files do not have")
        if not isinstance(pages, list):
            raise JitllmError(f"corrupt .jlm header: {what} pages must be a list (got {shown(pages)})")
        spans, end, names = [], 0, set()
        for i, page in enumerate(pages):
            fields = _fields(page, f"page {i} of {what}", ("name", "offset", "size"))
            name = fields["name"]
            if not isinstance(name, str) or not name or name in names:
                raise JitllmError(f"corrupt .jlm header: page {i} of {what} needs a name of its own (got {shown(name)})")
            names.add(name)
            page_what = f"page {name!r} of {what}"
            offset, size = _count(fields["offset"], f"{page_what} offset"), _count(fields["size"], f"{page_what} size")
            if offset % align:
                raise JitllmError(f"corrupt .jlm header: {page_what} offset {offset} is not a multiple of {align}")
            if offset < end:
                raise JitllmError(f"corrupt .jlm header: {page_what} starts at byte {offset}, inside the page "
                                  f"before it (which ends at byte {end})")
            end = offset + size
            if end > regions[region]:
                raise JitllmError(f"corrupt .jlm header: {page_what} ends at byte {end} of a region of "
                                  f"{regions[region]}")
            spans.append((offset, end, name))
        out[region] = spans
    return out


def _tensors(entries: object, regions: Mapping[str, int], file_size: int, tensor_align: int,
             pages: Mapping[str, list[tuple[int, int, str]]]) -> None:
    if not isinstance(entries, dict):
        raise JitllmError(f"corrupt .jlm header: tensors must be an object (got {shown(entries)})")
    spans: dict[str, list[tuple[int, int, str]]] = {name: [] for name in regions}
    for name, entry in entries.items():
        what = f"tensor {name!r}"
        fields = _fields(entry, what, ("region", "offset", "shape", "dtype"))
        region, dtype, shape = fields["region"], fields["dtype"], fields["shape"]
        if not isinstance(region, str) or region not in regions:
            raise JitllmError(f"corrupt .jlm header: {what} is in region {shown(region)}, which the header "
                              "does not list")
        if dtype not in TENSOR_DTYPES:
            raise JitllmError(f"corrupt .jlm header: {what} has dtype {shown(dtype)} (known: "
                              f"{', '.join(TENSOR_DTYPES)})")
        if not isinstance(shape, list):
            raise JitllmError(f"corrupt .jlm header: {what} shape must be a list (got {shown(shape)})")
        dims = [_count(d, f"{what} shape") for d in shape]
        if any(d > file_size for d in dims):  # (no tensor of the file has a dimension larger than the file)
            raise JitllmError(f"corrupt .jlm header: {what} shape {shown(shape)} is larger than the file")
        offset = _count(fields["offset"], f"{what} offset")
        if offset % tensor_align:
            raise JitllmError(f"corrupt .jlm header: {what} offset {offset} is not a multiple of {tensor_align}")
        end = offset + tensor_nbytes(dims, dtype)
        if end > regions[region]:
            raise JitllmError(f"corrupt .jlm header: {what} ({shown(shape)} {dtype}) ends at byte {end} of "
                              f"region {region!r}, which has {regions[region]}")
        for start, stop, page in pages.get(region, ()):
            if offset < stop and end > start and not (start <= offset and end <= stop):
                raise JitllmError(f"corrupt .jlm header: {what} straddles the edge of page {page!r} of region "
                                  f"{region!r}")
        spans[region].append((offset, end, name))
    for region, items in spans.items():
        items.sort()
        for (_, end, first), (start, _, second) in zip(items, items[1:]):
            if start < end:
                raise JitllmError(f"corrupt .jlm header: tensors {first!r} and {second!r} overlap in region "
                                  f"{region!r}")


def _fields(entry: object, what: str, names: tuple[str, ...]) -> dict:
    if not isinstance(entry, dict):
        raise JitllmError(f"corrupt .jlm header: {what} must be an object (got {shown(entry)})")
    missing = [n for n in names if n not in entry]
    if missing:
        raise JitllmError(f"corrupt .jlm header: {what} lacks {', '.join(missing)}")
    return entry


def _count(value: object, what: str) -> int:
    """`value` where it is a non-negative JSON integer (not a bool, a float or a string)."""
    if type(value) is not int or value < 0:
        raise JitllmError(f"corrupt .jlm header: {what} must be a non-negative integer (got {shown(value)})")
    return value

