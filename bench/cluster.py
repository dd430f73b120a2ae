"""The cost of a host boundary on a Ray cluster, measured in one run against the same work on one host:

    python bench/cluster.py -cluster ADDRESS [-node node2] [-model PATH] [-split 15] [-n 64] [-reps 3]

1. Ray's per-hop control cost: the round trip of an empty call to an actor on NODE, as a plain actor call
   and as a Ray Compiled Graph (ray.dag, experimental_compile), where that works on this setup.
2. Decode: the same model with blocks SPLIT.. on NODE/cpu (the head on the host: two hops per token)
   against all of it on the host, alternating, medians; the difference per token over the two hops is
   the per-hop overhead jitllm adds (control, the hidden state's copies, the remote dispatch).
3. A move of those blocks (weights and the session's KV pages) to NODE and back against a plain
   transfer of the same bytes to an actor there (ray.get of a call carrying one array).

Where every node is this machine (127.x addresses, one /dev/shm) these are loopback figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Echo:
    def ping(self, x=None):
        return x

    def take(self, array):
        return array.nbytes


def round_trips(actor, reps: int) -> tuple[float, float | None, str]:
    """µs per empty round trip: a plain actor call, and a compiled graph's execute (None where it fails)."""
    import ray

    for _ in range(20):
        ray.get(actor.ping.remote())
    start = time.perf_counter()
    for _ in range(reps):
        ray.get(actor.ping.remote())
    plain = (time.perf_counter() - start) / reps * 1e6
    try:
        from ray.dag import InputNode

        with InputNode() as inp:
            dag = actor.ping.bind(inp)
        compiled = dag.experimental_compile()
        for _ in range(20):
            ray.get(compiled.execute(0))
        start = time.perf_counter()
        for _ in range(reps):
            ray.get(compiled.execute(0))
        graph = (time.perf_counter() - start) / reps * 1e6
        compiled.teardown()
        return plain, graph, ""
    except Exception as e:  # Compiled Graphs are experimental: any failure is reported, not fatal
        return plain, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-cluster", required=True)
    parser.add_argument("-node", default="node2")
    parser.add_argument("-model", default=None)
    parser.add_argument("-split", type=int, default=15)
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("-reps", type=int, default=3)
    a = parser.parse_args()

    from jitllm.default_model import default_model_path
    from jitllm.model import load
    from jitllm.runtime.cluster.connection import connect

    cluster = connect(a.cluster)
    node = cluster.node(a.node, a.node)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    echo = ray.remote(num_cpus=0)(Echo).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
    plain, graph, why = round_trips(echo, 500)
    print(f"ray round trip to {node.label()}: plain actor call {plain:.0f} us, compiled graph "
          + (f"{graph:.0f} us" if graph is not None else f"failed ({why})"))

    path = a.model or default_model_path()
    remote = f"{node.name.lower()}/cpu"
    model = load(path, devices=remote, cluster=a.cluster, placement="*=host,head=host", ctx=512)
    blocks = len(model.executor.blocks)
    ids = model.encode_prompt("Tell me a long story about a dragon and a knight.", chat=True)
    split = f"{a.split}-{blocks - 1}"

    def decode_ms() -> float:
        out = model.generate_ids(ids, a.n)
        return 1e3 / model.last_stats.decode_tps if len(out) > 1 else float("nan")

    decode_ms()  # (warm: programs loaded on both sides)
    model.move(split, remote)
    decode_ms()
    model.move(split, "host")
    one_host, across = [], []
    for _ in range(a.reps):
        one_host.append(decode_ms())
        model.move(split, remote)
        across.append(decode_ms())
        model.move(split, "host")
    host_ms, split_ms = statistics.median(one_host), statistics.median(across)
    print(f"decode, blocks {split} on {remote} (2 hops per token) vs all on the host: {split_ms:.2f} vs "
          f"{host_ms:.2f} ms per token -> {(split_ms - host_ms) / 2 * 1e3:.0f} us per hop")

    session = model.new_session()
    model.executor.forward(session, ids)
    link = model.devices[remote].backend.link
    times, nbytes = [], 0
    for _ in range(a.reps):
        start = time.perf_counter()
        reports = model.move(split, remote)
        link.flush(remote)  # (the copies were sent; wait until they landed)
        times.append(time.perf_counter() - start)
        nbytes = sum(r.weight_bytes + r.kv_bytes for r in reports)
        model.move(split, "host")
    import numpy as np

    payload = np.ones(nbytes, np.uint8)
    plain_times = []
    for _ in range(a.reps):
        start = time.perf_counter()
        ray.get(echo.take.remote(payload))
        plain_times.append(time.perf_counter() - start)
    print(f"move of blocks {split} to {remote} ({nbytes / 2**20:.1f} MiB weights + KV): "
          f"{statistics.median(times) * 1e3:.1f} ms vs a plain Ray transfer of the same bytes "
          f"{statistics.median(plain_times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
