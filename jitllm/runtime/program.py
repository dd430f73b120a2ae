"""A compiled block kind loaded onto a device: its entry (`main`), the KV append and page kernels, and (GPU
heads) the embedding row gather and the greedy pick, as callables of the device's backend over its
tensors (backends/*.py load them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Program:
    main: Callable
    append: Callable | None
    export_pages: Callable | None
    import_pages: Callable | None
    embed: Callable | None = None
    """(ids [1, n] int32, the head's weight parts, x [1, n, hidden] f32) where the artifact has it."""
    argmax: Callable | None = None
    """(logits [1, 1, vocab] f32, token [1] int32): the first largest logit's index, where the artifact has it."""
