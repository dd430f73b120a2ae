"""Writing a .jlm (the layout is jitllm.core.jlm's) one tensor at a time.

The header comes first in the file and holds every tensor's offset, so the writer is given a plan: each
region's tensors by name, shape and dtype, and a function that produces the region's arrays when its turn
comes. Arrays are written as they arrive and then dropped, and a tensor may arrive in pieces (runs of its
leading rows, in order), so the memory a write needs is that of the largest piece being produced, not of
the model (a converter streams a 7B model, its embedding included, a few thousand rows at a time)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jitllm.core.atomic import atomic_write
from jitllm.core.errors import JitllmError
from jitllm.core.jlm import _PREAMBLE, ALIGN, MAGIC, TENSOR_ALIGN, VERSION, TensorSpec


@dataclass(frozen=True)
class RegionPlan:
    """A region's tensors in file order, and `arrays()`: their (name, array) pieces, made only when the
    region is written. A piece is a whole tensor or a run of its leading rows (a tensor's pieces in row
    order, together covering it once); the pieces of different tensors may come in any order."""

    name: str
    tensors: tuple[TensorSpec, ...]
    arrays: Callable[[], Iterable[tuple[str, np.ndarray]]]
    pages: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Pages nested in the region: (name, its tensors: a run of `tensors`), each starting on an ALIGN
    boundary so it is one aligned copy of its own (an MoE block's experts)."""


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


_JSON = json.JSONEncoder(separators=(",", ":"))
"""The header's encoder. Its iterencode yields pieces (an escaped tokenizer is one of a few MB) that are
counted or written one at a time, so the header is never held whole nor joined into more copies."""


def _json_length(value: object) -> int:
    return sum(len(piece) for piece in _JSON.iterencode(value))  # (ASCII: characters are bytes)


def _layout(meta: dict, plans: Sequence[RegionPlan]) -> tuple[dict, int, list[int], list[int], dict[str, dict]]:
    """The header, its length in bytes, each region's file offset and size, and each tensor's header entry."""
    tensors: dict[str, dict] = {}
    sizes, nested = [], []
    for plan in plans:
        starts = {names[0]: (page, names[-1]) for page, names in plan.pages}
        at, open_page, pages = 0, None, []
        for spec in plan.tensors:
            if spec.name in starts:
                at = _align(at, ALIGN)
                open_page = starts[spec.name]
                pages.append({"name": open_page[0], "offset": at, "size": 0})
            at = _align(at, TENSOR_ALIGN)
            tensors[spec.name] = {"region": plan.name, "offset": at, "shape": list(spec.shape), "dtype": spec.dtype}
            at += spec.nbytes
            if open_page is not None and spec.name == open_page[1]:
                pages[-1]["size"] = at - pages[-1]["offset"]
                open_page = None
        sizes.append(at)
        nested.append(pages)
    header = {**meta, "tensors": tensors, "regions": []}
    rest = _json_length(header) - len("[]")  # (the header's length but for its "regions" value)
    # Region offsets depend on the header length, which depends on the offsets: iterate to a fixed point.
    offsets = [0] * len(plans)
    while True:
        header["regions"] = [{"name": p.name, "offset": o, "size": s, **({"pages": n} if n else {})}
                             for p, o, s, n in zip(plans, offsets, sizes, nested)]
        length = rest + _json_length(header["regions"])
        at, new = _align(_PREAMBLE.size + length, ALIGN), []
        for size in sizes:
            new.append(at)
            at = _align(at + size, ALIGN)
        if new == offsets:
            return header, length, offsets, sizes, tensors
        offsets = new


def write_jlm(path: str | os.PathLike, meta: dict, plans: Sequence[RegionPlan],
              progress: Callable[[str], None] | None = None) -> None:
    """Write a .jlm atomically: `meta` is the header but for "tensors" and "regions" (config, tokenizer,
    chat template, stop tokens, weight types), `plans` the regions in file order; `progress(region)` is
    called after each region. A produced piece that is not the next rows of a planned tensor, or a
    tensor left incomplete, is a JitllmError (the file is not written)."""
    path = Path(path)
    header, length, offsets, sizes, entries = _layout(meta, plans)
    end = _PREAMBLE.size + length
    try:
        with atomic_write(path) as f:
            f.write(_PREAMBLE.pack(MAGIC, VERSION, 0, length))
            for piece in _JSON.iterencode(header):
                f.write(piece.encode())
            for plan, offset, size in zip(plans, offsets, sizes):
                rows_left = {spec.name: (spec, spec.shape[0] if spec.shape else 1) for spec in plan.tensors}
                for name, arr in plan.arrays():
                    start = _piece_start(path, plan.name, rows_left, name, arr)
                    f.seek(offset + entries[name]["offset"] + start)
                    f.write(np.ascontiguousarray(arr).data)
                    del arr  # (not held while the next one is made)
                if pending := [name for name, (_, left) in rows_left.items() if left]:
                    raise JitllmError(f"{path}: region {plan.name} lacks {', '.join(pending)}")
                end = offset + size
                if progress is not None:
                    progress(plan.name)
            f.truncate(end)
    except OSError as e:
        raise JitllmError(f"cannot write {path}: {e.strerror or e}") from None



def _piece_start(path: Path, region: str, rows_left: dict[str, tuple[TensorSpec, int]], name: str,
                 arr: np.ndarray) -> int:
    """The byte offset within tensor `name` where the piece `arr` goes (after the pieces before it), after
    checking that it is the planned tensor's next rows; `rows_left` is updated."""
    spec, left = rows_left.get(name, (None, 0))
    shape = tuple(arr.shape)
    rows = shape[0] if shape else 1
    if (spec is None or arr.dtype.name != spec.dtype or len(shape) != len(spec.shape)
            or shape[1:] != spec.shape[1:] or rows > left):
        raise JitllmError(f"{path}: tensor {name} came out as {list(shape)} {arr.dtype.name}, "
                          f"not as planned for region {region}")
    total = spec.shape[0] if spec.shape else 1
    rows_left[name] = (spec, left - rows)
    return (total - left) * (spec.nbytes // total)
