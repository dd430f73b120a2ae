"""After a device failure: only the lost blocks' KV (or recurrent state) is computed again, on the host, from
each session's history; every other block keeps its pages as they are.

The fall-back (migration.fall_back_to_host) has brought the failed device's units home, their weights from
the .jlm, and dropped the sessions' pages and state there (that memory cannot be read). For each session
that held some, its history's tokens run again in prompt-sized chunks through blocks 0 .. the last lost
one: the kept blocks before it run only to give the lost ones their input (their programs read their own
pages for the earlier chunks and the new K and V are thrown away: their pages are not written), a lost
block appends its K and V as a prefill would; blocks after the last lost one, and the head, do not run.
A recurrent block folds the whole history into its state, so a lost one gets a fresh state run from
position 0, and a kept one before the last lost block runs over a temporary state (its own is left as it
is). A recurrent state a failed step left half-updated is rebuilt the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jitllm.ir.block_type import RECURRENT
from jitllm.runtime.engine.faults import device_faults
from jitllm.runtime.engine.recurrent import RecurrentState
from jitllm.runtime.model_layout import HEAD

CHUNK = 512
"""Positions per rebuild step (the generation loop's prompt chunk)."""


@dataclass(frozen=True)
class FallBack:
    """What a fall-back did: the devices left, the units brought home, and what was computed again."""

    devices: tuple[str, ...]
    units: tuple[int | str, ...]
    sessions: int = 0
    """Sessions whose lost blocks' KV (or state) was computed again."""
    positions: int = 0
    """History positions those sessions held (each ran once through blocks 0 .. the last lost one)."""
    recomputed: dict[int, int] = field(default_factory=dict)
    """Block -> positions whose KV (or recurrent state) was computed again."""
    passed: tuple[int, ...] = ()
    """Kept blocks that ran over the history only to feed the lost ones (their KV not written)."""

    @property
    def block_positions(self) -> int:
        """Recomputed block-positions: each lost block's positions, summed."""
        return sum(self.recomputed.values())

    def describe(self) -> str:
        home = ", ".join("the head" if u == HEAD else f"block {u}" for u in self.units) or "nothing"
        text = f"{', '.join(self.devices)} left; {home} now on the host (weights from the file)"
        if not self.recomputed:
            return text + "; no session held KV there, nothing recomputed"
        blocks = ", ".join(str(b) for b in sorted(self.recomputed))
        text += (f"; recomputed only block{'s' if len(self.recomputed) > 1 else ''} {blocks} for "
                 f"{self.sessions} session{'s' if self.sessions != 1 else ''} ({self.positions} positions, "
                 f"{self.block_positions} block-positions)")
        if self.passed:
            text += f"; block{'s' if len(self.passed) > 1 else ''} {', '.join(map(str, self.passed))} ran over " \
                    "them without writing their KV"
        return text


def rebuild_sessions(ex, devices: list[str], units: list[int | str], held: list, chunk: int = CHUNK) -> FallBack:
    """Compute again, for each session of `held` (those that had pages or state on the lost `units`), the
    lost blocks' KV from its history, and rebuild any recurrent state a failed step left half-updated (in
    any session)."""
    lost = {u for u in units if u != HEAD}
    recomputed: dict[int, int] = {}
    passed: set[int] = set()
    sessions = positions = 0
    held_ids = {s.id for s in held}
    for session in ex.sessions.values():
        length = session.length = min(session.length, len(session.tokens))  # (a pipelined step not taken)
        del session.tokens[length:]
        broken = {i for i, state in session.states.items() if state.positions != length}
        targets = (lost if session.id in held_ids else set()) | broken
        if not length:  # nothing to compute: a broken state is only dropped (the next step starts a fresh one)
            for index in broken:
                session.states.pop(index).release()
            continue
        if not targets:
            continue
        passed |= _rebuild(ex, session, targets, chunk)
        sessions += 1
        positions += length
        for index in targets:
            recomputed[index] = recomputed.get(index, 0) + length
    return FallBack(tuple(devices), tuple(units), sessions, positions, recomputed,
                    tuple(sorted(passed - set(recomputed))))


def _rebuild(ex, session, targets: set[int], chunk: int) -> set[int]:
    """Run the session's history through blocks 0 .. max(targets), writing only the targets' KV or state;
    the kept blocks that ran."""
    length, last = session.length, max(targets)
    units = ex.blocks[:last + 1]
    ex.drop_graphs(session)
    ex.ensure_room(session, length)  # (pages on the host for the lost blocks; the kept ones have theirs)
    scratch: dict[int, RecurrentState] = {}
    for unit in units:
        if unit.state != RECURRENT:
            continue
        state = RecurrentState.zeros(unit.kind, unit.device, f"recurrent state of block {unit.index}")
        if unit.index in targets:
            old = session.states.pop(unit.index, None)
            if old is not None:
                old.release()
            session.states[unit.index] = state
            state.positions = -1  # (until the history is all in)
        else:
            scratch[unit.index] = state
    try:
        for at in range(0, length, chunk):
            _run_chunk(ex, session, units, targets, at, session.tokens[at:at + chunk], scratch)
    finally:
        for state in scratch.values():
            state.release()
    for index in targets:
        if index in session.states:
            session.states[index].positions = length
    session.kv_room = 0
    return {u.index for u in units if u.index not in targets}


def _run_chunk(ex, session, units: list, targets: set[int], at: int, ids: list[int],
               scratch: dict[int, RecurrentState]) -> None:
    n = len(ids)
    h, source = ex.embed(ids)[None], None
    cos, sin = ex.rope
    inputs: dict[str, tuple] = {}
    for unit in units:
        dev = unit.device
        with device_faults(dev):
            if source is not dev:
                h = dev.upload(h) if isinstance(h, np.ndarray) else dev.receive(h, source)
                source = dev
            if unit.state == RECURRENT:
                state = session.states[unit.index] if unit.index in targets else scratch[unit.index]
                h, _ = unit.program_for(n).main(h, state.tensor, *unit.call_weights())
                unit.launched()
                continue
            if dev.name not in inputs:
                inputs[dev.name] = (dev.upload(cos[at:at + n][None]), dev.upload(sin[at:at + n][None]),
                                    dev.upload(np.array([at], np.int32)))
            table = session.tables[unit.index]
            program = unit.program_for(n)
            if program.append is None:  # (a decode variant that appends itself: the general one does not)
                program = unit.program
            (c, s, past), pages, pt = inputs[dev.name], table.pool.pages, table.tensor()
            h, k, v = unit.outputs(program.main(h, c, s, pages, pt, past, *unit.call_weights()))
            if unit.index in targets:
                program.append(pages, k, v, pt, past)
            unit.launched()
