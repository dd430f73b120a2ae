"""Opening a model on devices: the options every front end passes (one LoadOptions), the plan, the
devices it names and the engine that runs the blocks where the plan put them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from jitllm.core.errors import JitllmError
from jitllm.core.heap import give_back_freed
from jitllm.core.jlm import JlmFile
from jitllm.ir.config import DEFAULT_KV_TYPE, KV_DTYPES
from jitllm.runtime.auto_timer import head_timer
from jitllm.runtime.backends import link_peers, make_device
from jitllm.runtime.backends.buffer_pool import pool_from_env
from jitllm.runtime.backends.host import HOST, host_device, placed_by_address, pool_size
from jitllm.runtime.device import Device
from jitllm.runtime.engine.executor import Executor
from jitllm.runtime.inventory import detect_cpu
from jitllm.runtime.engine.expert_cache import policy_from_env
from jitllm.runtime.engine.fast_start import FastStart, start_fast
from jitllm.runtime.model_layout import HEAD, ModelLayout
from jitllm.runtime.numa import Interleaver, current_policy, numa_plan
from jitllm.runtime.placement import Placement, PlacementOption, with_placement
from jitllm.runtime.planner import Plan, plan
from jitllm.runtime.workers import Workers, host_workers

if TYPE_CHECKING:
    from jitllm.runtime.device_spec import DeviceChoice

DEFAULT_CTX = 4096


@dataclass(frozen=True)
class LoadOptions:
    """How to open a model: the CLI's placement flags (`jitllm run -h`), as the API and the server take them.

    `extra_devices` attaches devices the planner does not use but moves may target (e.g. simulated devices
    standing in for missing hardware). `cpu_kernels` picks the host's kernel family: "fast" (int8-quantized
    activations, llama.cpp's trick) or "exact" (f32 activations); `gpu_kernels` the same for the GPUs'
    decode matvecs over quantized weights (jitllm.lowering.targets.cuda). `relocate`: when a device cannot
    grow the context, hand its last block to the host instead of failing. `gpu_grow`: start on the host and
    move one block per generated token to where the plan puts it. `tune_seam`: time a few seams while
    generating and keep the fastest (runtime/seam_tuning.py). `threads`: the host's CPU workers (None: one per
    physical performance core in the process's CPU mask, or TVM_NUM_THREADS; runtime/workers.py).
    `kv_type`: what the KV cache stores (f32, f16 or q8_0, as llama.cpp's -ctk/-ctv; f32 on devices whose
    target lacks it, TargetCaps.kv_types; q8_0 needs a head dim that is a multiple of 32).
    `fast_start`: host units whose artifacts the cache lacks start on ONNX Runtime and move to the host as
    their artifacts compile in the background (runtime/engine/fast_start.py; the caller polls it)."""

    devices: str = "auto"
    vram: str | None = None
    placement: PlacementOption | Placement | str | None = None
    gpu_layers: int | None = None
    ctx: int | None = None
    cache_dir: str | Path | None = None
    log: Callable[[str], None] | None = None
    no_gpu_fallback: bool = False
    extra_devices: tuple[Device, ...] = field(default=())
    cpu_kernels: str = "fast"
    gpu_kernels: str = "fast"
    relocate: bool = True
    gpu_grow: bool = False
    tune_seam: bool = False
    threads: int | None = None
    kv_type: str = DEFAULT_KV_TYPE
    fast_start: bool = False
    cluster: str | None = None
    """A Ray cluster to join (`host:port` or `auto`): its nodes' devices are `NODE/DEVICE` entries of
    `devices` (jitllm.runtime.cluster, docs/cluster.md)."""
    stream_experts: bool | None = None
    """MoE blocks placed on devices keep their routed experts in the file and upload a token's picks into
    each device's expert cache (runtime/engine/streaming.py); None: as JITLLM_GPU_STREAM says (0 or 1)."""


@dataclass
class Opened:
    """A model file opened on its devices: its plan, the devices by name, the engine, and (-gpu-grow) the
    moves still to make, one per generated token; (fast_start) the background compiles."""

    file: JlmFile
    layout: ModelLayout
    plan: Plan
    devices: dict[str, Device]
    executor: Executor
    grow_queue: list[tuple[int | str, str]]
    fast_start: FastStart | None = None


