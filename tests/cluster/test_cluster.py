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
