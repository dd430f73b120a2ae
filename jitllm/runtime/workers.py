"""How many CPU workers decode runs with: one per physical performance core in the process's CPU mask
(hyperthread siblings and efficiency cores left alone: each extra worker is one more straggler behind every
barrier), unless `-threads N` or TVM_NUM_THREADS says otherwise.

TVM reads TVM_NUM_THREADS when a thread first launches a parallel kernel (its pool is per thread and keeps
its size), so the count is put in the environment before any kernel runs; ONNX Runtime's intra-op pool
takes the same count. No artifact depends on it (kernels/cpu/avx2.py reads the pool size at run time).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from jitllm.core.errors import JitllmError
from jitllm.runtime.inventory import CpuInfo, detect_cpu, format_cpu_list

ENV = "TVM_NUM_THREADS"
BIND_ENV = "TVM_BIND_THREADS"


@dataclass(frozen=True)
class Workers:
    """The worker count, the CPUs the workers are meant for, and what decided it."""

    count: int
    cpus: tuple[int, ...]
    """Where they may run: the mask's performance cores (and the spare CPUs a larger explicit count takes)."""
    source: str
    """"-threads", ENV or "performance cores"."""
    left_alone: tuple[int, ...] = ()
    """CPUs of the mask no worker is meant for (siblings, efficiency cores)."""

    def describe(self, pool: int) -> str:
        """The -v line; `pool`: the size TVM's pool of this thread has (TVM caps it at the machine's CPUs,
        and a pool that started before keeps its size)."""
        why = {"-threads": "-threads", ENV: ENV,
               "performance cores": "one per physical performance core in the CPU mask"}[self.source]
        alone = f"; left alone: {format_cpu_list(list(self.left_alone))}" if self.left_alone else ""
        got = "" if pool == self.count else f"; TVM's pool runs {pool}"
        return f"CPU workers: {self.count} ({why}; on CPUs {format_cpu_list(list(self.cpus))}{alone}{got})"


def parse_count(text: str, what: str) -> int:
    """A worker count a user wrote (a positive whole number), or a JitllmError naming `what`."""
    if not re.fullmatch(r"\s*[0-9]+\s*", text) or int(text) < 1:
        raise JitllmError(f"{what}={text!r}: expected a positive whole number of CPU workers")
    return int(text)


def choose_workers(cpu: CpuInfo, requested: int | None = None, environ: Mapping[str, str] = os.environ
                   ) -> Workers:
    """The workers for this CPU: `requested` (-threads) first, then ENV, then the performance cores.

    They may run on every performance core of the mask; an explicit count above that many also takes
    hyperthread siblings, then efficiency cores, one per extra worker. A mask without performance cores
    counts its efficiency cores instead."""
    cores = cpu.performance_cores or cpu.efficiency_cores or cpu.cpu_mask
    if requested is not None:
        if requested < 1:
            raise JitllmError(f"-threads {requested}: expected a positive whole number of CPU workers")
        count, source = requested, "-threads"
    elif environ.get(ENV, "").strip():  # (an empty value is as good as unset)
        count, source = parse_count(environ[ENV], ENV), ENV
    else:
        count, source = max(1, len(cores)), "performance cores"
    spare = [c for c in cpu.hyperthread_siblings + cpu.efficiency_cores if c in cpu.cpu_mask and c not in cores]
    cpus = tuple(cores + spare[:max(0, count - len(cores))])
    return Workers(count, cpus, source, tuple(c for c in cpu.cpu_mask if c not in cpus))


def apply_workers(workers: Workers, environ: MutableMapping[str, str] = os.environ,
                  set_affinity: Callable[[int, set[int]], None] = os.sched_setaffinity) -> None:
    """Size the thread pools that start from now on and keep them on the workers' CPUs.

    TVM's default binding pins worker i to CPU i of the whole machine, ignoring the process mask (under
    `taskset -c 0` its second worker ran on CPU 1); with BIND_ENV=0 its threads inherit the mask of the thread
    that starts them (a user's own BIND_ENV is kept). Where the mask holds CPUs no worker is meant for, the
    calling thread is narrowed to the workers' CPUs, so the pools and threads it starts stay off them."""
    environ[ENV] = str(workers.count)
    environ.setdefault(BIND_ENV, "0")
    if workers.left_alone:
        set_affinity(0, set(workers.cpus))


_chosen: Workers | None = None


def host_workers(requested: int | None = None) -> Workers:
    """The process's workers: chosen and applied on the first call (or when a later call asks for another
    count, for the pools that start after it); later calls without a request return the same."""
    global _chosen
    if _chosen is None or (requested is not None and requested != _chosen.count):
        _chosen = choose_workers(detect_cpu(), requested)
        apply_workers(_chosen)
    return _chosen
