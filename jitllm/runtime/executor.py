"""Runs a model's blocks where the plan put them: weights resident per device, paged KV per session.

Blocks and the head are `Unit`s; each holds its weights on its device and the compiled program of its
kind for that device (one artifact per kind, shared by every block of the kind). The hidden state
crosses devices only at seams.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from jitllm.core.errors import DeviceFault, JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.ir.block_type import KV_PAGES, RECURRENT
from jitllm.ir.blocks import block_type
from jitllm.ir.config import BlockKind
from jitllm.ir.rope import rope_tables
from jitllm.lowering.cache import get_artifact
from jitllm.lowering.target import kind_for_target
from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.backends.host import HOST as HOST_NAME
from jitllm.runtime.device import Device
from jitllm.runtime.embedding import TokenEmbedding
from jitllm.runtime.kv_pages import PagePool, PageTable, TableArena
from jitllm.runtime.model_layout import HEAD, ModelLayout
from jitllm.runtime.packed_weights import PackedWeights
from jitllm.runtime.program import Program
from jitllm.runtime.recurrent import RecurrentState, release_states
from jitllm.runtime.step_graphs import (
    GraphRecord,
    Segment,
    StepFence,
    StepInputs,
    capture_segment,
    segment_objects,
    segments,
    signature,
)


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

    @property
    def state(self) -> str:
        """What its block type carries per session (jitllm.ir.block_type: KV pages, recurrent state, none)."""
        return block_type(self.kind).state

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
    pipeline: "Pipeline | None" = None
    """Its pipelined greedy decode's device state (Executor.greedy_tokens), made at its first use."""

    def arena(self, device: Device) -> TableArena:
        if device.name not in self.arenas:
            self.arenas[device.name] = TableArena(device)
        return self.arenas[device.name]


@dataclass
class PipelineSlot:
    """One of a pipelined decode's two alternating steps: its own host arrays and captured graph, so the
    host fills one while the device runs the other, and the fence of its last launch."""

    inputs: StepInputs
    fence: StepFence | None = None


