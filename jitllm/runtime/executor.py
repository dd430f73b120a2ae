"""Runs a model's blocks where the plan put them: weights resident per device, paged KV per session.

Blocks and the head are `Unit`s; each holds its weights on its device and the compiled program of its
kind for that device (one artifact per kind, shared by every block of the kind). The hidden state
crosses devices only at seams.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import tvm

from jitllm.errors import DeviceFault, JitllmError
from jitllm.ir.config import BlockKind
from jitllm.ir.llama import kind_for_target
from jitllm.jlm import JlmFile
from jitllm.lowering.cache import get_artifact
from jitllm.runtime.devices.base import Device, last_positions, to_device
from jitllm.runtime.devices.host import HOST as HOST_NAME
from jitllm.runtime.embedding import TokenEmbedding
from jitllm.runtime.kv_pages import PagePool, PageTable, TableArena
from jitllm.runtime.model_layout import HEAD, ModelLayout
from jitllm.runtime.packed_weights import PackedWeights
from jitllm.runtime.program import Program, load_program
from jitllm.runtime.recurrent import RecurrentState, release_states
from jitllm.runtime.step_graphs import (GraphRecord, Segment, StepInputs, capture_segment, segment_objects, segments,
                                        signature)


@dataclass
class Unit:
    """A block (index) or the head, resident on a device."""

    index: int | str
    kind: BlockKind
    device: Device
    weights: PackedWeights
    nbytes: int
    program: Program
    decode_program: Program | None = None
    """The batch-1, seq-1 variant where the device's target has one (GPU decode steps)."""

    def program_for(self, tokens: int) -> Program:
        return self.decode_program if tokens == 1 and self.decode_program is not None else self.program


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
    """Recurrent (GLA) blocks' state by block index, on each block's device."""
    kv_room: int = 0
    """Positions every page table of the session holds, as of the last check (0: check at the next
    step). Steps within it skip the per-block page bookkeeping; moves and resets set it back to 0."""
    arenas: dict[str, TableArena] = field(default_factory=dict)
    """Per device: the tensor its page tables are rows of (one upload when several gained pages)."""

    def arena(self, device: Device) -> TableArena:
        if device.name not in self.arenas:
            self.arenas[device.name] = TableArena(device)
        return self.arenas[device.name]


