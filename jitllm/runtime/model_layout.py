"""What a .jlm holds in runtime terms: the block kinds and which file tensor feeds which graph input."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from jitllm.core.errors import JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.core.layouts import weight_parts
from jitllm.ir.block_type import KV_PAGES
from jitllm.ir.blocks import block_kind, block_type, linear_of_input, weight_inputs
from jitllm.ir.config import BlockKind, LinearSpec, ModelConfig
from jitllm.ir.head import head_kind
from jitllm.ir.moe import cache_kind
from jitllm.runtime.model_check import check_linears, check_tensors, weight_types
from jitllm.runtime.planner import ExpertBank

HEAD = "head"


@dataclass(frozen=True)
class ModelLayout:
    config: ModelConfig
    block_kinds: tuple[BlockKind, ...]
    head: BlockKind
    embedding_type: str
    kv_type: str = "f32"
    """What its attention blocks' KV pools store (their kinds carry it too; with_kv_type sets both)."""

    @classmethod
    def from_file(cls, model: JlmFile, page_size: int = 16) -> "ModelLayout":
        """The layout of an opened file, after checking its config, weight types and tensors against each
        other (jitllm.runtime.model_check): a file that passes has every tensor the model reads."""
        try:
            cfg = ModelConfig.from_json(model.header.get("config"))
            embedding, output, blocks = weight_types(model.header.get("weights"), cfg)
            kinds = tuple(block_kind(cfg, i, w, page_size) for i, w in enumerate(blocks))
            layout = cls(cfg, kinds, head_kind(cfg, output), embedding)
            check_linears([*((f"blk.{i}.{s.name}", s) for i, k in enumerate(kinds) for s in k.linears),
                           ("output", layout.head.linears[0]),
                           ("token_embd", LinearSpec("token_embd", cfg.vocab, cfg.hidden, embedding))])
            check_tensors(model.tensors, layout.file_tensors())
        except JitllmError as e:
            raise JitllmError(f"{model.path}: {e}") from None
        return layout

    def with_kv_type(self, kv_type: str) -> "ModelLayout":
        """The layout with its attention blocks' kinds storing KV as `kv_type` (jitllm.ir.config.KV_DTYPES)."""
        kinds = tuple(replace(k, kv_type=kv_type) if block_type(k).state == KV_PAGES else k
                      for k in self.block_kinds)
        return replace(self, block_kinds=kinds, kv_type=kv_type)

    def file_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, dtype) of every tensor the model reads from its file: the embedding's parts and
        each unit's weight inputs."""
        out = {f"token_embd.{part}": (shape, dtype)
               for part, shape, dtype in weight_parts(self.embedding_type, self.config.vocab, self.config.hidden)}
        for unit, kind in [*enumerate(self.block_kinds), (HEAD, self.head)]:
            for names, (_, shape, dtype) in zip(self.weight_sources(unit), weight_inputs(kind), strict=True):
                for name in names:  # (an MoE block's experts: one file tensor each, stacked along axis 0)
                    out[name] = ((shape[0] // len(names), *shape[1:]), dtype)
        return out

    def tensor_names(self, unit: int | str) -> list[str]:
        """File tensor names feeding the weight inputs of a block (by index) or of the head."""
        return [name for group in self.weight_sources(unit) for name in group]

    def weight_sources(self, unit: int | str, kind: BlockKind | None = None) -> tuple[tuple[str, ...], ...]:
        """Per weight input of `kind` (default: the unit's kind in the file), in call order, the file
        tensors it is made of: one, or the parts a fused linear stacks along its rows."""
        if unit == HEAD:
            src = "token_embd" if self.config.tied_head else "output"
            return tuple((n if n == "output_norm" else n.replace("output_", f"{src}.", 1),)
                         for n, _, _ in weight_inputs(self.head))
        return _block_sources(kind or self.block_kinds[unit], unit)

    def unit_bytes(self, model: JlmFile, unit: int | str) -> int:
        return sum(model.tensors[n].nbytes for n in self.tensor_names(unit))

    def expert_sources(self, unit: int) -> list[tuple[str, ...]]:
        """Per routed expert of MoE block `unit`: its file tensors, in the order of the moe_experts kind's
        weight inputs (one aligned page of the file each: docs/model-format.md)."""
        kind = self.block_kinds[unit]
        sources = dict(zip((n for n, _, _ in weight_inputs(kind)), _block_sources(kind, unit), strict=True))
        inputs = [n for n, _, _ in weight_inputs(cache_kind(kind, 1))]
        return [tuple(sources[n][e] for n in inputs) for e in range(self.config.experts)]

    def expert_bank(self, model: JlmFile, unit: int) -> ExpertBank | None:
        """What expert streaming keeps of block `unit` off its device: its routed experts (None: not an MoE block)."""
        if self.block_kinds[unit].kind != "moe":
            return None
        sizes = [sum(model.tensors[n].nbytes for n in names) for names in self.expert_sources(unit)]
        return ExpertBank(len(sizes), max(sizes), self.config.experts_used)


@functools.lru_cache(maxsize=1024)
def _block_sources(kind: BlockKind, unit: int) -> tuple[tuple[str, ...], ...]:
    """ModelLayout.weight_sources of a block (~0.1 ms to derive; asked for on every load and move)."""
    sources, stacked, parts = [], block_type(kind).stacked_parts(kind), linear_of_input(kind)
    for name, _, _ in weight_inputs(kind):
        if name not in parts:
            sources.append((f"blk.{unit}.{name}",))
        else:
            linear, part = parts[name]
            sources.append(tuple(f"blk.{unit}.{p}.{part}" for p in stacked.get(linear, (linear,))))
    return tuple(sources)