@dataclass
class Pipeline:
    """A session's pipelined greedy decode on one device: the token on the device (each step's pick, [1, 1]
    int32, which the next step's graph gathers its embedding row for) and the two slots."""

    device: Device
    token: Tensor
    slots: list[PipelineSlot]


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
        self._cos, self._sin = rope_tables(cfg, ctx)
        embd_parts = {n.split(".", 1)[1]: model.tensor(n) for n in model.tensors if n.startswith("token_embd.")}
        self._embedding = TokenEmbedding(layout.embedding_type, embd_parts, cfg.hidden)
        self.blocks = [self._load_unit(i, placement[i]) for i in range(cfg.num_blocks)]
        self.head = self._load_unit(HEAD, placement[HEAD])
        self._session_ids = itertools.count()
        self.sessions: dict[int, Session] = {}
        self.graphs = True
        """Decode steps of devices that can capture them run as graphs (step_graphs.py)."""
        self._graphs: dict[tuple, GraphRecord] = {}
        """(session, the segment's first unit, whether its step ends with the greedy pick) -> its graph; a
        pipelined greedy step's are (session, first unit, "pipelined", slot)."""
        self._epoch = 0
        """Bumped whenever pages are handed out (a pool may have grown) or captured steps are dropped
        (moves, resets): a record checked at the current epoch replays without its signature rebuilt,
        and the segments found at the current epoch are used again."""
        self._segments: tuple[int, list[Segment]] = (-1, [])
        self.relocate: Callable[[Device, Exception], None] | None = None
        """Called when a device cannot grow the context; moves a block off it (or raises)."""
        self._inflight: list[StepFence] = []
        """Pipelined decode steps launched and not yet waited for (greedy_tokens); see `drain`."""

    # -- loading ---------------------------------------------------------------------------------
    def program(self, kind: BlockKind, device: Device) -> Program:
        key = (kind, device.name)
        if key not in self._programs:
            artifact = get_artifact(kind, device.target, self.cache_dir, log=self.log)
            main_appends = kind.decode and device.target.caps.decode_appends_kv
            page_kernels = block_type(kind).state == KV_PAGES and not main_appends
            self._programs[key] = device.load(artifact.path, kind, page_kernels)
        return self._programs[key]

    def programs(self, kind: BlockKind, device: Device) -> tuple[Program, Program | None]:
        """The general program and, where the target compiles one, the decode variant."""
        decode = self.program(kind.decode_variant(), device) if device.target.caps.decode_variants else None
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
        if block_type(kind).state == KV_PAGES:
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
        self.drain()
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
        session.pipeline = None
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
        self.drain()
        n, past = len(ids), session.length
        self._check_context(past + n)
        self._ensure_room(session, past + n)
        self._current_segments()
        source = self._segments[1][0].device
        x: Tensor | np.ndarray | None = self._device_embedding(ids, source)
        if x is None:
            x = self.embed(ids)[None]
        for segment in self._segments[1]:
            with _device_faults(segment.device):
                if n == 1 and self.graphs and segment.device.graphs is not None and segment.capturable:
                    x = self._replay_segment(session, segment, x, source, past, pick)
                else:
                    x = self._run_segment(session, segment, x, source, past, n, pick)
            source = segment.device
        session.length = past + n
        session.tokens += ids
        if isinstance(x, (np.ndarray, int)):  # (what a decode step brought back through host arrays)
            return x
        out = source.download(x)
        return int(out[0]) if pick else out[0, -1]

    def _check_context(self, positions: int) -> None:
        if positions > self.ctx:
            raise JitllmError(f"context full: {positions} positions do not fit the context of {self.ctx}")

    def _ensure_room(self, session: Session, positions: int) -> None:
        """Pages for `positions` in every attention block's table (before the step: relocation may move
        blocks, and must do so before it)."""
        if positions > session.kv_room:
            for unit in self.blocks:
                if unit.state == KV_PAGES:
                    self._pages_for(session, unit, positions)
            session.kv_room = min((len(t.ids) * t.pool.page_size for t in session.tables.values()), default=0)

    def _current_segments(self) -> list[Segment]:
        if self._segments[0] != self._epoch:
            self._segments = (self._epoch, segments(self.blocks, self.head))
        return self._segments[1]

    # -- pipelined greedy decode -----------------------------------------------------------------
    def drain(self) -> None:
        """Wait for every pipelined step still running. Whatever reads or changes what steps use (a step
        of any session, page bookkeeping, a move, a reset) drains first: one step at a time uses a
        device's modules (the split attention's counters assume it)."""
        fences, self._inflight = self._inflight, []  # (a device fault raises once, not at every later drain)
        for fence in fences:
            fence.wait()

    def greedy_tokens(self, session: Session, token: int, steps: int) -> Iterator[int]:
        """`steps` greedy decode steps, the first fed `token`: yields each step's pick, as that many calls
        of `next_token(session, [token])` would. Where the whole model is one captured segment whose head
        picks the token on its device and gathers embedding rows there (a tied head on a GPU), each step's
        graph starts from the token the step before left on the device, so step k + 1 is launched before
        step k's token is read: the host's turn (its bookkeeping, the launch) overlaps the device's work
        instead of leaving it idle between steps. A consumer that stops early leaves the session as if
        the step still in flight never ran (it is waited for and not counted: its KV position is
        written again by the next step fed there)."""
        self.drain()
        pending: deque[PipelineSlot] = deque()
        launched = 0
        try:
            for k in range(steps):
                if not pending:
                    slot = self._launch_pipelined(session, launched % 2, token)
                    if slot is None:  # the model cannot pipeline (now): one plain step
                        token = self.next_token(session, [token])
                        yield token
                        continue
                    pending.append(slot)
                    launched += 1
                if k + 1 < steps:  # the next step, from the token this one leaves on the device
                    ahead = self._launch_pipelined(session, launched % 2, None)
                    if ahead is not None:
                        pending.append(ahead)
                        launched += 1
                slot = pending.popleft()
                self._wait(slot.fence)
                session.tokens.append(token)
                token = int(slot.inputs.staging.token[0])
                yield token
        finally:
            for slot in pending:  # launched ahead, not taken
                self._wait(slot.fence)
                session.length -= 1

    def _wait(self, fence: StepFence) -> None:
        if fence in self._inflight:
            self._inflight.remove(fence)
        with _device_faults(self.head.device):
            fence.wait()

    def _pipelined_segment(self) -> Segment | None:
        """The segment a pipelined step runs: the whole model on one device that captures steps, with a
        tied head that picks the token and gathers embedding rows there; else None."""
        found = self._current_segments()
        if not self.graphs or len(found) != 1:
            return None
        segment, head = found[0], self.head
        if (segment.device.graphs is None or not segment.capturable or segment.head is None
                or head.program.embed is None or head.program_for(1).argmax is None
                or not self.layout.config.tied_head):
            return None
        return segment

    def _launch_pipelined(self, session: Session, index: int, token: int | None) -> PipelineSlot | None:
        """Launch one pipelined step on slot `index` without waiting for it. `token`: its input, uploaded
        first (nothing is in flight then); None: the input is the pick of the step in flight, and the
        launch happens only where it needs no bookkeeping that must wait for that step (new pages, a
        capture or a signature check), else None (the caller launches it once the step is done)."""
        ahead = token is None
        past = session.length
        if ahead and (past + 1 > min(self.ctx, session.kv_room) or self._segments[0] != self._epoch):
            return None
        self._check_context(past + 1)
        self._ensure_room(session, past + 1)
        segment = self._pipelined_segment()
        if segment is None:
            return None
        first = segment.blocks[0].index if segment.blocks else HEAD
        key = (session.id, first, "pipelined", index)
        record = self._graphs.get(key)
        if ahead and not (record is not None and record.epoch == self._epoch):
            return None
        with _device_faults(segment.device):
            pipeline = self._pipeline(session, segment.device)
            slot, other = pipeline.slots[index], pipeline.slots[1 - index]

            def baked(inputs: StepInputs) -> Callable[[], list]:
                return lambda: segment_objects(session, segment, inputs) + [pipeline.token]

            slot.inputs.feed(None, self._cos[past:past + 1][None], self._sin[past:past + 1][None], past, segment.device)
            if not ahead:  # (the input before any capture: a recorder may run the step while capturing it)
                segment.device.write(pipeline.token, np.array([[token]], np.int32))
                # (the other slot too, now that nothing is in flight: so the next step can go ahead)
                self._still_valid(self._graphs.get((session.id, first, "pipelined", 1 - index)), baked(other.inputs),
                                  other.inputs)
                if not self._still_valid(record, baked(slot.inputs), slot.inputs):
                    record = self._capture(key, segment, slot.inputs, baked(slot.inputs)(),
                                           lambda call: self._pipelined_units(session, segment, slot.inputs,
                                                                              pipeline, call))
                    segment.device.write(pipeline.token, np.array([[token]], np.int32))  # (a recorder may have run it)
            slot.fence = slot.fence or segment.device.graphs.fence()
            record.graph.launch()
            slot.fence.record()
        self._inflight.append(slot.fence)
        session.length = past + 1
        return slot

    def _pipelined_units(self, session: Session, segment: Segment, step: StepInputs, pipeline: Pipeline,
                         call: Callable) -> Tensor:
        """A pipelined step: the embedding row of the token on the device, then the segment's units, ending
        with the pick written back over that token."""
        head = self.head
        call(head.program.embed, pipeline.token, *head.weights[1:], step.x)  # (weights[0]: the final norm's)
        return self._run_units(session, segment, step, 1, call, pick=True)

    def _pipeline(self, session: Session, device: Device) -> Pipeline:
        """The session's pipeline state on `device` (made once)."""
        if session.pipeline is None or session.pipeline.device is not device:
            cfg = self.layout.config
            token = device.empty((1, 1), "int32")
            pick = device.aliases(token, (((1,), "int32", 0),))[0]  # the pick lands where the next step reads
            slots = [PipelineSlot(StepInputs.on(device, cfg.hidden, cfg.head_dim // 2, cfg.vocab, pick))
                     for _ in range(2)]
            session.pipeline = Pipeline(device, token, slots)
        return session.pipeline

    def _still_valid(self, record: GraphRecord | None, objects: Callable[[], list], step: StepInputs) -> bool:
        """Whether `record` may replay now: checked at this epoch, or what it baked (`objects()`, looked at
        only then) is still what the step would use; then it is marked checked at this epoch."""
        if record is None:
            return False
        if record.epoch != self._epoch and record.signature == signature(objects(), step):
            record.epoch = self._epoch
        return record.epoch == self._epoch

    def _capture(self, key: tuple, segment: Segment, step: StepInputs, objects: list,
                 run: Callable[[Callable], Tensor]) -> GraphRecord:
        """Capture `run` as the record under `key`, checked at this epoch."""
        record = self._graphs[key] = capture_segment(segment.device.graphs, objects, step, run)
        record.epoch = self._epoch
        if self.log:
            what = "pipelined decode graph" if "pipelined" in key else "decode graph"
            self.log(f"captured {what}: session {key[0]}, {len(segment.blocks)} blocks"
                     f"{' + head' if segment.head is not None else ''} on {segment.device.name}")
        return record

    def _device_embedding(self, ids: list[int], device: Device) -> Tensor | None:
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

    def _run_segment(self, session: Session, segment: Segment, x, source: Device, past: int, n: int,
                     pick: bool = False):
        """Call each unit of the segment in turn (prefill, and devices without captured graphs); `x` comes
        from the host (an array) or from `source`."""
        dev = segment.device
        if n == 1:
            step = self._step_inputs(session, segment, x, source, past)
            return step.output(segment, self._run_units(session, segment, step, 1, pick=pick), pick)
        h = dev.upload(x) if isinstance(x, np.ndarray) else dev.receive(x, source)
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
            if unit.state == RECURRENT:
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
            h = segment.device.last_rows(h)
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

    def _step_inputs(self, session: Session, segment: Segment, x, source: Device, past: int) -> StepInputs:
        """The session's decode inputs on the segment's device (made once), holding this token's values."""
        device = segment.device
        step = session.step_inputs.get(device.name)
        if step is None or (segment.head is not None and step.staging.logits is None):
            cfg = self.layout.config
            if step is not None:  # a step captured over the inputs this replaces (another segment here) must not replay
                self._epoch += 1
            vocab = cfg.vocab if self.head.device is device else None
            step = session.step_inputs[device.name] = StepInputs.on(device, cfg.hidden, cfg.head_dim // 2, vocab)
        step.feed(x, self._cos[past:past + 1][None], self._sin[past:past + 1][None], past, device, source)
        return step

    def _replay_segment(self, session: Session, segment: Segment, x, source: Device, past: int,
                        pick: bool = False) -> Tensor | np.ndarray | int:
        """One decode step of the segment as a captured graph (captured again when what it baked changed):
        its hidden state out, or where it ends with the head the logits row (or, `pick`, the token: a
        graph of its own, ending with the head's pick)."""
        step = self._step_inputs(session, segment, x, source, past)
        key = (session.id, segment.blocks[0].index if segment.blocks else HEAD, pick and segment.head is not None)
        record = self._graphs.get(key)
        # pages or units may have changed: check what it baked (segment_objects also uploads page-table rows
        # added since)
        if not self._still_valid(record, lambda: segment_objects(session, segment), step):
            record = self._capture(key, segment, step, segment_objects(session, segment),
                                   lambda call: self._run_units(session, segment, step, 1, call, pick))
        record.graph.replay()
        return step.output(segment, record.output, pick)

    def drop_graphs(self, session: Session | None = None) -> None:
        """Forget captured steps (of one session, or all: after a move they would hold freed memory)."""
        self.drain()
        for key in [k for k in self._graphs if session is None or k[0] == session.id]:
            del self._graphs[key]
        self._epoch += 1

    # -- recurrent blocks ------------------------------------------------------------------------
    def _recurrent_step(self, session: Session, unit: Unit, x: Tensor, n: int) -> Tensor:
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

