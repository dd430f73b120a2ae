"""A GGUF file's metadata (its key-value section), read straight from a memory map.

gguf's GGUFReader makes numpy views of every string, which takes ~25 s for a 256k-token vocabulary;
this reads the same values in well under a second (convert/gguf_source.py still reads tensors with
GGUFReader). Format: "GGUF", u32 version, u64 tensor count, u64 key count, then per key a string
(u64 length + UTF-8), a u32 value type and the value.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from jitllm.core.errors import JitllmError

_STRING, _ARRAY = 8, 9
# GGUF value type -> (struct format, numpy dtype) of the numbers
_NUMBERS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
            5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
            12: ("<d", "<f8")}


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Key -> value (numbers, strings, lists of them); no tensor is read."""
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
            version, _, count = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise JitllmError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
            reader = _Reader(buf, 24)
            return {reader.string(): reader.value(reader.number(4)) for _ in range(count)}
        except (struct.error, ValueError, KeyError, IndexError):  # UnicodeDecodeError is a ValueError
            raise JitllmError(f"{path}: truncated or corrupt GGUF file") from None


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
