"""The engine's bookkeeping on plain integers (vLLM v1's way): page ids of each device's pool and how many
pages a history needs. Tensors live in the pools and devices (kv_pages.py); nothing here touches them.

Allocation says no by returning None, never by raising, so its caller decides what to do when a pool is
full: grow the pool, move a block elsewhere (relocate), spill a session, or wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def pages_for(positions: int, page_size: int) -> int:
    """Pages that hold `positions` positions."""
    return -(-positions // page_size)


STEP_POSITIONS = 256
"""A reserved pool's ids grow by this many positions of each of its blocks at a time (kv.pool)."""


def initial_pages(blocks: int, ctx: int, page_size: int) -> int:
    """A new pool's size: its blocks' pages for a quarter of the context (it grows on demand)."""
    return max(1, blocks) * max(1, pages_for(ctx, 4 * page_size))


def step_pages(blocks: int, ctx: int, page_size: int) -> int:
    """A reserved pool's first size and growth step: its blocks' pages for STEP_POSITIONS positions (a
    quarter of the context, where less: initial_pages)."""
    return min(initial_pages(blocks, ctx, page_size), max(1, blocks) * pages_for(STEP_POSITIONS, page_size))


def context_pages(blocks: int, ctx: int, page_size: int) -> int:
    """Pages for the whole context in each of `blocks` (what one session can use)."""
    return max(1, blocks) * pages_for(ctx, page_size)


@dataclass
class PageAllocator:
    """The page ids of one pool: `capacity` ids exist (0 .. capacity-1); `free` is a stack of those not in
    use, the next to hand out on top."""

    capacity: int = 0
    free: list[int] = field(default_factory=list)

    def take(self, count: int) -> list[int] | None:
        """`count` free ids in the order they were freed last (lowest first from a fresh pool), or None
        when fewer are free."""
        if count > len(self.free):
            return None
        taken = self.free[len(self.free) - count:]  # the stack's top, popped in one slice
        del self.free[len(self.free) - count:]
        return taken[::-1]

    def give_back(self, ids: list[int]) -> None:
        self.free.extend(reversed(ids))

    def extend(self, capacity: int) -> None:
        """The pool now holds `capacity` pages: the new ids are handed out before the ones already free."""
        self.free = list(range(capacity - 1, self.capacity - 1, -1)) + self.free
        self.capacity = capacity

    def growth(self, count: int, max_pages: int | None) -> int | None:
        """The capacity to grow to for `count` more ids than are free (doubling, up to `max_pages`), or None
        where even `max_pages` is too few."""
        short = count - len(self.free)
        want = max(2 * self.capacity, self.capacity + short)
        if max_pages is not None:
            want = min(want, max_pages)
        return want if want - self.capacity >= short else None


@dataclass
class SequencePlan:
    """What a batch step plan knows of one sequence, as integers: its prompt's length, how much of it has
    run, and whether a sampled token waits to be fed (it decodes)."""

    id: int
    prompt: int
    fed: int = 0
    decoding: bool = False


def plan_step(sequences: list[SequencePlan], token_budget: int, max_sequences: int) -> list[tuple[int, int]]:
    """(sequence id, tokens) of the next batched step: every decoding sequence one token (in order), then
    chunks of the prompts not yet run, first come first served, while the step has fewer than
    `token_budget` tokens and `max_sequences` sequences (chunked prefill mixed with decode)."""
    plan = [(s.id, 1) for s in sequences if s.decoding][:max_sequences]
    left = token_budget - len(plan)
    for s in sequences:
        if left <= 0 or len(plan) >= max_sequences:
            break
        if not s.decoding and s.fed < s.prompt:
            take = min(s.prompt - s.fed, left)
            plan.append((s.id, take))
            left -= take
    return plan
