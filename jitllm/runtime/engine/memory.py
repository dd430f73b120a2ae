"""What the engine holds in host memory, by its own accounting: the weights it copied off the mapped model
file (each unit's packed buffer on a device whose memory is the host's) and the KV pages there, both the
pools' size and what sessions use. bench/run_rss.py compares these with the process's RssAnon."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from jitllm.ir.block_type import KV_PAGES


@dataclass(frozen=True)
class HostMemory:
    weights: int
    """Bytes of unit weights in host allocations (PackedWeights buffers; streamed units hold none)."""
    kv_pool: int
    """Bytes of the pages the host pools have ids for (what their devices' KV budgets are charged)."""
    kv_reserved: int
    """Bytes of the host pools' tensors (their rows: reserved ahead where memory comes as it is written)."""
    kv_used: int
    """Bytes of KV the given sessions' positions take: positions x kv_position_bytes, per session."""
    kv_position_bytes: int
    """Bytes one position takes over every attention block whose pool is in host memory."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def in_host_memory(device) -> bool:
    return device.backend.caps.unified_memory


def host_memory(ex, sessions=()) -> HostMemory:
    """The executor's host-memory holdings; `sessions`: whose KV counts as used."""
    units = [*ex.blocks, ex.head]
    weights = sum(int(u.weights.buffer.shape[0]) for u in units if u.weights is not None and in_host_memory(u.device))
    pools = [p for p in ex.pools.values() if in_host_memory(p.device)]
    kv_pool = sum(p.num_pages * p.page_bytes for p in pools)
    reserved = sum(p.rows * p.page_bytes for p in pools)
    per_position = sum(ex.pools[u.device.name].page_bytes // ex.pools[u.device.name].page_size
                       for u in ex.blocks if u.state == KV_PAGES and in_host_memory(u.device))
    used = sum(s.length for s in sessions) * per_position
    return HostMemory(weights, kv_pool, reserved, used, per_position)
