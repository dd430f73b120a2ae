"""Which device runs each block: budgets, the seam, declines and placement maps, on integers only.

Order of decisions:
1. Placement-map entries, pinned ones first, each in block order. A device target that cannot hold
   the block is a decline (or, with strict, an error); the block then falls to step 2.
2. The engine fills the remaining blocks in order, first blocks to the first device, moving to the
   next device when one is full. The block that found no room is declined by each device in turn;
   the blocks after it run on the host. The seam is the last block the engine put on a device
   (blocks the map placed are not part of it). `gpu_layers` caps device blocks (map-placed count).
3. The head (output projection) goes where the map says, else onto the device holding the last
   device block if it fits there, else to the host. Like llama.cpp's -ngl, a `gpu_layers` cap of at
   most the number of blocks keeps the head on the host.
A streamed block (`~`) keeps its weights in the mapped file and is swapped through STREAM_SLOTS slots of
its device each token, each as large as the largest block streamed there: only the slots are charged to
the budget (when the first streamed block there is placed). A device whose budget cannot hold them is an
error, strict or not: falling back to the host would not be what `~` asked for.
With expert streaming (JITLLM_GPU_STREAM=1; `banks`), an MoE block placed on a device is charged without its
routed experts (its attention, router and shared expert stay there); after the head, each device holding
such blocks gives what its budget has left to an expert cache (whole experts, at most all of its blocks'
experts). A cache that cannot hold one token's picks of a block is an error.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from jitllm.core.errors import JitllmError
from jitllm.runtime.device_spec import DeviceChoice, format_bytes
from jitllm.runtime.placement import HOST, Placement, PlacementEntry

STREAM_SLOTS = 2
"""Device slots a device streams its blocks through: one being computed while the next one's upload runs."""


@dataclass(frozen=True)
class ExpertBank:
    """An MoE block's routed experts, as expert streaming charges them: `experts` of `expert_bytes` each
    (the largest expert's file bytes), `used` of them picked per token."""

    experts: int
    expert_bytes: int
    used: int

    @property
    def nbytes(self) -> int:
        return self.experts * self.expert_bytes


@dataclass(frozen=True)
class Assignment:
    """Where one block (or the head) runs. `device` is a DeviceChoice.name or the host's name."""

    device: str
    bytes: int
    pinned: bool = False
    streamed: bool = False
    reason: str = ""
    experts_streamed: bool = False
    """Its routed experts stay in the file and pass through its device's expert cache (`bytes` is the rest)."""


@dataclass(frozen=True)
class Decline:
    """A device that would not take a block (`block` None = the head), and why."""

    block: int | None
    wanted: str
    reason: str


@dataclass(frozen=True)
class DeviceBudget:
    """A device's weight budget after planning; `slot_bytes` is the size of each of its STREAM_SLOTS
    streaming slots (inside `used_bytes`), `streamed_bytes` the weights of the `streamed` blocks there."""

    name: str
    budget_bytes: int
    used_bytes: int
    slot_bytes: int
    streamed: int = 0
    streamed_bytes: int = 0
    shares_budget_of: str | None = None
    """The device whose budget this one shares (one card through two APIs), as DeviceChoice says."""
    card_used_bytes: int | None = None
    """What every view of a shared card uses together; None where the budget is the device's own."""
    expert_slots: int = 0
    """Experts its expert cache holds (inside `used_bytes`), each `expert_bytes`, for `expert_blocks` blocks."""
    expert_bytes: int = 0
    expert_blocks: int = 0

    @property
    def left_bytes(self) -> int:
        return self.budget_bytes - (self.used_bytes if self.card_used_bytes is None else self.card_used_bytes)

    @property
    def upload_bytes_per_token(self) -> int:
        """What a token's uploads cost: every streamed block once, unless they all fit in the slots (then
        they are uploaded once, at the first token)."""
        return self.streamed_bytes if self.streamed > STREAM_SLOTS else 0


