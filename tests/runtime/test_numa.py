"""NUMA placement of the host's weights: the decision (a pure function of the topology, the environment and
the current memory policy) on fake topologies, the policy reader and mbind applier on this machine's one
node, and a load whose host weights are interleaved. No multi-node machine runs these here."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
import threading

import numpy as np
import pytest
from sysfs_fakes import fake_sysfs
from test_cli import assert_one_line_error

from jitllm.core.errors import JitllmError
from jitllm.runtime import loading, numa
from jitllm.runtime.inventory import detect_cpu
from jitllm.runtime.numa import (
    MPOL_DEFAULT,
    MPOL_INTERLEAVE,
    Interleaver,
    MemPolicy,
    NumaPlan,
    current_policy,
    numa_plan,
)
from jitllm.runtime.workers import choose_workers

TWO_SOCKETS = {0: [0, 1], 1: [2, 3]}
FREE = MemPolicy(MPOL_DEFAULT, (), (0, 1))
linux_syscalls = pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="no NUMA syscalls known")
MPOL_F_ADDR = 1 << 1
SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}


def test_workers_on_two_nodes_interleave_the_weights_across_both():
    plan = numa_plan(TWO_SOCKETS, (0, 1, 2, 3), {}, FREE)
    assert plan.nodes == (0, 1)
    assert plan.describe() == "NUMA: host weights interleaved across nodes 0-1 (the nodes of the workers' CPUs)"


@pytest.mark.parametrize("cpus, environ, policy, why", [
    ((0, 1), {}, FREE, "the workers run on node 0 alone"),
    ((0, 2), {"JITLLM_NUMA": "off"}, FREE, "JITLLM_NUMA=off"),
    ((0, 2), {}, MemPolicy(MPOL_INTERLEAVE, (0, 1), (0, 1)),
     "a memory policy is already set (interleave over nodes 0-1, numactl?): kept"),
    ((0, 2), {}, MemPolicy(2, (1,), (0, 1)), "a memory policy is already set (bind over nodes 1, numactl?): kept"),
    ((0, 2), {}, MemPolicy(MPOL_DEFAULT, (), (1,)), "the cpuset allows node 1 only"),
    ((0, 2), {}, "Function not implemented", "the memory policy could not be read: Function not implemented"),
])
def test_the_weights_are_left_to_first_touch(cpus, environ, policy, why):
    plan = numa_plan(TWO_SOCKETS, cpus, environ, policy)
    assert plan == NumaPlan((), why)
    assert plan.describe() == f"NUMA: host weights left to first touch ({why})"


def test_one_node_and_a_bad_setting():
    assert numa_plan({0: [0, 1]}, (0, 1), {"JITLLM_NUMA": "on"}, FREE).reason == "one NUMA node"
    assert numa_plan({}, (0, 1), {}, FREE).reason == "one NUMA node"  # (no node folder in sysfs)
    with pytest.raises(JitllmError, match="JITLLM_NUMA='interleave': expected on or off"):
        numa_plan(TWO_SOCKETS, (0, 2), {"JITLLM_NUMA": "interleave"}, FREE)


def test_three_nodes_interleave_over_those_the_workers_use_and_the_cpuset_allows():
    nodes = {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: []}  # (node 3: memory only, e.g. CXL: no worker there)
    assert numa_plan(nodes, (0, 2, 4), {}, MemPolicy(MPOL_DEFAULT, (), (0, 1, 2, 3))).nodes == (0, 1, 2)
    assert numa_plan(nodes, (0, 2, 4), {}, MemPolicy(MPOL_DEFAULT, (), (1, 2))).nodes == (1, 2)


def test_topologies_read_from_fake_sysfs_trees(tmp_path):
    two = tmp_path / "two-sockets"  # 2 sockets x 2 cores, no hyperthreads
    fake_sysfs(two, {c: str(c) for c in range(4)}, {"sys/devices/system/node/node0/cpulist": "0-1",
                                                    "sys/devices/system/node/node1/cpulist": "2-3"})
    cpu = detect_cpu(str(two), mask=[0, 1, 2, 3])
    assert numa_plan(cpu.numa_nodes, choose_workers(cpu, environ={}).cpus, {}, FREE).nodes == (0, 1)
    narrowed = detect_cpu(str(two), mask=[2, 3])  # (taskset / numactl --cpunodebind=1)
    assert numa_plan(narrowed.numa_nodes, choose_workers(narrowed, environ={}).cpus, {}, FREE).nodes == ()
    hybrid = tmp_path / "hybrid"  # P-cores on node 0, E-cores on node 1: the workers (P-cores) use node 0 alone
    fake_sysfs(hybrid, {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3", 4: "4", 5: "5"},
               {"sys/devices/cpu_atom/cpus": "4-5", "sys/devices/system/node/node0/cpulist": "0-3",
                "sys/devices/system/node/node1/cpulist": "4-5"})
    cpu = detect_cpu(str(hybrid), mask=list(range(6)))
    assert numa_plan(cpu.numa_nodes, choose_workers(cpu, environ={}).cpus, {}, FREE).reason == \
        "the workers run on node 0 alone"


def _policy_at(address: int) -> int:
    mode = ctypes.c_int(-1)
    assert numa._syscall(numa._SYSCALLS[platform.machine()]["get_mempolicy"], ctypes.byref(mode), None,
                         ctypes.c_ulong(0), ctypes.c_void_p(address), ctypes.c_ulong(MPOL_F_ADDR)) == 0
    return mode.value


@linux_syscalls
def test_the_policy_reader_sees_what_numactl_would_set():
    policy = current_policy()
    assert isinstance(policy, MemPolicy) and policy.mode == MPOL_DEFAULT and policy.allowed
    seen = []

    def numactl_interleave() -> None:  # (a policy is per thread: set it on a thread of its own)
        mask = ctypes.c_ulong(1 << policy.allowed[0])
        assert numa._syscall(SET_MEMPOLICY[platform.machine()], ctypes.c_int(MPOL_INTERLEAVE), ctypes.byref(mask),
                             ctypes.c_ulong(64)) == 0
        seen.append(current_policy())

    thread = threading.Thread(target=numactl_interleave)
    thread.start()
    thread.join()
    assert seen[0].mode == MPOL_INTERLEAVE and seen[0].nodes == policy.allowed[:1]
    assert "already set (interleave" in numa_plan(TWO_SOCKETS, (0, 2), {}, seen[0]).reason


@linux_syscalls
def test_the_interleaver_sets_the_policy_of_a_buffers_pages_and_keeps_a_failure():
    node = current_policy().allowed[0]
    buffer = np.zeros(3 << 20, np.uint8)
    interleave = Interleaver((node,))
    interleave(buffer.ctypes.data + 100, buffer.nbytes - 100)  # (not page-aligned: the pages holding it)
    assert _policy_at(buffer.ctypes.data + (1 << 20)) == MPOL_INTERLEAVE
    assert (interleave.bytes, interleave.buffers, interleave.error) == (buffer.nbytes - 100, 1, None)
    missing = Interleaver((1000,))  # (a node this machine does not have)
    missing(buffer.ctypes.data, buffer.nbytes)
    missing(buffer.ctypes.data, buffer.nbytes)
    assert missing.buffers == 0 and missing.error.startswith("mbind: ")
    assert missing.describe().startswith("NUMA: 0.0 MiB of host weights in 0 buffers interleaved; then stopped: mbind")


@linux_syscalls
def test_a_load_interleaves_every_host_weights_buffer(tiny_model, cache_dir, monkeypatch):
    from jitllm.model import load
    from jitllm.runtime.backends.dlpack import data_pointer

    node = current_policy().allowed[0]  # (this machine has one node: the plan is made to interleave over it)
    monkeypatch.setattr(loading, "numa_plan", lambda *args: NumaPlan((node,), "as a two-node machine's would"))
    lines: list[str] = []
    model = load(tiny_model, devices="cpu", cache_dir=cache_dir, log=lines.append)
    units = [*model.executor.blocks, model.executor.head]
    assert f"NUMA: host weights interleaved across nodes {node} (as a two-node machine's would)" in lines
    done = [line for line in lines if line.startswith("NUMA: ") and "buffers interleaved" in line]
    assert done == [f"NUMA: {sum(u.weights.buffer.shape[0] for u in units) / 2**20:.1f} MiB of host weights in "
                    f"{len(units)} buffers interleaved"]
    assert all(_policy_at(data_pointer(u.weights.buffer)) == MPOL_INTERLEAVE for u in units)
    monkeypatch.setenv("JITLLM_NUMA", "off")
    monkeypatch.setattr(loading, "numa_plan", numa_plan)
    lines.clear()
    load(tiny_model, devices="cpu", cache_dir=cache_dir, log=lines.append)
    assert "NUMA: host weights left to first touch (JITLLM_NUMA=off)" in lines


def test_a_bad_setting_is_one_line_from_the_cli(tiny_model, cache_dir):
    env = dict(os.environ, JITLLM_CACHE_DIR=str(cache_dir), JITLLM_NUMA="sometimes")
    result = subprocess.run([sys.executable, "-m", "jitllm", "run", "-n", "2", "-devices", "cpu", str(tiny_model), "hi"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert_one_line_error(result, "JITLLM_NUMA='sometimes': expected on or off")
