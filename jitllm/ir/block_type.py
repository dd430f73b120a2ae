"""The BlockType protocol: what a kind of block is, declared in one object (its linears, weight and
activation inputs, graph body, and the state it carries between steps), so the compiler and the engine
ask the type instead of comparing names. Types live one per module (llama.py, moe.py, gla.py, head.py) and in
one registry (blocks.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from jitllm.ir.config import BlockKind, ModelConfig
from jitllm.ir.graph import GraphBuilder

if TYPE_CHECKING:
    import onnx

KV_PAGES = "kv-pages"
"""Per session, KV pages in the device's pool, listed by a page table (attention)."""
RECURRENT = "recurrent"
"""Per session, one fixed-size state tensor updated in place (jitllm.runtime.engine.recurrent)."""
NO_STATE = "none"
"""Nothing kept between steps (the head)."""

Inputs = list[tuple[str, tuple, str]]
"""(graph input name, shape with symbolic dims by name, dtype)."""


class BlockType(Protocol):
    name: str
    """The kind's `BlockKind.kind`, and its name in ModelConfig.block_types."""
    state: str
    """KV_PAGES, RECURRENT or NO_STATE."""
    head: bool
    """It ends the model: final norm and the projection to logits (never one of the decoder blocks)."""
    linear_names: tuple[str, ...]
    """Its linears as the model file names them, in order."""

    def linear_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """[out, in] of each of its linears."""
        ...

    def kind(self, cfg: ModelConfig, wtypes: dict[str, str], page_size: int = 16) -> BlockKind:
        """The kind of a block of this type whose linears are stored as `wtypes`."""
        ...

    def stacked_parts(self, kind: BlockKind) -> dict[str, tuple[str, ...]]:
        """Linears of `kind` whose weight stacks several of the file's linears along its rows (a fused
        kind's Q/K/V; an MoE block's experts): linear name -> the file's linears, in order."""
        ...

    def fused(self, kind: BlockKind) -> BlockKind:
        """The kind with linears that share an input stacked into one (itself where it has none to stack)."""
        ...

    def state_shape(self, kind: BlockKind) -> tuple[int, ...] | None:
        """A RECURRENT type's per-session state tensor (float32, one sequence); None for the others."""
        ...

    def weight_inputs(self, kind: BlockKind) -> Inputs: ...

    def activation_inputs(self, kind: BlockKind) -> Inputs: ...

    def body(self, g: GraphBuilder, kind: BlockKind, lead: tuple) -> list[onnx.ValueInfoProto]:
        """Its nodes into `g`, reading its activation and weight inputs by name; its outputs' infos."""
        ...