def rope_tables(positions: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class Executor:
    def __init__(self, model: JlmFile, layout: ModelLayout, placement: dict[int | str, Device], ctx: int,
                 cache_dir: Path | None = None, log: Callable[[str], None] | None = None):
        self.model, self.layout, self.ctx, self.log = model, layout, ctx, log
        self.cache_dir = cache_dir
        self._placement = placement
        self._programs: dict[tuple[BlockKind, str], Program] = {}
        self._placed: dict[tuple[int | str, str], tuple[BlockKind, Program, Program | None]] = {}
        self.pools: dict[str, PagePool] = {}
        cfg = layout.config
        self._cos, self._sin = rope_tables(ctx, cfg.head_dim, cfg.rope_theta)
        embd_parts = {n.split(".", 1)[1]: model.tensor(n) for n in model.tensors if n.startswith("token_embd.")}
        self._embedding = TokenEmbedding(layout.embedding_type, embd_parts, cfg.hidden)
        self.blocks = [self._load_unit(i, placement[i]) for i in range(cfg.num_blocks)]
        self.head = self._load_unit(HEAD, placement[HEAD])
        self._session_ids = itertools.count()
        self.sessions: dict[int, Session] = {}
        self.graphs = True
        """Decode steps of devices that can capture them run as graphs (step_graphs.py)."""
        self._graphs: dict[tuple[int, int | str, bool], GraphRecord] = {}
        """(session, the segment's first unit, whether its step ends with the greedy pick) -> its graph."""
        self._epoch = 0
        """Bumped whenever pages are handed out (a pool may have grown) or captured steps are dropped
        (moves, resets): a record checked at the current epoch replays without its signature rebuilt,
        and the segments found at the current epoch are used again."""
        self._segments: tuple[int, list[Segment]] = (-1, [])
        self.relocate: Callable[[Device, Exception], None] | None = None
        """Called when a device cannot grow the context; moves a block off it (or raises)."""

    # -- loading ---------------------------------------------------------------------------------
    def program(self, kind: BlockKind, device: Device) -> Program:
        key = (kind, device.name)
        if key not in self._programs:
            artifact = get_artifact(kind, device.target, self.cache_dir, log=self.log)
            main_appends = kind.decode and getattr(device.target, "decode_appends_kv", False)
            page_kernels = kind.kind == "llama" and not main_appends
            self._programs[key] = load_program(artifact.path, device.tvm_device, page_kernels)
        return self._programs[key]

    def programs(self, kind: BlockKind, device: Device) -> tuple[Program, Program | None]:
        """The general program and, where the target compiles one, the decode variant."""
        decode = self.program(kind.decode_variant(), device) if getattr(device.target, "decode_variants", False) else None
        return self.program(kind, device), decode

    def placed(self, index: int | str, device: Device) -> tuple[BlockKind, Program, Program | None]:
        """The unit's kind on `device` and its programs there (`kind_on`, `programs`), worked out once per
        unit and device: a move's lookup is then one dict hit (deriving and hashing the kinds took ~20 us)."""
        key = (index, device.name)
        found = self._placed.get(key)
        if found is None:
            kind = self.kind_on(index, device)
            found = self._placed[key] = (kind, *self.programs(kind, device))
        return found

    def kind_on(self, index: int | str, device: Device) -> BlockKind:
        """The unit's kind as compiled for `device` (jitllm.ir.llama.kind_for_target)."""
        kind = self.layout.head if index == HEAD else self.layout.block_kinds[index]
        return kind_for_target(kind, device.target)

    def _load_unit(self, index: int | str, device: Device) -> Unit:
        kind = self.kind_on(index, device)
        names = self.layout.tensor_names(index)
        nbytes = sum(self.model.tensors[n].nbytes for n in names)
        device.reserve(nbytes, f"weights of {'block ' + str(index) if index != HEAD else 'the head'}")
        weights = self.upload_weights(index, device, kind)
        if kind.kind == "llama":
            self.pool(device)
        return Unit(index, kind, device, weights, nbytes, *self.placed(index, device)[1:])

    def upload_weights(self, index: int | str, device: Device, kind: BlockKind | None = None) -> PackedWeights:
        """A unit's weights (laid out for `kind`, default its kind on `device`) copied from its .jlm page
        into one allocation on `device`; fused linears are stacked here, once per load or move."""
        kind = kind or self.kind_on(index, device)
        return PackedWeights.upload(device, [[self.model.tensor(n) for n in group]
                                             for group in self.layout.weight_sources(index, kind)])

    def pool(self, device: Device) -> PagePool:
        """The device's page pool: room for its blocks at a quarter of the context, grown on demand."""
        if device.name not in self.pools:
            cfg, p = self.layout.config, self.layout.block_kinds[0].page_size
            blocks_here = sum(1 for i in range(cfg.num_blocks) if self._placement[i] is device)
            pages = max(1, blocks_here) * max(1, -(-self.ctx // (4 * p)))
            self.pools[device.name] = PagePool(device, pages, cfg.kv_heads, p, cfg.head_dim)
        return self.pools[device.name]

    # -- sessions and steps ----------------------------------------------------------------------
    def _pages_for(self, session: Session, unit: Unit, positions: int) -> PageTable:
        """The unit's page table holding `positions` positions. When a device has no room for more
        pages, `relocate` (if set) moves a block off that device, KV and all, and we try again."""
        self._epoch += 1
        while True:
            table = session.tables.get(unit.index)
            if table is None:
                table = session.tables[unit.index] = PageTable(self.pool(unit.device), arena=session.arena(unit.device))
            try:
                table.ensure(positions)
                return table
            except Exception as e:  # out of pages, over the KV budget, or the device's own allocator failing
                if unit.device.name == HOST_NAME:
                    raise
                if self.relocate is None:
                    raise JitllmError(f"{unit.device.name}: no room for more KV pages, so the context stops "
                                      f"growing there (-relocate is off): {e}") from None
                self.relocate(unit.device, e)

    def unit(self, index: int | str) -> Unit:
        return self.head if index == HEAD else self.blocks[index]

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
        session.step_inputs.clear()
        for table in session.tables.values():
            table.release()
        session.tables.clear()
        session.arenas.clear()
        release_states(session)
        session.kv_room = 0
        session.length = 0
        session.tokens = []

    def embed(self, ids: list[int]) -> np.ndarray:
        return self._embedding.lookup(ids)

    def forward(self, session: Session, ids: list[int]) -> np.ndarray:
        """Run `ids` (appended after the session's history) through every block; logits of the last one."""
        return self._forward(session, ids, pick=False)

    def next_token(self, session: Session, ids: list[int]) -> int:
        """`forward`, then the greedy pick: the first largest logit of the last position. Where the head's
        program has the pick (GPU heads), the device makes it and 4 bytes come back instead of the
        vocabulary's logits; elsewhere the host picks from the logits."""
        if self.head.program_for(1).argmax is None:
            return int(np.argmax(self._forward(session, ids, pick=False)))
        return self._forward(session, ids, pick=True)

    def _forward(self, session: Session, ids: list[int], pick: bool) -> np.ndarray | int:
        """`pick`: the head's program picks the greedy token, and that comes back instead of the logits."""
        n, past = len(ids), session.length
        if past + n > self.ctx:
            raise JitllmError(f"context full: {past + n} positions do not fit the context of {self.ctx}")
        if past + n > session.kv_room:  # room first: relocation may move blocks, and must do so before the step
            for unit in self.blocks:
                if unit.kind.kind == "llama":
                    self._pages_for(session, unit, past + n)
            session.kv_room = min((len(t.ids) * t.pool.page_size for t in session.tables.values()), default=0)
        if self._segments[0] != self._epoch:
            self._segments = (self._epoch, segments(self.blocks, self.head))
        x: tvm.runtime.Tensor | np.ndarray | None = self._device_embedding(ids, self._segments[1][0].device)
        if x is None:
            x = self.embed(ids)[None]
        for segment in self._segments[1]:
            _check_fault(segment.device)
            with _device_faults(segment.device):
                if n == 1 and self.graphs and segment.device.graphs is not None and segment.capturable:
                    x = self._replay_segment(session, segment, x, past, pick)
                else:
                    x = self._run_segment(session, segment, x, past, n, pick)
        session.length = past + n
        session.tokens += ids
        if isinstance(x, (np.ndarray, int)):  # (what a decode step brought back through host arrays)
            return x
        return int(x.numpy()[0]) if pick else x.numpy()[0, -1]

    def _device_embedding(self, ids: list[int], device: Device) -> tvm.runtime.Tensor | None:
        """A prompt's embedding rows gathered on `device` from the tied head's weights there, [1, n, hidden]
        (the host lookup gathers each row with a 16-byte stride and then uploads it: ~10% of a 3B-shape
        512-token prefill on the H200); None for single tokens (decode steps feed captured graphs from
        the host), untied heads, a head elsewhere or without the gather (the CPU), ids out of range."""
        head, n = self.head, len(ids)
        embed = head.program.embed
        if n < 2 or embed is None or head.device is not device or not self.layout.config.tied_head:
            return None
        rows = np.asarray(ids, np.int32)[None]
        if rows.min() < 0 or rows.max() >= self.layout.config.vocab:
            return None
        with _device_faults(device):
            x = device.empty((1, n, self.layout.config.hidden), "float32")
            embed(device.upload(rows), *head.weights[1:], x)  # (weights[0]: the final norm's)
        return x

    def _run_segment(self, session: Session, segment: Segment, x, past: int, n: int, pick: bool = False):
        """Call each unit of the segment in turn (prefill, and devices without captured graphs)."""
        dev = segment.device
        if n == 1:
            step = self._step_inputs(session, segment, x, past)
            return step.output(segment, self._run_units(session, segment, step, 1, pick=pick), pick)
        h = dev.upload(x) if isinstance(x, np.ndarray) else to_device(x, dev)
        step = StepInputs(h, dev.upload(self._cos[past:past + n][None]), dev.upload(self._sin[past:past + n][None]),
                          dev.upload(np.array([past], np.int32)))
        return self._run_units(session, segment, step, n, pick=pick)

    def _run_units(self, session: Session, segment: Segment, step: StepInputs, n: int,
                   call: Callable = lambda fn, *args: fn(*args), pick: bool = False):
        """The segment's units over `step`'s inputs, their functions launched through `call` (directly,
        or recorded into a graph). A decode step's inputs come from, and its logits (or, `pick`, the
        token the head's program picked) go to, host arrays (StepInputs.staging) by transfers launched
        through `call` too."""
        if step.staging is not None:
            call(step.upload)
        h = step.x
        for unit in segment.blocks:
            if unit.kind.kind == "gla":
                h = self._recurrent_step(session, unit, h, n)
                continue
            table = session.tables[unit.index]
            pages, pt = table.pool.pages, table.tensor()
            program = unit.program_for(n)
            h, k, v = call(program.main, h, step.cos, step.sin, pages, pt, step.past, *unit.weights)
            if program.append is not None:  # (a GPU decode variant's main appends itself)
                call(program.append, pages, k, v, pt, step.past)
        if segment.head is None:
            return h
        if n > 1:
            h = last_positions(h)
        head = segment.head.program_for(1)
        logits = call(head.main, h, *segment.head.weights)
        if pick:
            token = step.token if step.staging is not None else segment.device.empty((1,), "int32")
            call(head.argmax, logits, token)
            if step.staging is not None:
                call(step.download_token, token)
            return token
        if step.staging is not None:
            call(step.download, logits)
        return logits

    def _step_inputs(self, session: Session, segment: Segment, x, past: int) -> StepInputs:
        """The session's decode inputs on the segment's device (made once), holding this token's values."""
        device = segment.device
        step = session.step_inputs.get(device.name)
        if step is None or (segment.head is not None and step.staging.logits is None):
            cfg = self.layout.config
            vocab = cfg.vocab if self.head.device is device else None
            step = session.step_inputs[device.name] = StepInputs.on(device, cfg.hidden, cfg.head_dim // 2, vocab)
        step.feed(x, self._cos[past:past + 1][None], self._sin[past:past + 1][None], past)
        return step

    def _replay_segment(self, session: Session, segment: Segment, x, past: int,
                        pick: bool = False) -> tvm.runtime.Tensor | np.ndarray | int:
        """One decode step of the segment as a captured graph (captured again when what it baked changed):
        its hidden state out, or where it ends with the head the logits row (or, `pick`, the token: a
        graph of its own, ending with the head's pick)."""
        step = self._step_inputs(session, segment, x, past)
        key = (session.id, segment.blocks[0].index if segment.blocks else HEAD, pick and segment.head is not None)
        record = self._graphs.get(key)
        if record is None or record.epoch != self._epoch:  # pages or units may have changed: check what it baked
            objects = segment_objects(session, segment)  # (also uploads page-table rows added since)
            if record is None or record.signature != signature(objects, step):
                record = self._graphs[key] = capture_segment(
                    segment.device.graphs, objects, step,
                    lambda call: self._run_units(session, segment, step, 1, call, pick))
                if self.log:
                    self.log(f"captured decode graph: session {session.id}, {len(segment.blocks)} blocks"
                             f"{' + head' if segment.head is not None else ''} on {segment.device.name}")
            record.epoch = self._epoch
        record.graph.replay()
        return step.output(segment, record.output, pick)

    def drop_graphs(self, session: Session | None = None) -> None:
        """Forget captured steps (of one session, or all: after a move they would hold freed memory)."""
        for key in [k for k in self._graphs if session is None or k[0] == session.id]:
            del self._graphs[key]
        self._epoch += 1

    # -- recurrent blocks ------------------------------------------------------------------------
    def _recurrent_step(self, session: Session, unit: Unit, x: tvm.runtime.Tensor, n: int) -> tvm.runtime.Tensor:
        """Run a GLA block over `n` new tokens; its kernel folds them into the session's state in place."""
        state = session.states.get(unit.index)
        if state is None:
            state = session.states[unit.index] = RecurrentState.zeros(
                unit.kind, unit.device, f"recurrent state of block {unit.index}")
        if state.positions != session.length:
            raise JitllmError(f"session {session.id}: block {unit.index}'s recurrent state does not match its "
                              f"{session.length} positions (an earlier step failed); reset the session")
        state.positions = -1  # until the step has finished (forward reports device failures)
        y, _ = unit.program_for(n).main(x, state.tensor, *unit.weights)
        state.positions = session.length + n
        return y


def _last_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


@contextlib.contextmanager
def _device_faults(device: Device):
    """Errors of work on a GPU as DeviceFault (TVM reports device failures, allocation and launch, as its
    own errors), so the device is given up and the step retried elsewhere; the host's stay as they are."""
    try:
        yield
    except DeviceFault:
        raise
    except Exception as e:
        if device.name == HOST_NAME:
            raise
        raise DeviceFault(device.name, _last_line(e)) from e


def _check_fault(device: Device) -> None:
    if device.inject_fault:
        device.inject_fault = False
        raise DeviceFault(device.name, "kernel launch failed (injected fault)")
