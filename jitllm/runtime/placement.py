"""Placement maps: `SEL=TARGET[!|~]`, comma-separated, saying where named blocks and the head run.

Selectors are `N`, `A-B` (inclusive), `head` (the output projection) and `*` (every block no other
entry names). TARGET is `host` or a device that -devices names. `!` pins an entry, `~` streams it.
Parsing checks the map on its own; `Placement.validate` checks it against a model and -devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jitllm.core.errors import JitllmError

HOST = "host"

_SELECTOR = re.compile(r"([0-9]+)(?:\s*-\s*([0-9]+))?")
_TARGET = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.:/\-]*)(.*)")


@dataclass(frozen=True)
class PlacementEntry:
    """One `SEL=TARGET` entry. `kind` is index, range, head or star; start/end are inclusive block
    ids (None for head and star); `target` is lower case; `text` is the entry as written."""

    kind: str
    start: int | None
    end: int | None
    target: str
    pinned: bool
    streamed: bool
    text: str

    def covers(self, block: int) -> bool:
        """Whether this entry names `block` itself (`*` names no block: it is the fallback)."""
        return self.start is not None and self.start <= block <= self.end

    def _overlaps(self, other: PlacementEntry) -> bool:
        if self.start is None or other.start is None:
            return self.kind == other.kind
        return self.start <= other.end and other.start <= self.end


@dataclass(frozen=True)
class Placement:
    """An ordered placement map; no two entries name the same block."""

    entries: tuple[PlacementEntry, ...]

    def entry_for(self, block: int) -> PlacementEntry | None:
        """The entry that places `block`: one naming it, else `*`, else None (the engine's choice)."""
        star = None
        for entry in self.entries:
            if entry.covers(block):
                return entry
            if entry.kind == "star":
                star = entry
        return star

    def head(self) -> PlacementEntry | None:
        return next((e for e in self.entries if e.kind == "head"), None)

    def validate(self, num_blocks: int, device_names: set[str]) -> None:
        """Raise JitllmError for a block past the model's last one or a target -devices lacks."""
        names = {n.lower() for n in device_names}
        for entry in self.entries:
            if entry.end is not None and entry.end >= num_blocks:
                if not num_blocks:
                    raise JitllmError(f"placement {entry.text}: the model has no blocks")
                past = max(entry.start, num_blocks)
                raise JitllmError(f"placement {entry.text}: block {past} is past the model's last "
                                  f"block {num_blocks - 1}")
            if entry.target != HOST and entry.target not in names:
                raise JitllmError(f"placement {entry.text}: {entry.target} is not in -devices")

    def __str__(self) -> str:
        return ",".join(e.text for e in self.entries)


@dataclass(frozen=True)
class PlacementOption:
    """The load option that carries a placement map to model loading; strict = all or nothing."""

    placement: Placement
    strict: bool = False


def parse_placement(text: str) -> Placement:
    """Parse a placement map; JitllmError (one line naming the entry) on any mistake."""
    if not text.strip():
        raise JitllmError("-placement is empty: give SEL=TARGET entries")
    if not text.isprintable():
        raise JitllmError(f"-placement {text!r}: control characters are not allowed")
    entries: list[PlacementEntry] = []
    for raw in text.split(","):
        entry = _parse_entry(raw.strip(), text.strip())
        for other in entries:
            if entry._overlaps(other):
                raise JitllmError(f"placement {entry.text}: overlaps {other.text}")
        entries.append(entry)
    return Placement(tuple(entries))


def with_placement(placement: Placement | str, strict: bool = False) -> PlacementOption:
    """A load option from a Placement or its text (parsed here, so bad text fails early)."""
    if isinstance(placement, str):
        placement = parse_placement(placement)
    return PlacementOption(placement, strict)


def _parse_entry(text: str, whole: str) -> PlacementEntry:
    if not text:
        raise JitllmError(f"placement {whole}: empty entry")
    selector, eq, rhs = text.partition("=")
    if not eq:
        raise JitllmError(f"placement {text}: missing '=' (write SEL=TARGET)")
    kind, start, end = _parse_selector(selector.strip(), text)
    m = _TARGET.fullmatch(rhs.strip())
    if not m:
        raise JitllmError(f"placement {text}: missing or bad target (host or a -devices name)")
    target, suffix = m.group(1).lower(), "".join(m.group(2).split())
    for ch in suffix:
        if ch not in "!~":
            raise JitllmError(f"placement {text}: unknown suffix '{ch}' (use ! to pin, ~ to stream)")
        if suffix.count(ch) > 1:
            raise JitllmError(f"placement {text}: suffix '{ch}' given twice")
    streamed = "~" in suffix
    if streamed and target == HOST:
        raise JitllmError(f"placement {text}: only a device can stream a block, not the host")
    if streamed and kind == "head":
        raise JitllmError(f"placement {text}: the head cannot be streamed")
    return PlacementEntry(kind, start, end, target, "!" in suffix, streamed, text)


def _parse_selector(selector: str, text: str) -> tuple[str, int | None, int | None]:
    if selector.lower() == "head":
        return "head", None, None
    if selector == "*":
        return "star", None, None
    m = _SELECTOR.fullmatch(selector)
    if not m:
        raise JitllmError(f"placement {text}: bad selector '{selector}' (use N, A-B, head or *)")
    start = int(m.group(1))
    if m.group(2) is None:
        return "index", start, start
    end = int(m.group(2))
    if end < start:
        raise JitllmError(f"placement {text}: range {start}-{end} is backwards")
    return "range", start, end
