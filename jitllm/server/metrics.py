"""GET /metrics: Prometheus text from a registry of the server's own (requests, tokens, the queue, latency
histograms, KV pages and bytes per device, moves). The engine thread sets what it owns; handlers only read."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("jitllm_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("jitllm_prompt_tokens", "Prompt tokens of the jobs admitted", registry=r)
        self.cached_tokens = Counter("jitllm_cached_prompt_tokens", "Prompt tokens found in the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("jitllm_generated_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("jitllm_queue_depth", "Jobs waiting for a slot", registry=r)
        self.slots_busy = Gauge("jitllm_slots_busy", "Slots generating", registry=r)
        self.first_token = Histogram("jitllm_time_to_first_token_seconds", "From a job's arrival to its first token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("jitllm_inter_token_latency_seconds", "Between two tokens of one job",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.kv_pages = Gauge("jitllm_kv_pages", "KV pages held by sessions", ["device"], registry=r)
        self.kv_pool_pages = Gauge("jitllm_kv_pool_pages", "KV pages in the device's pool", ["device"], registry=r)
        self.kv_bytes = Gauge("jitllm_kv_bytes", "KV bytes held by sessions", ["device"], registry=r)
        self.cached_sessions = Gauge("jitllm_sessions", "Sessions kept (busy and idle)", registry=r)
        self.batched_steps = Counter("jitllm_batched_steps", "Batched steps (one step for several slots)", registry=r)
        self.batched_rows = Counter("jitllm_batched_sessions", "Slots served by batched steps, summed over the steps",
                                    registry=r)
        self.spills = Counter("jitllm_kv_spills", "Busy slots whose KV went to the host to make room in a full pool",
                              registry=r)
        self.resumes = Counter("jitllm_kv_resumes", "Spilled slots whose KV came back from the host", registry=r)
        self.spilled_bytes = Counter("jitllm_kv_spilled_bytes", "KV bytes copied to the host by spills", registry=r)
        self.cache_discards = Counter("jitllm_sessions_discarded", "Idle cached sessions closed to make room in a "
                                      "full pool", registry=r)
        self.fallbacks = Counter("jitllm_device_fallbacks", "Device faults that sent the device's units to the host",
                                 registry=r)
        self.recomputed = Counter("jitllm_recomputed_block_positions", "KV lost in a device fault and computed "
                                  "again, in positions times the lost blocks", registry=r)
        self.moves = Counter("jitllm_moves", "Units (blocks, head) moved between devices", registry=r)
        self.moved_bytes = Counter("jitllm_moved_bytes", "Weight and KV bytes moved", registry=r)

    def observe_kv(self, executor, cache) -> None:
        """The pools' pages in use, per device (called by the engine thread after each turn)."""
        for name, pool in executor.pools.items():
            used = pool.num_pages - pool.free_pages
            self.kv_pages.labels(name).set(used)
            self.kv_pool_pages.labels(name).set(pool.num_pages)
            self.kv_bytes.labels(name).set(used * pool.page_bytes)
        self.cached_sessions.set(len(cache.entries))

    def text(self) -> bytes:
        return generate_latest(self.registry)
