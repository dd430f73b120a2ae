"""Moving a block (or the head) to another device between two steps, KV pages (or recurrent state) and all.

A move is a transaction: the destination's program is loaded (or compiled), its budget charged, the
weights copied (one copy of the unit's single allocation, jitllm.runtime.engine.packed_weights; laid out
afresh from the .jlm where the destination lays the unit out differently) and every live session's
pages copied into the destination pool (each run of pages consecutive on both sides in one copy; many
scattered pages gathered into one staging tensor, moved once and scattered by kernels; a GLA block's
per-session state is copied into new tensors on the destination instead; pages between pools of two KV
types (q8_0, f16, a target's f32) go through the host and are converted there). Only then is the
unit switched over and the source's memory freed (its weights buffer kept for the next unit to arrive
where the source has a weight pool, jitllm.runtime.backends.buffer_pool; the destination's came from
its pool where one was kept); any failure before that undoes what was done, so the block keeps running
where it was with its KV intact. Nothing is recomputed (but by a fall-back from a failed device: rebuild.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.block_type import KV_PAGES, RECURRENT
from jitllm.ir.config import BlockKind
from jitllm.ir.kv_quant import convert_pages
from jitllm.runtime.device import Device
from jitllm.runtime.engine import units
from jitllm.runtime.engine.kv_pages import PageTable
from jitllm.runtime.engine.rebuild import FallBack, rebuild_sessions
from jitllm.runtime.engine.recurrent import RecurrentState, commit_states, copy_states
from jitllm.runtime.planner import STREAM_SLOTS


@dataclass(frozen=True)
class MoveReport:
    unit: int | str
    source: str
    dest: str
    weight_bytes: int
    kv_bytes: int
    seconds: float
    state_bytes: int = 0
    """Recurrent state copied (GLA blocks: every live session's)."""
    streamed: bool = False
    """It streams through the destination's slots now (its weights were not copied)."""
    phases: tuple[tuple[str, float], ...] = ()
    """Seconds per phase: program (lookup, budget), weights (alloc, or taking a buffer the destination's
    pool kept; copy; aliases, none to make where the kept buffer brought them; or one `weights` phase
    where the destination lays the unit out afresh), kv pages (allocation), kv (copies, or recurrent
    state), sync, switch."""

    def describe(self) -> str:
        what = "head" if self.unit == "head" else f"block {self.unit}"
        state = f"state {self.state_bytes / 2**10:.1f} KiB, " if self.state_bytes else ""
        dest = f"{self.dest} (streamed)" if self.streamed else self.dest
        return (f"moved {what} {self.source} -> {dest}: weights {self.weight_bytes / 2**20:.2f} MiB, "
                f"KV {self.kv_bytes / 2**20:.2f} MiB, {state}{self.seconds * 1e3:.2f} ms")


def move_unit(executor, index: int | str, dest: Device, from_file: bool = False,
              streamed: bool = False) -> MoveReport:
    """Move one unit (the module docstring). `from_file`: its weights come from the model file and nothing
    is read from the source device (a fall-back from a device that failed; the sessions' KV there was
    dropped first). `streamed`: it streams through `dest`'s slots (its weights are not copied); a unit
    that streamed and is moved without it becomes resident, its weights from the file. Where only that
    changes (same device), the KV pages stay where they are."""
    executor.drain()  # (a pipelined step still running reads the weights and writes the pages moved here)
    unit = executor.unit(index)
    source = unit.device
    clock = _PhaseClock()
    if source is dest and streamed == (unit.stream is not None):
        return MoveReport(index, source.name, dest.name, 0, 0, 0.0)
    if unit.experts is not None:
        raise JitllmError(f"block {index} streams its experts (JITLLM_GPU_STREAM=1): moving it is not built")
    kind, program, decode_program = executor.placed(index, dest)
    what = f"weights of {'the head' if index == 'head' else f'block {index}'}"
    stream = None
    if streamed:
        stream = units.admit(executor, index, dest, kind)
    else:
        dest.reserve(unit.nbytes, what, leaving=unit.nbytes if source in dest.twins and unit.stream is None else 0)
    clock.mark("program")
    new_tables: dict[int, PageTable] = {}
    new_states: dict[int, RecurrentState] = {}
    kv_bytes = state_bytes = 0
    try:
        weights = None
        if streamed:
            clock.mark("weights")
        elif not from_file and unit.stream is None and same_packing(executor.layout, index, unit.kind, kind):
            weights = unit.weights.to(dest, clock.mark)
        else:  # fused on one side, separate on the other, or streamed: from the file, laid out for the destination
            weights = executor.upload_weights(index, dest, kind)
            clock.mark("weights")
        if unit.state == KV_PAGES and source is not dest:  # (where only streaming changed, pages stay)
            pool = executor.pool(dest)
            for session in executor.sessions.values():
                old = session.tables.get(index)
                if old is not None and old.ids:
                    new = new_tables[session.id] = PageTable(pool, arena=session.arena(dest))
                    if not new.ensure(len(old.ids) * pool.page_size):
                        raise JitllmError(f"{dest.name}: out of KV pages for the history of block {index}")
            clock.mark("kv pages")
            for session_id, new in new_tables.items():
                old = executor.sessions[session_id].tables[index]
                kv_bytes += _copy_pages(unit.program, program, old, new, source, dest)
        if unit.state == RECURRENT and source is not dest:
            state_bytes = copy_states(executor.sessions.values(), index, dest, new_states)
        clock.mark("kv")
        if not from_file:  # copies with page-locked host memory run asynchronously on the GPU's
            source.synchronize()  # stream, whichever side the GPU is
        dest.synchronize()
        clock.mark("sync")
    except BaseException:
        with contextlib.suppress(Exception):  # copies into the destination may still be in flight
            dest.synchronize()
        for table in new_tables.values():
            table.release()
        for state in new_states.values():
            state.release()
        if streamed:
            stream.leave(index)
        else:
            dest.release(unit.nbytes)
        raise
    for session_id, table in new_tables.items():
        session = executor.sessions[session_id]
        session.tables[index].release()
        session.tables[index] = table
    if unit.state == KV_PAGES and source is not dest:
        for session in executor.sessions.values():
            if index in session.tables and session.id not in new_tables:
                session.tables[index].release()
                session.tables[index] = PageTable(executor.pool(dest), arena=session.arena(dest))
    commit_states(executor.sessions, index, new_states)
    if unit.stream is not None:
        unit.stream.leave(index)
    else:
        source.release(unit.nbytes)
    unit.device, unit.kind, unit.weights, unit.program, unit.decode_program = dest, kind, weights, program, decode_program
    unit.stream = stream
    executor.drop_graphs(devices=(source.name, dest.name))  # captured steps hold the source's weights and pages
    for session in executor.sessions.values():  # the next step checks every table again (a session
        session.kv_room = 0  # without pages of this block got an empty one above)
    clock.mark("switch")
    return MoveReport(index, source.name, dest.name, 0 if streamed else unit.nbytes, kv_bytes, clock.total(),
                      state_bytes, streamed, tuple(clock.phases))


class _PhaseClock:
    """Seconds spent in each named phase of a move, in order."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self.last))
        self.last = now

    def total(self) -> float:
        return self.last - self.start


def _joint_runs(old_ids: list[int], new_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first old page id, first new page id, count) of each run where both sides' ids are consecutive
    (numpy: a 16k-token history is 1,024 pages per block, ~0.2 ms as a Python loop)."""
    old, new = np.asarray(old_ids, np.int64), np.asarray(new_ids, np.int64)
    if not len(old):
        return []
    starts = np.flatnonzero(np.r_[True, (np.diff(old) != 1) | (np.diff(new) != 1)])
    counts = np.diff(np.r_[starts, len(old)])
    return list(zip(old[starts].tolist(), new[starts].tolist(), counts.tolist()))


DIRECT_RUNS = 32
"""Up to this many runs of pages (consecutive on both sides), each run is one copy between the pools;
beyond it the pages are gathered into one staging tensor, moved once and scattered (kernels)."""


def same_packing(layout, index: int | str, old: BlockKind, new: BlockKind) -> bool:
    """Whether a unit's packed weights (one allocation of its file tensors in groups, units.upload_weights)
    serve `new` as they served `old`: the packing follows only those groups, so kinds that differ in how they
    compute (a target's folded prefill, the KV type) but not in their weight inputs share it, and a move
    between them copies the allocation instead of reading the file again."""
    return old == new or layout.weight_sources(index, old) == layout.weight_sources(index, new)


def _copy_pages(src_program, dst_program, old: PageTable, new: PageTable, source: Device, dest: Device) -> int:
    """Copy the pages listed in `old` into `new`'s pages on the destination (converted on the host where the
    two pools store different KV types, jitllm.ir.kv_quant.convert_pages)."""
    src_pool, dst_pool = old.pool, new.pool
    count = len(old.ids)
    runs = _joint_runs(old.ids, new.ids)
    dtype, same = src_pool.dtype, src_pool.kv_type == dst_pool.kv_type
    if len(runs) <= DIRECT_RUNS and same:
        for first_old, first_new, run in runs:
            shape = (run, *src_pool.pages.shape[1:])
            rows = source.region(src_pool.pages, shape, dtype, first_old * src_pool.page_bytes)
            dest.copy_from(dest.region(dst_pool.pages, shape, dtype, first_new * dst_pool.page_bytes), rows, source)
        return count * src_pool.page_bytes
    shape = (count, *src_pool.pages.shape[1:])
    staged = source.empty(shape, dtype)
    src_program.export_pages(src_pool.pages, source.upload(np.asarray(old.ids, np.int32)), staged)
    if same:
        moved = dest.receive(staged, source)
    else:
        moved = dest.upload(convert_pages(source.download(staged), src_pool.kv_type, dst_pool.kv_type,
                                          dst_pool.dtype))
    dst_program.import_pages(dst_pool.pages, dest.upload(np.asarray(new.ids, np.int32)), moved)
    return count * src_pool.page_bytes


def fall_back_to_host(executor, host: Device, failed: str | None = None) -> FallBack:
    """Bring units home after a device failure: those on the device named `failed` (every unit away from
    the host where None, or where no unit is on `failed`), each unit's weights from the model file. The
    sessions' pages and state on them are dropped (that memory cannot be read) and only those blocks' KV
    is computed again from each session's history (rebuild.py); every other block, on the host or on
    another device or node, keeps its pages."""
    away = [u for u in [*executor.blocks, executor.head] if u.device is not host]
    lost = [u for u in away if u.device.name == failed] or away
    indices, names = {u.index for u in lost}, sorted({u.device.name for u in lost})
    held = []
    for session in executor.sessions.values():
        tables = [session.tables.pop(i) for i in indices if i in session.tables]
        states = [session.states.pop(i) for i in indices if i in session.states]
        if any(t.ids for t in tables) or states:
            held.append(session)
        for dropped in [*tables, *states]:
            dropped.release()
        for name in names:  # (what the session kept on the device left: its tables and step inputs there)
            session.arenas.pop(name, None)
            session.step_inputs.pop(name, None)
        if session.pipeline is not None and session.pipeline.device.name in names:
            session.pipeline = None
    for unit in lost:
        move_unit(executor, unit.index, host, from_file=True)
    return rebuild_sessions(executor, names, [u.index for u in lost], held)


def relocate(executor, plan, device: Device, host: Device, error: Exception) -> MoveReport:
    """-relocate: `device` cannot grow the context; hand its last unpinned block to the host (one holding
    KV pages where there is one), KV and all."""
    candidates = [u for u in executor.blocks if u.device is device and not plan.blocks[u.index].pinned]
    candidates = [u for u in candidates if u.state == KV_PAGES] or candidates
    if not candidates:
        raise JitllmError(f"{device.name}: the context cannot grow ({error}) and every block there is pinned")
    return move_unit(executor, candidates[-1].index, host)


def move_units(model, spec: str) -> list[MoveReport]:
    """Apply one `SEL=TARGET[,SEL=TARGET...]` move spec to a loaded model, all or nothing (planned_moves,
    then apply_moves at once)."""
    return list(apply_moves(model, planned_moves(model, spec)))


def planned_moves(model, spec: str) -> list[tuple[int | str, Device, bool]]:
    """The (unit, destination, streamed) moves of `spec`, checked before anything moves: the selector and
    target parse, blocks exist, the target is a device the model knows, no block is pinned, and the
    destination budgets hold what arrives (JitllmError naming what is wrong)."""
    from jitllm.runtime.placement import parse_placement

    placement = parse_placement(spec)
    ex = model.executor
    placement.validate(len(ex.blocks), set(model.devices))
    plan: list[tuple[int | str, Device, bool]] = []
    for entry in placement.entries:
        indices = ["head"] if entry.kind == "head" else (
            list(range(len(ex.blocks))) if entry.kind == "star" else list(range(entry.start, entry.end + 1)))
        dest = model.devices[entry.target]
        for index in indices:
            if index != "head" and model.plan.blocks[index].pinned or index == "head" and model.plan.head.pinned:
                raise JitllmError(f"move {entry.text}: block {index} is pinned (!) where it is")
            unit = ex.unit(index)
            if unit.experts is not None and (dest, entry.streamed) != (unit.device, unit.stream is not None):
                raise JitllmError(f"move {entry.text}: block {index} streams its experts (JITLLM_GPU_STREAM=1): "
                                  "moving it is not built")
            plan.append((index, dest, entry.streamed))
    _check_room(model, spec, plan)
    return plan


def apply_moves(model, plan: list[tuple[int | str, Device, bool]]) -> Iterator[MoveReport]:
    """The planned moves one unit at a time, each unit's report yielded after its move (units that were
    already there are skipped), so that a caller may run steps between two units (jitllmd does: a step then
    never waits for a whole move). All or nothing: a failure (allocation, compile, copy) moves back what was
    moved, and raises."""
    ex = model.executor
    done: list[tuple[MoveReport, Device, bool]] = []
    try:
        for index, dest, streamed in plan:
            unit = ex.unit(index)
            before = (unit.device, unit.stream is not None)
            report = move_unit(ex, index, dest, streamed=streamed)
            if before != (dest, streamed):
                done.append((report, *before))
                yield report
    except BaseException:
        for report, device, streamed in reversed(done):
            move_unit(ex, report.unit, device, streamed=streamed)
        raise


def _check_room(model, spec: str, plan: list[tuple[int | str, Device, bool]]) -> None:
    """Whether the destinations' budgets hold the weights arriving resident and the streaming slots' growth."""
    ex = model.executor
    arriving: dict[str, int] = {}
    streaming: dict[str, list[int]] = {}
    for index, dest, streamed in plan:
        unit = ex.unit(index)
        if streamed:
            streaming.setdefault(dest.name, []).append(unit.nbytes)
        elif unit.device is not dest or unit.stream is not None:
            leaving = unit.nbytes if unit.device in dest.twins and unit.stream is None else 0
            arriving[dest.name] = arriving.get(dest.name, 0) + unit.nbytes - leaving
    for name, sizes in streaming.items():
        pool = ex.streams.get(name)
        charged = pool.charged if pool is not None else 0
        slots = STREAM_SLOTS * max([*sizes, *(s.nbytes for s in (pool.members.values() if pool else ()))])
        arriving[name] = arriving.get(name, 0) + max(0, slots - charged)
    for name, nbytes in arriving.items():
        dest = model.devices[name]
        left = dest.room()
        if left is not None and nbytes > left:
            raise JitllmError(f"move {spec}: {name} cannot hold {nbytes / 2**20:.1f} MiB of weights "
                              f"({left / 2**20:.1f} MiB left)")
