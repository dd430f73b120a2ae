"""The .jlm model file: one file, mmap-able, one aligned contiguous page per block.

Layout (all integers little-endian):
    0   8 bytes  magic b"JITLLM\\x00\\x01"
    8   u32      format version (VERSION)
    12  u32      reserved (0)
    16  u64      header length H
    24  H bytes  header, UTF-8 JSON (see docs/model-format.md)
    ... zero padding to ALIGN, then the regions in header order, each starting on an ALIGN boundary:
        "globals" (token embedding, final norm, output projection) and "block.0" .. "block.N-1".
Within a region, tensors follow each other, each 64-byte aligned. A block's region is the unit that
uploads, streams and migrates as one copy. Since version 2 a region may nest pages (an MoE block's
experts), each on an ALIGN boundary inside it and holding whole tensors, so one expert is one copy. jitllm.core.jlm_writer writes it.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.core.jlm_validate import check_container, tensor_nbytes
from jitllm.core.paths import special_kind

MAGIC = b"JITLLM\x00\x01"
VERSION = 2
"""Version 2 lets a region nest aligned pages (an MoE block's experts); version 1 files (no pages) load too."""
READ_VERSIONS = (1, 2)
ALIGN = 4096
TENSOR_ALIGN = 64
READ_PIECE = 8 << 20
READ_THREADS = min(8, len(os.sched_getaffinity(0)))
"""`read_into`'s pieces and threads: enough to read the page cache (or an NVMe queue) faster than a
host-to-device copy drains it, not so many that the host's own decode work starves."""
_PREAMBLE = struct.Struct("<8sIIQ")


@dataclass(frozen=True)
class TensorSpec:
    """A tensor by name, shape and dtype (what a writer plans; jitllm.core.jlm_writer)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


@dataclass(frozen=True)
class TensorEntry(TensorSpec):
    """A tensor of an opened file: its spec and where it lies."""

    region: str
    offset: int  # bytes from the region start


@dataclass(frozen=True)
class Page:
    """An aligned page nested in a region (one expert of an MoE block): one copy of its own."""

    name: str
    offset: int  # bytes from the region start
    size: int


@dataclass(frozen=True)
class Region:
    name: str
    offset: int  # bytes from the file start
    size: int
    pages: tuple[Page, ...] = ()


class JlmFile:
    """A read-only, memory-mapped .jlm. Arrays returned by `tensor` are views into the map (no copy). Opening
    checks the header's regions and tensor entries (jitllm.core.jlm_validate), so every view lies inside its
    region of the file."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:  # (non-blocking: opening a FIFO would wait for a writer; it is refused below)
            f = os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK), "rb")
        except FileNotFoundError:
            raise JitllmError(f"model file not found: {self.path}") from None
        except IsADirectoryError:
            raise JitllmError(f"{self.path} is a directory, not a .jlm model file") from None
        except OSError as e:
            raise JitllmError(f"cannot read {self.path}: {e.strerror or e}") from None
        with f:
            info = os.fstat(f.fileno())
            kind = special_kind(info.st_mode)
            if kind is not None:
                raise JitllmError(f"{self.path} is {kind}, not a .jlm model file")
            size = info.st_size
            pre = f.read(_PREAMBLE.size)
            if len(pre) < _PREAMBLE.size:
                raise JitllmError(f"{self.path}: not a .jlm model file (too short)")
            magic, version, _, hlen = _PREAMBLE.unpack(pre)
            if magic != MAGIC:
                raise JitllmError(f"{self.path}: not a .jlm model file (bad magic); convert it with `jitllm convert`")
            if version not in READ_VERSIONS:
                raise JitllmError(f"{self.path}: .jlm version {version} is not supported (this jitllm reads "
                                  f"{', '.join(map(str, READ_VERSIONS))})")
            if _PREAMBLE.size + hlen > size:
                raise JitllmError(f"{self.path}: truncated .jlm file (header cut off)")
            try:
                self.header = json.loads(f.read(hlen))
            except (ValueError, RecursionError):
                raise JitllmError(f"{self.path}: corrupt .jlm header (not JSON)") from None
            try:
                check_container(self.header, _PREAMBLE.size + hlen, size, ALIGN, TENSOR_ALIGN, pages=version >= 2)
            except JitllmError as e:
                raise JitllmError(f"{self.path}: {e}") from None
            self.regions = {r["name"]: Region(r["name"], r["offset"], r["size"],
                                              tuple(Page(p["name"], p["offset"], p["size"]) for p in r.get("pages", ())))
                            for r in self.header["regions"]}
            self.tensors = {n: TensorEntry(n, tuple(t["shape"]), t["dtype"], t["region"], t["offset"])
                            for n, t in self.header["tensors"].items()}
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._reader: io.FileIO | None = None
        """The file opened for `read_into` (at its first call), and the threads reading it."""
        self._readers: ThreadPoolExecutor | None = None

    def tensor(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        start = self.regions[t.region].offset + t.offset
        return np.frombuffer(self._map, dtype=t.dtype, count=int(np.prod(t.shape, dtype=np.int64)),
                             offset=start).reshape(t.shape)

    def release_pages(self, names: Iterable[str]) -> None:
        """Let go of the pages of these tensors that this process has read through the map. They stay in
        the page cache and fault back in if read again; a unit's weights, once copied into their device's
        buffer, are not held a second time as mapped pages."""
        for name in names:
            t = self.tensors[name]
            start = self.regions[t.region].offset + t.offset
            first = start - start % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, first, start + t.nbytes - first)

    def read_into(self, parts: Iterable[tuple[str, np.ndarray]]) -> None:
        """Each named tensor's bytes read from the file into its `out` (a uint8 array of its size) without the
        map: no page of this process's map is faulted in (streamed weights reach their page-locked staging
        so). The reads run as READ_PIECE pieces on READ_THREADS threads (preadv lets the GIL go): one thread
        reads the page cache at ~7 GB/s, under a GPU's host-to-device copy bandwidth."""
        pieces = []
        for name, out in parts:
            t = self.tensors[name]
            if out.nbytes != t.nbytes:
                raise ValueError(f"{name}: {t.nbytes} bytes, not {out.nbytes}")
            view, at = memoryview(out).cast("B"), self.regions[t.region].offset + t.offset
            pieces += [(name, view[k:k + READ_PIECE], at + k) for k in range(0, t.nbytes, READ_PIECE)]
        if self._reader is None:
            self._reader = open(self.path, "rb", buffering=0)  # (kept open, and closed, with this object)
            self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="jlm-read")
        for done in [self._readers.submit(self._read_piece, *piece) for piece in pieces]:
            done.result()

    def _read_piece(self, name: str, view: memoryview, at: int) -> None:
        while view:
            got = os.preadv(self._reader.fileno(), [view], at)
            if not got:
                raise JitllmError(f"{self.path}: truncated while reading {name}")
            view, at = view[got:], at + got

    def region_tensors(self, region: str) -> dict[str, np.ndarray]:
        return {n: self.tensor(n) for n, t in self.tensors.items() if t.region == region}

    def region_bytes(self, region: str) -> int:
        return self.regions[region].size