@dataclass(frozen=True)
class Plan:
    """Every block's Assignment (by block id), the head's, and how the devices' budgets were spent."""

    blocks: tuple[Assignment, ...]
    head: Assignment
    seam: int | None
    """The last block the engine put on a device (map-placed blocks are not part of the seam);
    None when the engine put none there."""
    declines: tuple[Decline, ...]
    budgets: tuple[DeviceBudget, ...]
    host_name: str = HOST

    def device_of(self, block: int) -> str:
        return self.blocks[block].device

    def blocks_on(self, device: str) -> list[int]:
        return [i for i, a in enumerate(self.blocks) if a.device == device]

    @property
    def banked(self) -> list[int]:
        """The blocks whose routed experts stream (through their device's expert cache)."""
        return [i for i, a in enumerate(self.blocks) if a.experts_streamed]

    def expert_slots(self, device: str) -> int:
        """The experts `device`'s expert cache holds (0: it has none)."""
        return next((b.expert_slots for b in self.budgets if b.name == device), 0)

    def describe(self) -> str:
        """The plan as `-v` prints it."""
        lines = ["blocks:"]
        for first, last, a in _runs(self.blocks):
            ids = str(first) if first == last else f"{first}-{last}"
            size = format_bytes(a.bytes) + ("" if first == last else " each")
            lines.append(f"  {ids:<9} {a.device:<10} {size:<16} {_flags(a):<17} {a.reason}")
        h = self.head
        lines.append(f"  {'head':<9} {h.device:<10} {format_bytes(h.bytes):<16} {_flags(h):<17} {h.reason}")
        if self.seam is None:
            lines.append("seam: none (the engine put no block on a device)")
        else:
            rest = sum(a.device == self.host_name for a in self.blocks[self.seam + 1:])
            later = f" ({rest} later blocks on the host)" if rest else ""
            lines.append(f"seam: after block {self.seam}{later}")
        if self.declines:
            lines.append("declines:")
            for d in self.declines:
                what = "head" if d.block is None else f"block {d.block}"
                lines.append(f"  {what} declined by {d.wanted}: {d.reason}")
        for b in self.budgets:
            slot = ""
            if b.streamed:
                slot = (f", {STREAM_SLOTS} streaming slots of {format_bytes(b.slot_bytes)} ({b.streamed} blocks "
                        f"stream: {format_bytes(b.upload_bytes_per_token)} uploaded per token)")
            if b.expert_blocks:
                slot += (f", expert cache of {b.expert_slots} experts of {format_bytes(b.expert_bytes)} "
                         f"({format_bytes(b.expert_slots * b.expert_bytes)}; {b.expert_blocks} blocks stream their experts)")
            budget = format_bytes(b.budget_bytes)
            if b.card_used_bytes is not None:
                budget += f" (one card's, {format_bytes(b.card_used_bytes)} used by all its views)"
            lines.append(f"{b.name}: used {format_bytes(b.used_bytes)} of {budget}, "
                         f"{format_bytes(b.left_bytes)} left{slot}")
        host = [a for a in self.blocks + (self.head,) if a.device == self.host_name or a.streamed]
        banks = f" and the routed experts of {len(self.banked)} blocks" if self.banked else ""
        lines.append(f"{self.host_name}: holds {format_bytes(sum(a.bytes for a in host))} of weights{banks} "
                     f"({len(self.blocks_on(self.host_name))} blocks run there)")
        return "\n".join(lines)


def plan(block_bytes: list[int], head_bytes: int, devices: list[DeviceChoice],
         placement: Placement | None = None, gpu_layers: int | None = None, strict: bool = False,
         host_name: str = HOST, banks: list[ExpertBank | None] | None = None) -> Plan:
    """Assign every block and the head to a device or the host (see the module doc for the rules);
    `banks`: per block, the routed experts expert streaming keeps off its device (None: a dense block)."""
    if banks is None or not any(banks):
        return _plan(block_bytes, head_bytes, devices, placement, gpu_layers, strict, host_name)
    rest = [size - (bank.nbytes if bank else 0) for size, bank in zip(block_bytes, banks, strict=True)]
    the_plan = _plan(rest, head_bytes, devices, placement, gpu_layers, strict, host_name)
    blocks = tuple(replace(a, bytes=full) if a.device == host_name else
                   replace(a, experts_streamed=banks[i] is not None)
                   for i, (a, full) in enumerate(zip(the_plan.blocks, block_bytes)))
    budgets = tuple(_expert_cache(b, [banks[i] for i, a in enumerate(blocks) if a.device == b.name and
                                      a.experts_streamed]) for b in the_plan.budgets)
    return replace(the_plan, blocks=blocks, budgets=budgets)


