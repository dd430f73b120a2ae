"""The engine's facade: a model's units where the plan put them, its sessions, and the steps that run them.

It holds the state the engine's parts share and answers for them in one place; each job is a module of
its own: units.py (units, their weights and programs), kv.py and scheduler.py (pages), forward.py (a step
over the segments), captured.py (captured steps), pipelined.py (pipelined greedy decode), recurrent.py
(recurrent blocks' state), migration.py (moves), streaming.py (streamed blocks' slots).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from jitllm.core.jlm import JlmFile
from jitllm.ir.config import BlockKind
from jitllm.ir.rope import rope_tables
from jitllm.runtime.device import Device
from jitllm.runtime.engine import all_logits, batch_graphs, batched, captured, forward, kv, pipelined, units
from jitllm.runtime.engine.embedding import TokenEmbedding
from jitllm.runtime.engine.kv_pages import PagePool, PageTable
from jitllm.runtime.engine.packed_weights import PackedWeights
from jitllm.runtime.engine.session import Session
from jitllm.runtime.engine.step_graphs import GraphRecord, Segment, StepFence
from jitllm.runtime.engine.streaming import SlotPool
from jitllm.runtime.engine.units import Unit
from jitllm.runtime.model_layout import HEAD, ModelLayout
from jitllm.runtime.program import Program


class Executor:
    def __init__(self, model: JlmFile, layout: ModelLayout, placement: dict[int | str, Device], ctx: int,
                 cache_dir: Path | None = None, log: Callable[[str], None] | None = None,
                 streamed: frozenset[int] = frozenset(), banked: frozenset[int] = frozenset(),
                 expert_slots: dict[str, int] | None = None, expert_policy: str = "lru"):
        """`streamed`: the blocks whose weights stream through their device's slots (streaming.py); `banked`:
        the MoE blocks whose routed experts stream through their device's expert cache, of `expert_slots`
        experts per device name, replaced by `expert_policy` (engine/expert_cache.py)."""
        self.model, self.layout, self.ctx, self.log = model, layout, ctx, log
        self.cache_dir = cache_dir
        self._placement = placement
        self._programs: dict[tuple[BlockKind, str], Program] = {}
        self._placed: dict[tuple[int | str, str], tuple[BlockKind, Program, Program | None]] = {}
        self._ragged: dict[tuple[int | str, str], Program] = {}
        """(unit, device name) -> the unit's ragged variant there (batched steps; loaded at first use)."""
        self._ragged_inputs: dict[str, batched.RaggedInputs] = {}
        """Per device: a batched step's staged small inputs, kept while the batch's shape holds."""
        self.pools: dict[str, PagePool] = {}
        cfg = layout.config
        self.rope = rope_tables(cfg, ctx)
        """(cos, sin) of every position of the context, [ctx, head_dim / 2] each."""
        embd_parts = {n.split(".", 1)[1]: model.tensor(n) for n in model.tensors if n.startswith("token_embd.")}
        self._embedding = TokenEmbedding(layout.embedding_type, embd_parts, cfg.hidden)
        self._graphs: dict[tuple, GraphRecord] = {}
        """(session, the segment's first unit, whether its step ends with the greedy pick) -> its graph; a
        pipelined greedy step's are (session, first unit, "pipelined", slot)."""
        self._batch_graphs = batch_graphs.BatchGraphs()
        """Captured batched decode steps, one per batch-size bucket and segment (batch_graphs.py)."""
        self._epoch = 0
        """Bumped whenever pages are handed out (a pool may have grown) or captured steps are dropped
        (moves, resets): a record checked at the current epoch replays without its signature rebuilt,
        and the segments found at the current epoch are used again."""
        self._segments: tuple[int, list[Segment]] = (-1, [])
        self._inflight: list[StepFence] = []
        """Pipelined decode steps launched and not yet waited for (greedy_tokens); see `drain`."""
        self.streams: dict[str, SlotPool] = {}
        """Per device that streams blocks or experts: its slots and expert cache (streaming.py)."""
        self.expert_slots, self.expert_policy = expert_slots or {}, expert_policy
        self.blocks: list[Unit] = [units.load_unit(self, i, placement[i], i in streamed, i in banked)
                                   for i in range(cfg.num_blocks)]
        self.head: Unit = units.load_unit(self, HEAD, placement[HEAD])
        self._session_ids = itertools.count()
        self.sessions: dict[int, Session] = {}
        self.graphs = True
        """Decode steps of devices that can capture them run as graphs (step_graphs.py)."""
        self.batch_graphs = True
        """Batched decode steps there too, one graph per batch-size bucket (batch_graphs.py); off: they run
        eagerly (`jitllm batch -eager`)."""
        self.relocate: Callable[[Device, Exception], None] | None = None
        """Called when a device cannot grow the context; moves a block off it (or raises)."""

    # -- units ------------------------------------------------------------------------------------
    def unit(self, index: int | str) -> Unit:
        return self.head if index == HEAD else self.blocks[index]

    def program(self, kind: BlockKind, device: Device) -> Program:
        return units.program(self, kind, device)

    def programs(self, kind: BlockKind, device: Device) -> tuple[Program, Program | None]:
        """The general program and, where the target compiles one, the decode variant."""
        decode = self.program(kind.decode_variant(), device) if device.target.caps.decode_variants else None
        return self.program(kind, device), decode

    def placed(self, index: int | str, device: Device) -> tuple[BlockKind, Program, Program | None]:
        return units.placed(self, index, device)

    def kind_on(self, index: int | str, device: Device) -> BlockKind:
        return units.kind_on(self.layout, index, device)

    def upload_weights(self, index: int | str, device: Device, kind: BlockKind | None = None) -> PackedWeights:
        return units.upload_weights(self, index, device, kind)

    # -- pages ------------------------------------------------------------------------------------
    def pool(self, device: Device) -> PagePool:
        return kv.pool(self, device)

    def pages_for(self, session: Session, unit: Unit, positions: int) -> PageTable:
        return kv.pages_for(self, session, unit, positions)

    def ensure_room(self, session: Session, positions: int) -> None:
        kv.ensure_room(self, session, positions)

    # -- sessions ---------------------------------------------------------------------------------
    def new_session(self) -> Session:
        session = Session(next(self._session_ids))
        self.sessions[session.id] = session
        return session

    def close_session(self, session: Session) -> None:
        self.reset_session(session)
        self.sessions.pop(session.id, None)

    def reset_session(self, session: Session) -> None:
        """Forget the session's history (its pages go back to their pools)."""
        self.drop_graphs(session)
        session.forget()

    def truncate_session(self, session: Session, length: int) -> bool:
        """Cut the session's history back to its first `length` positions, so a prompt that extends that
        prefix reuses its KV pages (the server's prefix cache). False, and the session unchanged, where a
        recurrent block folded the positions after `length` into its state (which cannot be cut)."""
        if length >= session.length:
            return length == session.length
        if session.states:
            return False
        self.drop_graphs(session)  # (drains, and the next step looks at the rewritten page tables)
        session.truncate(length)
        return True

    # -- steps ------------------------------------------------------------------------------------
    def embed(self, ids: list[int]) -> np.ndarray:
        return self._embedding.lookup(ids)

    def forward(self, session: Session, ids: list[int]) -> np.ndarray:
        """Run `ids` (appended after the session's history) through every block; logits of the last one."""
        return forward.forward(self, session, ids, pick=False)

    def prompt_logits(self, session: Session, ids: list[int]) -> np.ndarray:
        """`forward` keeping every position: [len(ids), vocab], through the head's general program."""
        return all_logits.prompt_logits(self, session, ids)

    def next_token(self, session: Session, ids: list[int]) -> int:
        """`forward`, then the greedy pick: the first largest logit of the last position. Where the head's
        program has the pick (GPU heads), the device makes it and 4 bytes come back instead of the
        vocabulary's logits; elsewhere the host picks from the logits."""
        if self.head.program_for(1).argmax is None:
            return int(np.argmax(forward.forward(self, session, ids, pick=False)))
        return forward.forward(self, session, ids, pick=True)

    def batched_forward(self, work: list[tuple[Session, list[int]]]) -> np.ndarray:
        """Every (session, ids) of `work` in one step (batched.py): the logits of each session's last new
        token, [sessions, vocab]."""
        return batched.batched_forward(self, work)

    def greedy_tokens(self, session: Session, token: int, steps: int) -> Iterator[int]:
        """`steps` greedy decode steps, the first fed `token` (pipelined.greedy_tokens)."""
        return pipelined.greedy_tokens(self, session, token, steps)

    def drain(self) -> None:
        pipelined.drain(self)

    def drop_graphs(self, session: Session | None = None, devices: tuple[str, ...] | None = None) -> None:
        """Forget captured steps: a session's, or all batch-1 ones and the batched ones on `devices` (all
        where None)."""
        captured.drop(self, session, devices)
