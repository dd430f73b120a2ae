"""Memory freed to glibc's malloc handed back to the system (`malloc_trim`).

glibc keeps what is freed in its heaps for later requests: a load's temporaries (the tokenizer's parse of
its JSON: 25 of its 37 MiB) and a prompt's intermediates (the naive VM allocator frees them to malloc, and
most of a prefill's are under the mmap threshold glibc raises as large buffers are freed) stay counted in
the process's RssAnon, 20-70 MiB for SmolLM2, until trimmed (docs/performance.md, memory). A no-op where
the C library has no malloc_trim (musl, macOS)."""

from __future__ import annotations

import ctypes

try:
    _trim = ctypes.CDLL(None).malloc_trim
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
except (OSError, AttributeError):
    _trim = None


def give_back_freed() -> None:
    """The free pages of every malloc heap back to the system (0.5-3 ms here, by the heap's size)."""
    if _trim is not None:
        _trim(0)
