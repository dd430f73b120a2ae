"""Where the host's weights live on a machine of several NUMA nodes: interleaved page by page across the
nodes the CPU workers run on, so that every worker reads at the bandwidth of all their memory controllers
rather than of the one node whose thread first touched the pages (the loader's).

Nothing is done where the workers sit on one node (first touch already puts the weights there), where the
process already has a memory policy (`numactl --interleave`, `--membind`, `--preferred`: the user's choice
is kept), or where JITLLM_NUMA=off. The decision (`numa_plan`) is a pure function of the topology, the
environment and the current policy; `interleave` applies it to one weights buffer through the kernel's
own interface, mbind(2) (a syscall through libc: no library needed).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

from jitllm.core.errors import JitllmError
from jitllm.runtime.inventory import format_cpu_list, parse_cpu_list

ENV = "JITLLM_NUMA"
MPOL_DEFAULT, MPOL_INTERLEAVE = 0, 3
MPOL_MF_MOVE = 1 << 1
"""mbind: move pages already touched (a reused heap allocation) to the policy; unmovable ones (page-locked)
are left where they are without an error."""
_POLICY_NAMES = {1: "preferred", 2: "bind", 3: "interleave", 4: "local", 5: "preferred-many",
                 6: "weighted-interleave"}
_SYSCALLS = {"x86_64": {"mbind": 237, "get_mempolicy": 239},
             "aarch64": {"mbind": 235, "get_mempolicy": 236}}
"""Syscall numbers (x86_64's table, and the generic one arm64 uses)."""
_MAX_NODES = 1024


@dataclass(frozen=True)
class MemPolicy:
    """The process's memory policy as the kernel reports it (get_mempolicy) and the nodes its cpuset lets it
    allocate on (/proc/self/status Mems_allowed_list)."""

    mode: int
    nodes: tuple[int, ...]
    allowed: tuple[int, ...]


@dataclass(frozen=True)
class NumaPlan:
    """The nodes the host's weights are interleaved across (empty: left to the kernel's first touch) and why."""

    nodes: tuple[int, ...]
    reason: str

    def describe(self) -> str:
        """The -v line."""
        if self.nodes:
            return f"NUMA: host weights interleaved across nodes {format_cpu_list(list(self.nodes))} ({self.reason})"
        return f"NUMA: host weights left to first touch ({self.reason})"


def numa_plan(numa_nodes: Mapping[int, list[int]], worker_cpus: tuple[int, ...], environ: Mapping[str, str],
              policy: MemPolicy | str) -> NumaPlan:
    """What to do with the host's weights: `numa_nodes` node -> CPUs (CpuInfo.numa_nodes), the CPUs the
    workers run on (Workers.cpus), the environment (JITLLM_NUMA: on, the default, or off) and the current
    policy (or why it could not be read)."""
    setting = environ.get(ENV, "on").strip().lower() or "on"
    if setting not in ("on", "off"):
        raise JitllmError(f"{ENV}={environ[ENV]!r}: expected on or off")
    if setting == "off":
        return NumaPlan((), f"{ENV}=off")
    spanned = tuple(sorted(n for n, cpus in numa_nodes.items() if set(cpus) & set(worker_cpus)))
    if len(numa_nodes) < 2:
        return NumaPlan((), "one NUMA node")
    if len(spanned) < 2:
        return NumaPlan((), f"the workers run on node {format_cpu_list(list(spanned))} alone")
    if isinstance(policy, str):
        return NumaPlan((), f"the memory policy could not be read: {policy}")
    if policy.mode != MPOL_DEFAULT:
        name = _POLICY_NAMES.get(policy.mode, f"mode {policy.mode}")
        over = f" over nodes {format_cpu_list(list(policy.nodes))}" if policy.nodes else ""
        return NumaPlan((), f"a memory policy is already set ({name}{over}, numactl?): kept")
    nodes = tuple(n for n in spanned if n in policy.allowed)
    if len(nodes) < 2:
        return NumaPlan((), f"the cpuset allows node {format_cpu_list(list(policy.allowed))} only")
    return NumaPlan(nodes, "the nodes of the workers' CPUs")


def current_policy() -> MemPolicy | str:
    """This thread's memory policy and the nodes the cpuset allows, or why they could not be read."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return f"no NUMA syscalls known on {platform.machine() or 'this machine'}"
    mode, mask = ctypes.c_int(0), (ctypes.c_ulong * (_MAX_NODES // 64))()
    if _syscall(numbers["get_mempolicy"], ctypes.byref(mode), mask, ctypes.c_ulong(_MAX_NODES),
                ctypes.c_void_p(0), ctypes.c_ulong(0)) != 0:
        return os.strerror(ctypes.get_errno())
    nodes = tuple(n for n in range(_MAX_NODES) if mask[n // 64] >> (n % 64) & 1)
    return MemPolicy(mode.value, nodes, _mems_allowed())


def _mems_allowed(status: str = "/proc/self/status") -> tuple[int, ...]:
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("Mems_allowed_list:"):
                    return tuple(parse_cpu_list(line.split(":", 1)[1]))
    except OSError:
        pass
    return ()


class Interleaver:
    """Applies a plan to weights buffers (by address and size), counting what it placed; a failure is kept
    (and said in -v) rather than raised: placement is a speed matter, never worth a failed run."""

    def __init__(self, nodes: tuple[int, ...]) -> None:
        self.nodes, self.bytes, self.buffers, self.error = nodes, 0, 0, None
        self._mbind = _SYSCALLS.get(platform.machine(), {}).get("mbind")
        self._mask = (ctypes.c_ulong * (_MAX_NODES // 64))()
        for n in nodes:
            self._mask[n // 64] |= 1 << (n % 64)

    def __call__(self, address: int, nbytes: int) -> None:
        """Interleave the pages holding [address, address + nbytes) across the nodes."""
        if self.error is not None or nbytes <= 0:
            return
        start = address - address % mmap.PAGESIZE
        length = -(-(address + nbytes - start) // mmap.PAGESIZE) * mmap.PAGESIZE
        if self._mbind is None:
            self.error = f"no mbind syscall known on {platform.machine()}"
        elif _syscall(self._mbind, ctypes.c_void_p(start), ctypes.c_ulong(length), ctypes.c_int(MPOL_INTERLEAVE),
                      self._mask, ctypes.c_ulong(_MAX_NODES), ctypes.c_uint(MPOL_MF_MOVE)) != 0:
            code = ctypes.get_errno()
            self.error = f"mbind: {os.strerror(code)} ({errno.errorcode.get(code, code)})"
        else:
            self.bytes += nbytes
            self.buffers += 1

    def describe(self) -> str:
        """The -v line once the weights are loaded."""
        done = f"NUMA: {self.bytes / 2**20:.1f} MiB of host weights in {self.buffers} buffers interleaved"
        return done + (f"; then stopped: {self.error}" if self.error else "")


def _syscall(number: int, *args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(ctypes.c_long(number), *args)
