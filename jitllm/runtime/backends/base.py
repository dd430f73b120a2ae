"""The Backend protocol: what a kind of device does with memory and compiled artifacts.

A backend owns its tensors (TVM tensors, numpy arrays, ...): everything else in the runtime holds them
as opaque values and asks the backend to make, fill, read, alias, copy and run them. One file per
backend beside this one, one line each in the registry (backends/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jitllm.ir.config import BlockKind
from jitllm.runtime.program import Program

Tensor = Any
"""A backend's own tensor type; only its backend looks inside."""

Layout = tuple[tuple[tuple[int, ...], str, int], ...]
"""(shape, dtype, byte offset) of each tensor over one buffer, in order."""


@dataclass(frozen=True)
class BackendCaps:
    """What a backend offers, declared once (callers read these instead of probing it)."""

    tensors: str
    """Its tensor family ("tvm", "numpy"): tensors of one family copy into each other directly; across
    families a copy goes through the host."""
    page_locked_host: bool = False
    """It offers page-locked host buffers (its devices' `host_allocator`): the host's memory for copies with it."""
    peer_copies: bool = False
    """Two devices of this backend can copy between each other without the host where the driver allows
    (its module's `link_peers` turns that on)."""
    unified_memory: bool = False
    """Its memory is the host's (budgets draw on host memory)."""
    memory_on_touch: bool = False
    """A large allocation takes memory only as its pages are first written (the host's malloc maps fresh
    zero pages): room allocated ahead of use costs address space, not memory, so a KV pool takes its tensor
    for the whole context at once and hands its pages out as sessions need them, never copying it."""
    captured_steps: bool = False
    """Decode steps can be recorded once and replayed (a GraphRecorder, jitllm.runtime.engine.step_graphs)."""
    async_copies: bool = False
    """It offers a `copy_queue()`: uploads from page-locked host memory on a stream of their own, ordered
    against its kernels by markers (streamed blocks' next weights upload while the current block runs)."""


class Marker(Protocol):
    """A point in a queue of device work (a CUDA event): what a later wait waits for."""


class CopyQueue(Protocol):
    """Uploads that run beside a device's kernels (BackendCaps.async_copies). Work is ordered only by
    markers: an upload starts after the marker it is given, kernels launched after `device_waits(m)`
    start after `m`, and the host blocks in `host_waits(m)`. A marker never recorded has passed."""

    def staging(self, nbytes: int) -> np.ndarray:
        """A uint8 host buffer of `nbytes` in page-locked memory, the source of `upload`."""
        ...

    def marker(self) -> Marker: ...

    def record_kernels(self, marker: Marker) -> None:
        """`marker` placed after the kernels launched so far."""
        ...

    def upload(self, dst: Tensor, src: np.ndarray, after: Marker, done: Marker) -> None:
        """Queue `src` (in a `staging` buffer) into `dst` (same bytes) once `after` passed; `done` marks its end."""
        ...

    def device_waits(self, marker: Marker) -> None:
        """Kernels launched from now on start only after `marker`."""
        ...

    def host_waits(self, marker: Marker) -> None: ...


class Backend(Protocol):
    name: str
    """The backend's kind ("host", "cuda", ...): its registry name."""
    caps: BackendCaps

    def empty(self, shape: tuple[int, ...], dtype: str) -> Tensor: ...

    def upload(self, array: np.ndarray) -> Tensor:
        """A new tensor holding `array`'s values."""
        ...

    def download(self, tensor: Tensor) -> np.ndarray:
        """The tensor's values on the host (a copy)."""
        ...

    def write(self, tensor: Tensor, array: np.ndarray) -> None:
        """`array`'s values into `tensor` (same shape)."""
        ...

    def copy(self, dst: Tensor, src: Tensor) -> None:
        """`src`'s values into `dst`; `src` is a tensor of this backend's family, here or on another device."""
        ...

    def receive(self, tensor: Tensor) -> Tensor:
        """A tensor of this backend's family here with `tensor`'s values (itself where it already is here)."""
        ...

    def region(self, buffer: Tensor, shape: tuple[int, ...], dtype: str, offset: int) -> Tensor:
        """A view of `buffer`'s bytes from `offset` for copies into or out of it (kernels may reject it)."""
        ...

    def aliases(self, buffer: Tensor, layout: Layout) -> list[Tensor]:
        """A tensor over `buffer`'s bytes for each entry of `layout`, each one that kernels accept."""
        ...

    def last_rows(self, hidden: Tensor) -> Tensor:
        """[B, 1, D]: each sequence's last row of a float32 [B, S, D] hidden state, copied here."""
        ...

    def synchronize(self) -> None: ...

    def load(self, path: Path, kind: BlockKind, page_kernels: bool) -> Program:
        """The artifact at `path` (compiled for `kind`) ready to run here; `page_kernels`: its KV append
        and page export/import functions are wanted too."""
        ...

    def copy_queue(self) -> CopyQueue:
        """Its uploads beside its kernels; only where `caps.async_copies`."""
        ...
