"""Editing a .jlm's header in tests: the data stays where it was, so only what the edit changed is wrong."""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable
from pathlib import Path

_LENGTH = struct.Struct("<Q")
_HEADER_AT = 24


def read_header(path: Path) -> dict:
    data = path.read_bytes()
    (length,) = _LENGTH.unpack_from(data, 16)
    return json.loads(data[_HEADER_AT:_HEADER_AT + length])


def write_with_header(src: Path, dst: Path, header: dict) -> Path:
    """`src` with `header` in place of its own: the regions' bytes stay at their offsets as long as the new
    header fits before them (the writer pads the header to a 4096-byte boundary), else they follow it."""
    data = src.read_bytes()
    (length,) = _LENGTH.unpack_from(data, 16)
    first = min((r["offset"] for r in read_header(src)["regions"]), default=_HEADER_AT + length)
    blob = json.dumps(header, separators=(",", ":")).encode()
    body = data[first:] if _HEADER_AT + len(blob) <= first else data[_HEADER_AT + length:]
    padding = b"\0" * max(first - _HEADER_AT - len(blob), 0)
    dst.write_bytes(data[:16] + _LENGTH.pack(len(blob)) + blob + padding + body)
    return dst


def edited(src: Path, dst: Path, edit: Callable[[dict], object]) -> Path:
    """`src` with its header changed in place by `edit`."""
    header = copy.deepcopy(read_header(src))
    edit(header)
    return write_with_header(src, dst, header)
