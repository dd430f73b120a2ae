"""The host's worker count (runtime/workers.py) from fake sysfs trees: one worker per physical performance
core in the mask, -threads and TVM_NUM_THREADS over it, and how the pools are then sized and kept."""

from __future__ import annotations

import pytest
from test_inventory import fake_sysfs

from jitllm.core.errors import JitllmError
from jitllm.runtime.inventory import detect_cpu
from jitllm.runtime.workers import BIND_ENV, ENV, apply_workers, choose_workers

# 2 P-cores with hyperthreads (0/1, 2/3) and 4 E-cores (4-7), as test_inventory's hybrid machine
HYBRID = {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3", 4: "4", 5: "5", 6: "6", 7: "7"}


@pytest.fixture
def hybrid(tmp_path):
    fake_sysfs(tmp_path, HYBRID, {"sys/devices/cpu_atom/cpus": "4-7"})
    return tmp_path


def test_one_worker_per_performance_core_siblings_and_e_cores_left_alone(hybrid):
    workers = choose_workers(detect_cpu(str(hybrid), mask=list(range(8))), environ={})
    assert (workers.count, workers.cpus, workers.source) == (2, (0, 2), "performance cores")
    assert workers.left_alone == (1, 3, 4, 5, 6, 7)
    assert workers.describe(2) == ("CPU workers: 2 (one per physical performance core in the CPU mask; "
                                   "on CPUs 0,2; left alone: 1,3-7)")


def test_the_process_mask_decides_which_cores_count(hybrid):
    # taskset -c 2-5: one P-core (2, its sibling 3) and two E-cores
    workers = choose_workers(detect_cpu(str(hybrid), mask=[2, 3, 4, 5]), environ={})
    assert (workers.count, workers.cpus, workers.left_alone) == (1, (2,), (3, 4, 5))
    # only E-cores in the mask: they are what there is, one worker each
    only_e = choose_workers(detect_cpu(str(hybrid), mask=[5, 6]), environ={})
    assert (only_e.count, only_e.cpus, only_e.left_alone) == (2, (5, 6), ())


def test_arm_big_cores_by_capacity(tmp_path):
    capacity = {f"sys/devices/system/cpu/cpu{i}/cpu_capacity": c for i, c in enumerate(["446", "446", "1024", "1024"])}
    fake_sysfs(tmp_path, {i: str(i) for i in range(4)}, capacity)
    workers = choose_workers(detect_cpu(str(tmp_path), mask=[0, 1, 2, 3]), environ={})
    assert (workers.count, workers.cpus) == (2, (2, 3))


def test_threads_flag_then_environment_override_the_cores(hybrid):
    cpu = detect_cpu(str(hybrid), mask=list(range(8)))
    assert choose_workers(cpu, 1, environ={ENV: "6"}).count == 1  # -threads wins
    env = choose_workers(cpu, environ={ENV: "3"})
    assert (env.count, env.source, env.cpus) == (3, ENV, (0, 2, 1))  # the third takes a sibling
    assert "TVM_NUM_THREADS" in env.describe(3)
    many = choose_workers(cpu, 5, environ={})
    assert many.cpus == (0, 2, 1, 3, 4) and many.left_alone == (5, 6, 7)
    assert choose_workers(cpu, 4, environ={}).describe(2).endswith("TVM's pool runs 2)")
    assert choose_workers(cpu, environ={ENV: ""}).source == "performance cores"  # empty: as if unset


@pytest.mark.parametrize("value", ["0", "two", "-1", "2.5"])
def test_a_bad_environment_count_is_one_clear_error(hybrid, value):
    with pytest.raises(JitllmError, match="TVM_NUM_THREADS"):
        choose_workers(detect_cpu(str(hybrid), mask=[0, 1]), environ={ENV: value})


def test_applying_sizes_the_pools_and_narrows_only_past_the_workers_cpus(hybrid):
    calls: list = []
    environ: dict[str, str] = {}
    apply_workers(choose_workers(detect_cpu(str(hybrid), mask=list(range(8))), environ={}), environ,
                  lambda pid, cpus: calls.append((pid, cpus)))
    assert environ == {ENV: "2", BIND_ENV: "0"} and calls == [(0, {0, 2})]
    # a plain machine (every CPU a core): nothing to narrow, however few workers; a user's binding is kept
    plain = {BIND_ENV: "1"}
    apply_workers(choose_workers(detect_cpu(str(hybrid), mask=[0, 2]), 1, environ={}), plain,
                  lambda pid, cpus: calls.append((pid, cpus)))
    assert plain == {ENV: "1", BIND_ENV: "1"} and len(calls) == 1
