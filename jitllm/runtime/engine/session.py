"""A session: one conversation's length, tokens and the state its blocks keep for it on their devices."""

from __future__ import annotations

from dataclasses import dataclass, field

from jitllm.runtime.device import Device
from jitllm.runtime.engine.kv_pages import PageTable, TableArena
from jitllm.runtime.engine.recurrent import RecurrentState, release_states
from jitllm.runtime.engine.step_graphs import StepInputs


@dataclass
class Session:
    """One conversation: its length and, per block, the pages holding its KV (or its recurrent state)."""

    id: int
    length: int = 0
    tables: dict[int, PageTable] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    step_inputs: dict[str, StepInputs] = field(default_factory=dict)
    """Per device: the decode step's input tensors, reused every token."""
    states: dict[int, RecurrentState] = field(default_factory=dict)
    """Recurrent blocks' state by block index, on each block's device."""
    kv_room: int = 0
    """Positions every page table of the session holds, as of the last check (0: check at the next
    step). Steps within it skip the per-block page bookkeeping; moves and resets set it back to 0."""
    arenas: dict[str, TableArena] = field(default_factory=dict)
    """Per device: the tensor its page tables are rows of (one upload when several gained pages)."""
    pipeline: object | None = None
    """Its pipelined greedy decode's device state (pipelined.Pipeline), made at its first use."""

    def arena(self, device: Device) -> TableArena:
        if device.name not in self.arenas:
            self.arenas[device.name] = TableArena(device)
        return self.arenas[device.name]

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions of its KV history (the caller checked no block keeps recurrent
        state): later pages go back to their pools, and the next step checks every table again."""
        for table in self.tables.values():
            table.truncate(length)
        self.length = length
        del self.tokens[length:]
        self.kv_room = 0

    def forget(self) -> None:
        """Drop its history: pages back to their pools, recurrent state freed, step inputs let go."""
        self.step_inputs.clear()
        self.pipeline = None
        for table in self.tables.values():
            table.release()
        self.tables.clear()
        self.arenas.clear()
        release_states(self)
        self.kv_room = 0
        self.length = 0
        self.tokens = []
