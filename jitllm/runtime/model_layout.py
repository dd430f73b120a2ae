"""What a .jlm holds in runtime terms: the block kinds and which file tensor feeds which graph input."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from jitllm.core.errors import JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.ir.blocks import block_kind, block_type, weight_inputs
from jitllm.ir.config import BlockKind, ModelConfig
from jitllm.ir.head import head_kind

HEAD = "head"


@dataclass(frozen=True)
class ModelLayout:
    config: ModelConfig
    block_kinds: tuple[BlockKind, ...]
    head: BlockKind
    embedding_type: str

    @classmethod
    def from_file(cls, model: JlmFile, page_size: int = 16) -> "ModelLayout":
        header = model.header
        try:
            cfg = ModelConfig.from_json(header["config"])
            weights = header["weights"]
            kinds = tuple(block_kind(cfg, i, w, page_size) for i, w in enumerate(weights["blocks"]))
            head = head_kind(cfg, weights["output"])
            embedding = weights["token_embd"]
        except KeyError as e:
            raise JitllmError(f"{model.path}: corrupt .jlm header (missing {e})") from None
        except TypeError as e:  # (not a missing entry: a value of the wrong kind)
            raise JitllmError(f"{model.path}: corrupt .jlm header ({e})") from None
        except JitllmError as e:
            raise JitllmError(f"{model.path}: {e}") from None
        if len(kinds) != cfg.num_blocks:
            raise JitllmError(f"{model.path}: header lists {len(kinds)} blocks, config says {cfg.num_blocks}")
        return cls(cfg, kinds, head, embedding)

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


@functools.lru_cache(maxsize=1024)
def _block_sources(kind: BlockKind, unit: int) -> tuple[tuple[str, ...], ...]:
    """ModelLayout.weight_sources of a block (~0.1 ms to derive; asked for on every load and move)."""
    sources, fused = [], block_type(kind).fused_parts
    for name, _, _ in weight_inputs(kind):
        linear = next((s.name for s in kind.linears if name.startswith(s.name + "_")), None)
        if linear is None:
            sources.append((f"blk.{unit}.{name}",))
        else:
            part = name[len(linear) + 1:]
            sources.append(tuple(f"blk.{unit}.{p}.{part}" for p in fused.get(linear, (linear,))))
    return tuple(sources)