def open_model(file: JlmFile, layout: ModelLayout, options: LoadOptions) -> Opened:
    """For an opened .jlm and its (checked) layout: plan where each block runs, make the devices, upload
    weights and load (or compile) the artifacts."""
    from jitllm.runtime.device_spec import hardware_only, parse_devices

    if options.kv_type not in KV_DTYPES:
        raise JitllmError(f"KV cache type {options.kv_type!r} is not supported (supported: {', '.join(KV_DTYPES)})")
    layout = layout.with_kv_type(options.kv_type)
    workers = host_workers(options.threads)  # before any kernel starts this thread's pool (auto's timing runs one)
    log = options.log
    cache_dir = Path(options.cache_dir) if options.cache_dir else None
    host = host_device(options.cpu_kernels)
    interleaver = _numa(host, workers, log)
    choices, timer = [], None
    if options.devices.strip().lower() != "cpu":
        from jitllm.runtime.inventory import detect_inventory

        inventory = detect_inventory(software=not hardware_only(options.devices))
        timer = head_timer(file, layout, inventory, workers.count, options.cpu_kernels, options.gpu_kernels, host,
                           cache_dir, log)
        choices = parse_devices(options.devices, inventory, options.vram, timer=timer, remote=_remote(options.cluster))
        if log and (timer.seconds or options.devices.strip().lower() == "auto"):
            log(timer.describe(", ".join(c.name for c in choices) or "the CPU"))
    given = options.placement
    option = given if isinstance(given, PlacementOption) or given is None else with_placement(given)
    if option is not None:
        option.placement.validate(layout.config.num_blocks, {a for c in choices for a in c.aliases} | {HOST})
    block_bytes = [layout.unit_bytes(file, i) for i in range(layout.config.num_blocks)]
    stream_experts = gpu_stream() if options.stream_experts is None else options.stream_experts
    policy = policy_from_env() if stream_experts else "lru"
    if stream_experts and options.gpu_grow:
        raise JitllmError(f"{GPU_STREAM}=1 with -gpu-grow: moving blocks that stream their experts is not built")
    banks = [layout.expert_bank(file, i) for i in range(layout.config.num_blocks)] if stream_experts else None
    the_plan = plan(block_bytes, layout.unit_bytes(file, HEAD), choices, option.placement if option else None,
                    options.gpu_layers, option.strict if option else False, host_name=HOST, banks=banks)
    if log:
        log(the_plan.describe())
        log(workers.describe(pool_size()))
    devices: dict[str, Device] = {HOST: host}
    for choice in choices:
        devices[choice.name] = make_device(choice, options.cpu_kernels, options.gpu_kernels)
    share_budgets(choices, devices)
    for extra in options.extra_devices:
        devices[extra.name.lower()] = extra
    _share_host_memory(devices)
    linked = link_peers(list(devices.values()))
    if log and linked is not None:
        log("peer access: " + (", ".join(f"{a} -> {b}" for a, b in linked)
                               or "none (copies between cards go through the host)"))
    where = {i: devices[the_plan.device_of(i)] for i in range(layout.config.num_blocks)}
    where[HEAD] = devices[the_plan.head.device]
    grow: list[tuple[int | str, str]] = []
    if options.gpu_grow:
        for index, assignment in [*enumerate(the_plan.blocks), (HEAD, the_plan.head)]:
            if assignment.device != HOST and not assignment.pinned:
                grow.append((index, assignment.device + ("~" if assignment.streamed else "")))
                where[index] = devices[HOST]
    context = min(options.ctx or DEFAULT_CTX, layout.config.context)
    if context < 1:
        raise JitllmError(f"context must be at least 1 token (got {options.ctx})")
    fast = None
    if options.fast_start:
        fast = start_fast(layout, where, devices[HOST], devices.get("ort"), cache_dir, workers.count, log)
        if fast is not None:
            devices.setdefault(fast.away.name, fast.away)
    streamed = frozenset(i for i, a in enumerate(the_plan.blocks) if a.streamed and where[i].name != HOST)
    banked = frozenset(i for i in the_plan.banked if where[i].name != HOST)
    slots = {b.name: b.expert_slots for b in the_plan.budgets if b.expert_slots}
    try:
        executor = Executor(file, layout, where, context, cache_dir=cache_dir, log=log, streamed=streamed,
                            banked=banked, expert_slots=slots, expert_policy=policy)
    except BaseException:
        if fast is not None:
            fast.close()
        raise
    if fast is not None:
        fast.executor = executor
    if log and interleaver is not None:
        log(interleaver.describe())
    give_back_freed()  # (the load's temporaries: the tokenizer's parse, the weights' staging)
    return Opened(file, layout, the_plan, devices, executor, grow, fast)


GPU_STREAM = "JITLLM_GPU_STREAM"


def gpu_stream() -> bool:
    """Whether JITLLM_GPU_STREAM asks for expert streaming (1; 0 or unset: not); a one-line error otherwise."""
    value = os.environ.get(GPU_STREAM, "0") or "0"
    if value not in ("0", "1"):
        raise JitllmError(f"{GPU_STREAM}={value!r}: must be 0 or 1")
    return value == "1"


def _numa(host: Device, workers: Workers, log: Callable[[str], None] | None) -> Interleaver | None:
    """The host's weights interleaved across the workers' NUMA nodes where runtime/numa.py says so (its
    Interleaver, to report what it did), else None."""
    the_plan = numa_plan(detect_cpu().numa_nodes, workers.cpus, os.environ, current_policy())
    if log:
        log(the_plan.describe())
    if not the_plan.nodes:
        return None
    interleaver = Interleaver(the_plan.nodes)
    host.place_weights = placed_by_address(interleaver)
    return interleaver


def _remote(address: str | None):
    """How NODE/DEVICE entries are resolved: on the cluster at `address`, joined here (None: no cluster)."""
    if address is None:
        return None
    from jitllm.runtime.cluster.connection import connect
    from jitllm.runtime.cluster.nodes import remote_device

    cluster = connect(address)
    return lambda spec, entry: remote_device(cluster, spec, entry)


def share_budgets(choices: list[DeviceChoice], devices: dict[str, Device]) -> None:
    """Make the views of one card named through two APIs twins: one budget charged by both."""
    for choice in choices:
        if choice.shares_budget_of is not None:
            view, lead = devices[choice.name], devices[choice.shares_budget_of]
            for other in (lead, *lead.twins):
                other.twins.append(view)
                view.twins.append(other)


def _share_host_memory(devices: dict[str, Device]) -> None:
    """Where a device copies fastest from page-locked host memory, the host's memory becomes that, and
    weights leaving the host are kept for the next to arrive."""
    host = devices[HOST]
    host.allocator = next((d.host_allocator for d in devices.values() if d.host_allocator is not None), None)
    if host.allocator is not None:
        host.weight_pool = pool_from_env()
