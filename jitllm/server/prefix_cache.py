"""The automatic prefix cache: the engine sessions that finished requests leave behind, kept with their KV
pages and matched to new prompts by token ids, so a prompt that extends a history the server has seen (the
next turn of a chat) feeds only what is new. Bounded by a count of sessions and the KV bytes they hold;
the least recently used idle session goes first. Used from the engine thread only."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from jitllm.runtime.engine.executor import Executor
from jitllm.runtime.engine.session import Session


@dataclass
class Entry:
    session: Session
    busy: bool = False
    last_used: float = 0.0
    """time.time() of its last acquire or release."""


def kv_bytes(session: Session) -> dict[str, tuple[int, int]]:
    """Per device: the (pages, bytes) the session's KV (and recurrent state) holds there."""
    held: dict[str, tuple[int, int]] = {}
    for table in session.tables.values():
        pages, nbytes = held.get(table.pool.device.name, (0, 0))
        held[table.pool.device.name] = (pages + len(table.ids), nbytes + len(table.ids) * table.pool.page_bytes)
    for state in session.states.values():
        pages, nbytes = held.get(state.device.name, (0, 0))
        held[state.device.name] = (pages, nbytes + state.nbytes)
    return held


def total_bytes(session: Session) -> int:
    return sum(nbytes for _, nbytes in kv_bytes(session).values())


class PrefixCache:
    def __init__(self, executor: Executor, max_sessions: int, max_bytes: int | None) -> None:
        self.executor = executor
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self.entries: dict[int, Entry] = {}
        """By session id, least recently used first."""

    def acquire(self, prompt: list[int]) -> tuple[Session, int]:
        """A session for `prompt` and how many of its first tokens are already in that session's KV. The idle
        session sharing the longest prefix is cut back to it, where that keeps at least half its history
        (a short common prefix such as a system prompt is not worth another conversation's cache);
        otherwise a new session, after evicting the least recently used idle ones over the bound. A KV-page
        history is cut at a page boundary: the ragged attention kernels reduce a prompt fed from a page
        boundary exactly as one fed whole, not one fed from the middle of a page (a float-level difference
        that can flip a temp-0 near-tie)."""
        page = self.executor.layout.block_kinds[0].page_size
        best: tuple[int, Entry] | None = None
        for entry in self.entries.values():
            if not entry.busy:
                shared = min(len(os.path.commonprefix([entry.session.tokens, prompt])), len(prompt) - 1)
                if not entry.session.states:  # (a recurrent history cannot be cut back at all)
                    shared -= shared % page
                if shared > 0 and 2 * shared >= entry.session.length and (best is None or shared > best[0]):
                    best = (shared, entry)
        if best is not None and self.executor.truncate_session(best[1].session, best[0]):
            shared, entry = best
        else:
            self._evict(room_for=1)
            shared, entry = 0, Entry(self.executor.new_session())
        self.entries.pop(entry.session.id, None)
        self.entries[entry.session.id] = entry  # (most recently used last)
        entry.busy, entry.last_used = True, time.time()
        return entry.session, shared

    def release(self, session: Session) -> None:
        """The request is done with it: it stays cached, idle, until evicted."""
        entry = self.entries.pop(session.id)
        entry.busy, entry.last_used = False, time.time()
        self.entries[session.id] = entry
        self._evict(room_for=0)

    def _evict(self, room_for: int) -> None:
        """Close least recently used idle sessions while the count (with `room_for` more) or the KV bytes
        are over the bounds."""
        for entry in [e for e in self.entries.values() if not e.busy]:
            over_count = len(self.entries) + room_for > self.max_sessions
            over_bytes = self.max_bytes is not None and self.held_bytes() > self.max_bytes
            if not (over_count or over_bytes):
                return
            del self.entries[entry.session.id]
            self.executor.close_session(entry.session)

    def discard_idle(self) -> bool:
        """Close the least recently used idle session (a full pool needs its pages for a busy slot); False
        where none is idle."""
        entry = next((e for e in self.entries.values() if not e.busy), None)
        if entry is None:
            return False
        del self.entries[entry.session.id]
        self.executor.close_session(entry.session)
        return True

    def held_bytes(self) -> int:
        return sum(total_bytes(e.session) for e in self.entries.values())

    def describe(self) -> list[dict]:
        """GET /v1/sessions: every session, least recently used first."""
        return [{"id": e.session.id, "state": "busy" if e.busy else "idle", "tokens": e.session.length,
                 "pages": {device: pages for device, (pages, _) in kv_bytes(e.session).items()},
                 "kv_bytes": total_bytes(e.session), "last_used": round(e.last_used, 3)}
                for e in self.entries.values()]
