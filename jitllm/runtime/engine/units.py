"""Units and their weights: a block (or the head) resident on a device, with the programs of its kind
there. One artifact per kind and target serves every block of the kind; a unit's weights are one
allocation on its device (packed_weights.py), laid out for its kind there, or, for a streamed block, a
slot of its device's SlotPool while it runs (streaming.py). A block that streams its experts (expert
streaming) holds its attention, router and shared expert; its routed experts run through its device's
expert cache (streaming.ExpertCache) after its program."""

from __future__ import annotations

from dataclasses import dataclass, replace

from jitllm.ir.block_type import KV_PAGES
from jitllm.ir.blocks import block_type
from jitllm.ir.config import BlockKind
from jitllm.lowering.cache import load_artifact
from jitllm.lowering.target import kind_for_target
from jitllm.runtime.device import Device
from jitllm.runtime.engine.packed_weights import PackedWeights
from jitllm.ir.moe import cache_kind
from jitllm.runtime.engine.streaming import ExpertBank, ExpertCache, SlotPool, StreamedSource
from jitllm.runtime.model_layout import HEAD, ModelLayout
from jitllm.runtime.program import Program


@dataclass
class Unit:
    """A block (index) or the head, resident on a device."""

    index: int | str
    kind: BlockKind
    device: Device
    weights: PackedWeights | None
    """Its weights on the device; None while it streams (`stream`)."""
    nbytes: int
    program: Program
    decode_program: Program | None = None
    """The batch-1, seq-1 variant where the device's target has one (decode steps)."""
    stream: SlotPool | None = None
    """Where it is a streamed block: its device's slots, which hold its weights while it runs."""
    experts: ExpertCache | None = None
    """Where it streams its routed experts: its device's expert cache (its program is the experts-apart kind's)."""

    def call_weights(self) -> list:
        """The weights its program takes now: its own, or (streamed) a slot's, uploaded for it."""
        return self.weights if self.stream is None else self.stream.acquire(self.index)

    def outputs(self, out) -> tuple:
        """(h, k_new, v_new) of its program's outputs: where it streams its experts, h after its routed
        experts ran over their outputs (y = x2 there, then jitllm.ir.moe.ROUTED_OUTPUTS)."""
        if self.experts is None:
            return out
        x, k, v, h, ids, weights, *shared = out
        return self.experts.run(self.index, x, h, ids, weights, shared[0] if shared else None), k, v

    def launched(self) -> None:
        """Its kernels of this step are launched (a streamed unit's slot is refilled once they ran)."""
        if self.stream is not None:
            self.stream.release(self.index)

    @property
    def state(self) -> str:
        """What its block type carries per session (jitllm.ir.block_type: KV pages, recurrent state, none)."""
        return block_type(self.kind).state

    def program_for(self, tokens: int) -> Program:
        return self.decode_program if tokens == 1 and self.decode_program is not None else self.program


def program(ex, kind: BlockKind, device: Device) -> Program:
    """The compiled `kind` on `device` (from the cache, compiled where it lacks it), loaded once."""
    key = (kind, device.name)
    if key not in ex._programs:
        main_appends = kind.decode and device.target.caps.decode_appends_kv
        page_kernels = block_type(kind).state == KV_PAGES and not main_appends
        ex._programs[key] = load_artifact(kind, device.target, lambda path: device.load(path, kind, page_kernels),
                                          ex.cache_dir, log=ex.log)
    return ex._programs[key]


def placed(ex, index: int | str, device: Device) -> tuple[BlockKind, Program, Program | None]:
    """The unit's kind on `device` and its programs there (Executor.programs), worked out once per unit and
    device: a move's lookup is then one dict hit (deriving and hashing the kinds took ~20 us)."""
    key = (index, device.name)
    found = ex._placed.get(key)
    if found is None:
        kind = kind_on(ex.layout, index, device)
        found = ex._placed[key] = (kind, *ex.programs(kind, device))
    return found


def kind_on(layout: ModelLayout, index: int | str, device: Device) -> BlockKind:
    """The unit's kind as compiled for `device` (jitllm.lowering.target.kind_for_target)."""
    kind = layout.head if index == HEAD else layout.block_kinds[index]
    return kind_for_target(kind, device.target)


def load_unit(ex, index: int | str, device: Device, streamed: bool = False, banked: bool = False) -> Unit:
    """Block `index` (or the head) uploaded to `device`, charged to its budget, its programs loaded;
    `streamed`: its weights stay in the file and its device's slots are charged instead; `banked`: an MoE
    block whose routed experts stream through its device's expert cache (the rest is loaded as above)."""
    kind = kind_on(ex.layout, index, device)
    if banked:
        kind = replace(kind, experts_apart=True)
    names = [n for group in ex.layout.weight_sources(index, kind) for n in group]
    nbytes = sum(ex.model.tensors[n].nbytes for n in names)
    stream = weights = None
    if streamed:
        stream = admit(ex, index, device, kind)
    else:
        device.reserve(nbytes, f"weights of {'block ' + str(index) if index != HEAD else 'the head'}")
        weights = upload_weights(ex, index, device, kind)
    if block_type(kind).state == KV_PAGES:
        ex.pool(device)
    programs = ex.programs(kind, device) if banked else placed(ex, index, device)[1:]
    experts = bank(ex, index, device, kind) if banked else None
    return Unit(index, kind, device, weights, nbytes, *programs, stream=stream, experts=experts)


def pool_of(ex, device: Device) -> SlotPool:
    """`device`'s SlotPool (made at the first unit that streams there: its blocks or its experts)."""
    pool = ex.streams.get(device.name)
    if pool is None:
        pool = ex.streams[device.name] = SlotPool(device, ex.model)
    return pool


def bank(ex, index: int, device: Device, kind: BlockKind) -> ExpertCache:
    """Block `index`'s routed experts (of its experts-apart `kind`) streamed through `device`'s expert cache,
    made at the first such block with the slots the plan gave it."""
    pool = pool_of(ex, device)
    slots = ex.expert_slots[device.name]
    experts_kind = kind_for_target(cache_kind(kind, slots), device.target)
    if pool.experts is None:
        pool.experts = ExpertCache(pool, experts_kind, ex.program(experts_kind, device), slots, ex.expert_policy)
    names = [list(group) for group in ex.layout.expert_sources(index)]
    pool.experts.admit(index, ExpertBank([[ex.model.tensor(n) for n in group] for group in names], names), experts_kind)
    return pool.experts


def admit(ex, index: int, device: Device, kind: BlockKind) -> SlotPool:
    """Block `index` streamed through `device`'s slots (its SlotPool made at the first), laid out for `kind`."""
    pool = pool_of(ex, device)
    groups = ex.layout.weight_sources(index, kind)
    parts = [[ex.model.tensor(n) for n in group] for group in groups]
    names = [n for group in groups for n in group]
    pool.admit(index, StreamedSource(parts, names, sum(ex.model.tensors[n].nbytes for n in names)))
    return pool


def upload_weights(ex, index: int | str, device: Device, kind: BlockKind | None = None) -> PackedWeights:
    """A unit's weights (laid out for `kind`, default its kind on `device`) copied from its .jlm page into
    one allocation on `device`; fused linears are stacked here, once per load or move. The file's pages
    read for it are let go after (the host would otherwise hold every weight twice: mapped and packed)."""
    kind = kind or kind_on(ex.layout, index, device)
    groups = ex.layout.weight_sources(index, kind)
    weights = PackedWeights.upload(device, [[ex.model.tensor(n) for n in group] for group in groups])
    ex.model.release_pages(n for group in groups for n in group)
    return weights
