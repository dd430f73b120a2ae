"""A GGUF file's metadata (its key-value section) and its tensor infos, read straight from a memory map.

gguf's GGUFReader makes numpy views of every string (~25 s and ~160 MB for a 49k-token vocabulary, more
for 256k); this reads the same values in well under a second and keeps only the decoded values. The
converter maps the data section itself (convert/gguf_source.py). Format (GGUF v2/v3): "GGUF", u32
version, u64 tensor count, u64 key count; per key a string (u64 length + UTF-8), a u32 value type and
the value; per tensor its name, u32 dimension count, u64 dimensions (the row length first), u32 GGML
type and u64 offset from the data section, which starts at the next multiple of general.alignment (32
where absent).
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jitllm.core.errors import JitllmError, shown

_STRING, _ARRAY = 8, 9
# GGUF value type -> (struct format, numpy dtype) of the numbers
_NUMBERS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
            5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
            12: ("<d", "<f8")}
DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # (GGML_MAX_DIMS)


@dataclass(frozen=True)
class GgufTensorInfo:
    """One tensor's entry: `dims` in GGUF order (the row length first: [in, out] for a matrix), `ggml_type`
    the GGML type's number, `offset` in bytes from the data section's start."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GgufContents:
    """Everything before a GGUF's tensor data: metadata, tensor infos, and where the data section starts."""

    metadata: dict[str, Any]
    tensors: list[GgufTensorInfo]
    data_start: int


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Key -> value (numbers, strings, lists of them); no tensor is read."""
    return read_gguf(path).metadata


def read_gguf(path: Path) -> GgufContents:
    """The metadata and tensor infos of the GGUF at `path` (no tensor data is read or checked)."""
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise JitllmError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError:  # mmap of an empty file
        raise JitllmError(f"{path}: not a GGUF file (empty)") from None
    with buf:
        if buf[:4] != b"GGUF":
            raise JitllmError(f"{path}: not a GGUF file")
        try:
            version, n_tensors, count = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise JitllmError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
            reader = _Reader(buf, 24)
            metadata = {reader.string(): reader.value(reader.number(4)) for _ in range(count)}
            alignment = _alignment(path, metadata)
            tensors = [reader.tensor_info() for _ in range(n_tensors)]
        except (struct.error, ValueError, KeyError, IndexError):  # UnicodeDecodeError is a ValueError
            raise JitllmError(f"{path}: truncated or corrupt GGUF file") from None
        duplicates = [name for name, n in Counter(t.name for t in tensors).items() if n > 1]
        if duplicates:
            raise JitllmError(f"{path}: truncated or corrupt GGUF file (tensor {shown(duplicates[0])} appears twice)")
        return GgufContents(metadata, tensors, -(-reader.pos // alignment) * alignment)


def _alignment(path: Path, metadata: dict[str, Any]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(value) is not int or value <= 0 or value & (value - 1):
        raise JitllmError(f"{path}: general.alignment must be a power of two (got {shown(value)})")
    return value


class _Reader:
    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def number(self, kind: int) -> int | float | bool:
        fmt = _NUMBERS[kind][0]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.number(10)
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("string past the end of the file")
        text = self.buf[self.pos:end].decode("utf-8")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.number(kind)
        item, n = self.number(4), self.number(10)
        if item not in _NUMBERS:  # strings, arrays
            return [self.value(item) for _ in range(n)]
        dtype = np.dtype(_NUMBERS[item][1])
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
        self.pos += n * dtype.itemsize
        return values

    def tensor_info(self) -> GgufTensorInfo:
        name, n_dims = self.string(), self.number(4)
        if n_dims > _MAX_DIMS:
            raise ValueError(f"{n_dims} dimensions")
        dims = tuple(self.number(10) for _ in range(n_dims))
        return GgufTensorInfo(name, dims, self.number(4), self.number(10))
