"""Which routed experts the slots of an expert cache hold (expert streaming, JITLLM_GPU_STREAM=1): the
replacement policy alone, over (block, expert) keys and slot numbers, with no device in sight.
runtime/engine/streaming.py uploads what it says; bench/expert_cache.py drives it with a scripted router.

Policies (JITLLM_EXPERT_CACHE): `lru` (default) gives up the slot used longest ago; `decay` the expert with
the lowest use count, each use's weight halving every DECAY_HALF_LIFE uses of the cache (frequency with
decay: an expert many recent tokens picked outlasts one picked once just now).
"""

from __future__ import annotations

import heapq
import math
import os
from collections import OrderedDict
from collections.abc import Iterable

from jitllm.core.errors import JitllmError

Key = tuple[int, int]
"""(block, expert)."""
POLICIES = ("lru", "decay")
POLICY_ENV = "JITLLM_EXPERT_CACHE"
DECAY_HALF_LIFE = 64
"""Uses of the cache (`place` calls: one per block and step) over which a use's weight halves (`decay`)."""


def policy_from_env() -> str:
    """JITLLM_EXPERT_CACHE's policy (lru where unset); a one-line error for another value."""
    value = os.environ.get(POLICY_ENV, "lru") or "lru"
    if value not in POLICIES:
        raise JitllmError(f"{POLICY_ENV}={value!r}: must be one of {', '.join(POLICIES)}")
    return value


class ExpertSlots:
    """`capacity` slots, each empty or holding one key; counts the hits and misses of `place`. Each miss costs
    O(log capacity) (a cache may hold every expert of a 48-block model: thousands of slots)."""

    def __init__(self, capacity: int, policy: str = "lru", half_life: float = DECAY_HALF_LIFE) -> None:
        if capacity < 1:
            raise JitllmError(f"an expert cache needs at least one slot (got {capacity})")
        if policy not in POLICIES:
            raise JitllmError(f"unknown expert cache policy {policy!r} (known: {', '.join(POLICIES)})")
        self.capacity, self.policy = capacity, policy
        self._log_factor = -math.log(2.0) / half_life
        self.holder: list[Key | None] = [None] * capacity
        self.where: dict[Key, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._order: OrderedDict[int, None] = OrderedDict()
        """lru: the held slots, used longest ago first."""
        self._score: dict[Key, float] = {}
        """decay: each key's log decayed use count, brought to clock 0 (log count - clock * log factor), so
        comparing two needs no clock: time scales every count alike."""
        self._heap: list[tuple[float, Key]] = []
        """decay: (score, key) of held keys; entries whose score is stale are skipped when popped."""
        self._clock = 0
        self.hits = self.misses = 0

    def place(self, wanted: Iterable[Key]) -> tuple[dict[Key, int], list[tuple[Key, int]]]:
        """Slots for every key of `wanted` (at most `capacity` distinct keys): where each one is, and the
        (key, slot) pairs to upload for its misses (into empty slots first, then those the policy gives
        up, never one holding a key of `wanted`)."""
        keys = list(dict.fromkeys(wanted))
        if len(keys) > self.capacity:
            raise JitllmError(f"{len(keys)} experts at once do not fit an expert cache of {self.capacity}")
        self._clock += 1
        misses = [key for key in keys if key not in self.where]
        self.hits += len(keys) - len(misses)
        self.misses += len(misses)
        for key in keys:
            if key in self.where:
                self._use(key)
        wanted_keys = set(keys)
        uploads = []
        for key in misses:
            slot = self._free.pop() if self._free else self._evict(wanted_keys)
            self.holder[slot], self.where[key] = key, slot
            self._use(key)
            uploads.append((key, slot))
        return {key: self.where[key] for key in keys}, uploads

    def _use(self, key: Key) -> None:
        if self.policy == "lru":
            self._order[self.where[key]] = None
            self._order.move_to_end(self.where[key])
            return
        now = self._clock * self._log_factor
        old = self._score.get(key)
        count = 1.0 if old is None else math.exp(old + now) + 1.0  # (the decayed count, one use more)
        self._score[key] = math.log(count) - now
        heapq.heappush(self._heap, (self._score[key], key))
        if len(self._heap) > 4 * self.capacity + 64:  # (stale entries dropped: the heap stays bounded)
            self._heap = [(self._score[k], k) for k in self.where]
            heapq.heapify(self._heap)

    def _evict(self, wanted: set[Key]) -> int:
        """The slot the policy gives up (its key leaves), never one holding a key of `wanted`."""
        if self.policy == "lru":
            slot = next(s for s in self._order if self.holder[s] not in wanted)
            del self._order[slot]
        else:
            skipped = []
            while True:
                score, key = heapq.heappop(self._heap)
                if key in self.where and self._score[key] == score:
                    if key not in wanted:
                        break
                    skipped.append((score, key))
            for entry in skipped:
                heapq.heappush(self._heap, entry)
            slot = self.where[key]
        del self.where[self.holder[slot]]
        self.holder[slot] = None
        return slot
