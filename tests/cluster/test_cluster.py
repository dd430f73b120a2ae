"""Blocks on another node of a local two-node Ray cluster (tests/cluster/conftest.py): the tokens of a
single-host run, moves between the nodes mid-generation, `jitllm hardware -cluster`, the grammar's errors,
and a node that dies mid-generation (last: it takes node2 away)."""

from __future__ import annotations

import pytest

from jitllm.core.errors import JitllmError
from jitllm.model import load
from jitllm.runtime.sampling import SamplingParams

PROMPT = list(range(4, 30))
N = 12


def _load(path, cache_dir, address, devices="node2/cpu", placement="0=host,1=node2/cpu", **options):
    return load(path, devices=devices, ctx=128, cache_dir=cache_dir, cpu_kernels="exact", cluster=address,
                placement=placement, **options)


@pytest.fixture(scope="module")
def baseline(tiny_model, cache_dir):
    return load(tiny_model, devices="cpu", ctx=128, cache_dir=cache_dir, cpu_kernels="exact").generate_ids(PROMPT, N)


def test_blocks_on_another_node_give_the_single_host_tokens(tiny_model, cache_dir, ray_cluster, baseline):
    model = _load(tiny_model, cache_dir, ray_cluster[0])
    assert [u.device.name for u in model.executor.blocks] == ["host", "node2/cpu"]
    assert model.generate_ids(PROMPT, N) == baseline


def test_moves_between_nodes_keep_the_tokens(tiny_model, cache_dir, ray_cluster, baseline):
    """Weights and every session's KV pages go to the other node and back, between two tokens."""
    model = _load(tiny_model, cache_dir, ray_cluster[0], placement="*=host,head=host")
    logs, reports = [], []
    model.log = logs.append
    scheduled = model._scheduled_moves

    def recorded(produced: int):
        found = scheduled(produced)
        reports.extend(found)
        return found

    model._scheduled_moves = recorded
    model.move_schedule = {3: ["0=node2/cpu"], 5: ["1=node2/cpu,head=node2/cpu"], 8: ["0=host,head=host"]}
    assert model.generate_ids(PROMPT, N) == baseline
    moved = [line for line in logs if line.startswith("moved")]
    assert len(moved) == 5 and "moved block 0 host -> node2/cpu" in moved[0]
    # the pages went along (4 KiB of f16 KV a block here: the log's MiB round it to 0.00)
    assert len(reports) == 5 and all(r.kv_bytes > 0 for r in reports if r.unit != "head")
    assert [u.device.name for u in model.executor.blocks] == ["host", "node2/cpu"]


def test_cluster_hardware_and_grammar_errors(tiny_model, cache_dir, ray_cluster):
    from click.testing import CliRunner

    from jitllm.cli import main

    result = CliRunner().invoke(main, ["hardware", "-cluster", ray_cluster[0]])
    assert result.exit_code == 0, result.output
    assert "node head (127.0.0.1" in result.output and "node node2 (127.0.0.1" in result.output
    assert result.output.count("CPU: ") == 2
    with pytest.raises(JitllmError, match=r"^node3/cpu: no node 'node3' in the cluster at .* \(its nodes: head, node2\)$"):
        _load(tiny_model, cache_dir, ray_cluster[0], devices="node3/cpu", placement=None)
    with pytest.raises(JitllmError, match=r"^node2/cpu: node2/cpu names a device of another node: join its cluster"):
        load(tiny_model, devices="node2/cpu", cache_dir=cache_dir)


def test_a_node_that_does_not_answer_times_out(tiny_model, cache_dir, ray_cluster, baseline):
    """Its actor stopped (SIGSTOP) mid-generation: the wait ends at the timeout, naming the node, and the
    blocks come back to the coordinator (the tokens stay the same)."""
    import os
    import signal

    import ray

    from jitllm.runtime.backends import ray_remote

    model = _load(tiny_model, cache_dir, ray_cluster[0])
    link = model.devices["node2/cpu"].backend.link
    pid = ray.get(link.actor.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)
    logs, tokens = [], []
    model.log = logs.append
    link.timeout = 1.0
    try:
        for token in model.generate_tokens(PROMPT, N, SamplingParams(0.0)):
            tokens.append(token)
            if len(tokens) == 3:
                os.kill(pid, signal.SIGSTOP)
    finally:
        os.kill(pid, signal.SIGCONT)
        ray_remote.reset()  # (node2's actor is left failed: the next test starts another)
    assert tokens == baseline
    assert any("node2/cpu: node node2 (127.0.0.1" in line and "did not answer within 1 s" in line for line in logs), logs


def test_a_node_that_dies_mid_generation(tiny_model, cache_dir, ray_cluster, baseline):
    """Its blocks come back to the coordinator and the tokens stay the same; with -no-gpu-fallback, one
    error naming the node. (Last: node2 is gone after it.)"""
    address, cluster, node2 = ray_cluster
    falls_back = _load(tiny_model, cache_dir, address)
    strict = _load(tiny_model, cache_dir, address, no_gpu_fallback=True)
    logs = []
    falls_back.log = logs.append
    tokens = []
    for token in falls_back.generate_tokens(PROMPT, N, SamplingParams(0.0)):
        tokens.append(token)
        if len(tokens) == 4:
            cluster.remove_node(node2)
    assert tokens == baseline
    assert any(line.startswith("warning: node2/cpu: node node2 (127.0.0.1") and "finishing on the CPU" in line
               for line in logs), logs
    assert all(u.device.name == "host" for u in falls_back.executor.blocks)
    with pytest.raises(JitllmError, match=r"^node2/cpu: node node2 \(127.0.0.1, id \w+\) is gone .*-no-gpu-fallback is set"):
        strict.generate_ids(PROMPT, 4)
