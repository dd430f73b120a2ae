"""Writing a .jlm (the layout is jitllm.core.jlm's) one tensor at a time.

The header comes first in the file and holds every tensor's offset, so the writer is given a plan: each
region's tensors by name, shape and dtype, and a function that produces the region's arrays when its turn
comes. Arrays are written as they arrive and then dropped, so the memory a write needs is that of the
largest tensor being produced, not of the model (a converter streams a 7B model in the memory of one of
its matrices)."""

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
    """A region's tensors in file order, and `arrays()`: their (name, array) pairs, in any order, each
    once, made only when the region is written."""

    name: str
    tensors: tuple[TensorSpec, ...]
    arrays: Callable[[], Iterable[tuple[str, np.ndarray]]]
    pages: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Pages nested in the region: (name, its tensors: a run of `tensors`), each starting on an ALIGN
    boundary so it is one aligned copy of its own (an MoE block's experts)."""


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _layout(meta: dict, plans: Sequence[RegionPlan]) -> tuple[bytes, list[int], list[int], dict[str, dict]]:
    """The header bytes, each region's file offset and size, and each tensor's header entry."""
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
    header = {**meta, "tensors": tensors}
    # Region offsets depend on the header length, which depends on the offsets: iterate to a fixed point.
    offsets = [0] * len(plans)
    while True:
        header["regions"] = [{"name": p.name, "offset": o, "size": s, **({"pages": n} if n else {})}
                             for p, o, s, n in zip(plans, offsets, sizes, nested)]
        blob = json.dumps(header, separators=(",", ":")).encode()
        at, new = _align(_PREAMBLE.size + len(blob), ALIGN), []
        for size in sizes:
            new.append(at)
            at = _align(at + size, ALIGN)
        if new == offsets:
            return blob, offsets, sizes, tensors
        offsets = new


def write_jlm(path: str | os.PathLike, meta: dict, plans: Sequence[RegionPlan],
              progress: Callable[[str], None] | None = None) -> None:
    """Write a .jlm atomically: `meta` is the header but for "tensors" and "regions" (config, tokenizer,
    chat template, stop tokens, weight types), `plans` the regions in file order; `progress(region)` is
    called after each region. A produced array that is not the one planned is a JitllmError (the file
    is not written)."""
    path = Path(path)
    blob, offsets, sizes, entries = _layout(meta, plans)
    end = _PREAMBLE.size + len(blob)
    try:
        with atomic_write(path) as f:
            f.write(_PREAMBLE.pack(MAGIC, VERSION, 0, len(blob)))
            f.write(blob)
            for plan, offset, size in zip(plans, offsets, sizes):
                pending = {spec.name: spec for spec in plan.tensors}
                for name, arr in plan.arrays():
                    spec = pending.pop(name, None)
                    if spec is None or tuple(arr.shape) != spec.shape or arr.dtype.name != spec.dtype:
                        raise JitllmError(f"{path}: tensor {name} came out as {list(arr.shape)} {arr.dtype.name}, "
                                          f"not as planned for region {plan.name}")
                    f.seek(offset + entries[name]["offset"])
                    f.write(np.ascontiguousarray(arr).data)
                    del arr  # (not held while the next one is made)
                if pending:
                    raise JitllmError(f"{path}: region {plan.name} lacks {', '.join(pending)}")
                end = offset + size
                if progress is not None:
                    progress(plan.name)
            f.truncate(end)
    except OSError as e:
        raise JitllmError(f"cannot write {path}: {e.strerror or e}") from None