def _expert_cache(budget: DeviceBudget, banks: list[ExpertBank]) -> DeviceBudget:
    """`budget` with an expert cache of what it has left (in whole experts, at most all of `banks`' experts);
    a one-line error where that cannot hold one token's picks of a block."""
    if not banks:
        return budget
    size, used = max(b.expert_bytes for b in banks), max(b.used for b in banks)
    slots = min(budget.left_bytes // size, sum(b.experts for b in banks))
    if slots < used:
        raise JitllmError(f"JITLLM_GPU_STREAM=1: {budget.name} has {format_bytes(budget.left_bytes)} left for its "
                          f"expert cache, room for {slots} experts of {format_bytes(size)}, but a token routes to "
                          f"{used} experts of each block: give {budget.name} at least "
                          f"{format_bytes(budget.used_bytes + used * size)}")
    return replace(budget, used_bytes=budget.used_bytes + slots * size, expert_slots=slots, expert_bytes=size,
                   expert_blocks=len(banks))


def _plan(block_bytes: list[int], head_bytes: int, devices: list[DeviceChoice], placement: Placement | None,
          gpu_layers: int | None, strict: bool, host_name: str) -> Plan:
    if gpu_layers is not None and gpu_layers < 0:
        raise JitllmError(f"-gpu-layers {gpu_layers}: must be 0 or more")
    names = {alias: d.name for d in devices for alias in d.aliases}
    if placement is not None:
        placement.validate(len(block_bytes), set(names))
    ledger = _Ledger(devices)
    if placement is not None:
        for b, size in enumerate(block_bytes):
            entry = placement.entry_for(b)
            if entry is not None and entry.streamed:
                ledger.stream(names[entry.target], size)
    placed: dict[int, Assignment] = {}
    declines: list[Decline] = []

    def honour(block: int | None, entry: PlacementEntry, size: int) -> Assignment | None:
        if entry.target == HOST:
            return Assignment(host_name, size, entry.pinned, False, f"placement {entry.text}")
        target = names[entry.target]
        if entry.streamed:
            short = ledger.take_slots(target)
            if short is not None:
                raise JitllmError(f"placement {entry.text}: {short}")
            return Assignment(target, size, entry.pinned, True, f"placement {entry.text}")
        short = ledger.take(target, size, "head" if block is None else f"block {block}")
        if short is None:
            return Assignment(target, size, entry.pinned, entry.streamed, f"placement {entry.text}")
        if strict:
            raise JitllmError(f"placement {entry.text} cannot be honoured: {short}")
        declines.append(Decline(block, target, short))
        return None

    if placement is not None:
        mapped = [(b, placement.entry_for(b)) for b in range(len(block_bytes))]
        for b, entry in sorted(((b, e) for b, e in mapped if e is not None), key=lambda be: not be[1].pinned):
            assignment = honour(b, entry, block_bytes[b])
            if assignment is not None:
                placed[b] = assignment

    seam = _fill(block_bytes, devices, gpu_layers, ledger, placed, declines, host_name)
    blocks = tuple(placed[b] for b in range(len(block_bytes)))
    on_device = [b for b, a in enumerate(blocks) if a.device != host_name]

    head_entry = placement.head() if placement is not None else None
    head = honour(None, head_entry, head_bytes) if head_entry is not None else None
    if head is None:
        head = Assignment(host_name, head_bytes, reason="no device block to sit beside")
        if on_device and (gpu_layers is None or gpu_layers > len(block_bytes)):
            beside = blocks[on_device[-1]].device
            short = ledger.take(beside, head_bytes, "head")
            if short is None:
                head = Assignment(beside, head_bytes, reason="beside the last device block")
            else:
                declines.append(Decline(None, beside, short))
                head = Assignment(host_name, head_bytes, reason=f"declined by {beside}")
        elif on_device:
            head = Assignment(host_name, head_bytes, reason=f"-gpu-layers {gpu_layers}")
    return Plan(blocks, head, seam, tuple(declines), ledger.report(), host_name)


def _fill(block_bytes: list[int], devices: list[DeviceChoice], gpu_layers: int | None, ledger: _Ledger,
          placed: dict[int, Assignment], declines: list[Decline], host_name: str) -> int | None:
    """The engine's placement of every block the map did not settle; returns the seam."""
    on_device = sum(1 for a in placed.values() if a.device != host_name)
    map_declined = {d.block for d in declines}
    current, seam = 0, None
    for b, size in enumerate(block_bytes):
        if b in placed:
            continue
        if not devices:
            placed[b] = Assignment(host_name, size, reason="no device")
            continue
        if gpu_layers is not None and on_device >= gpu_layers:
            placed[b] = Assignment(host_name, size, reason=f"-gpu-layers {gpu_layers}")
            continue
        if current == len(devices):
            placed[b] = Assignment(host_name, size, reason="after the seam")
            continue
        while current < len(devices):
            short = ledger.take(devices[current].name, size, f"block {b}")
            if short is None:
                why = "engine (the map's target declined)" if b in map_declined else "engine"
                placed[b] = Assignment(devices[current].name, size, reason=why)
                on_device, seam = on_device + 1, b
                break
            declines.append(Decline(b, devices[current].name, short))
            current += 1
        else:
            placed[b] = Assignment(host_name, size, reason="no device has room")
    return seam


class _Ledger:
    """Budget bookkeeping: what each device has left, and its streamed blocks and their slots."""

    def __init__(self, devices: list[DeviceChoice]) -> None:
        self.budget = {d.name: d.budget_bytes for d in devices}
        self.card = {d.name: d.shares_budget_of or d.name for d in devices}
        self.used = {d.name: 0 for d in devices}
        self.slot = {d.name: 0 for d in devices}
        self.streamed = {d.name: [0, 0] for d in devices}
        self.slots_taken: set[str] = set()

    def stream(self, name: str, size: int) -> None:
        """Note a block the map streams to `name` (before anything is charged: the slots' size is the largest)."""
        self.slot[name] = max(self.slot[name], size)
        self.streamed[name][0] += 1
        self.streamed[name][1] += size

    def take(self, name: str, size: int, what: str) -> str | None:
        """Charge `size` to `name`; the reason if it can't."""
        left = self._left(name)
        if size > left:
            return f"{what} needs {format_bytes(size)}, {name} has {format_bytes(left)} left"
        self.used[name] += size
        return None

    def take_slots(self, name: str) -> str | None:
        """Charge `name`'s streaming slots (once); the reason if its budget cannot hold them."""
        if name in self.slots_taken:
            return None
        cost, left = STREAM_SLOTS * self.slot[name], self._left(name)
        if cost > left:
            return (f"{name} cannot hold {STREAM_SLOTS} streaming slots of {format_bytes(self.slot[name])} "
                    f"(the largest block streamed there): they need {format_bytes(cost)}, it has "
                    f"{format_bytes(left)} left")
        self.used[name] += cost
        self.slots_taken.add(name)
        return None

    def _card_used(self, name: str) -> int:
        """What every device sharing `name`'s budget (itself included) has taken."""
        return sum(self.used[n] for n in self.used if self.card[n] == self.card[name])

    def _left(self, name: str) -> int:
        return self.budget[name] - self._card_used(name)

    def report(self) -> tuple[DeviceBudget, ...]:
        views = Counter(self.card.values())
        shared = {c for c, n in views.items() if n > 1}
        return tuple(DeviceBudget(n, self.budget[n], self.used[n], self.slot[n], *self.streamed[n],
                                  shares_budget_of=self.card[n] if self.card[n] != n else None,
                                  card_used_bytes=self._card_used(n) if self.card[n] in shared else None)
                     for n in self.budget)


def _runs(assignments: tuple[Assignment, ...]) -> list[tuple[int, int, Assignment]]:
    """Consecutive identical assignments folded into (first, last, assignment)."""
    runs: list[tuple[int, int, Assignment]] = []
    for i, a in enumerate(assignments):
        if runs and runs[-1][2] == a and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, a)
        else:
            runs.append((i, i, a))
    return runs


def _flags(a: Assignment) -> str:
    flags = (("pinned", a.pinned), ("streamed", a.streamed), ("experts-streamed", a.experts_streamed))
    return " ".join(f for f, on in flags if on) or "-"
