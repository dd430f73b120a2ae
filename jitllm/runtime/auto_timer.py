"""How `-devices auto` picks its device: one real decode kernel of the model, timed on each candidate (every
GPU auto may pick, and the CPU), the fastest winning, so that a slow integrated GPU loses to the CPU
(docs/placement.md). The kernel is the head's decode program (the final norm and the model's largest
matvec, vocab x hidden, in the file's weight type) compiled through each device's own target (from the
artifact cache, compiled once where it lacks it), run over the file's own head weights for a quarter of a
second at most. Timings are kept per machine (runtime/timing_cache.py), so later runs time nothing."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import jitllm
from jitllm.core.jlm import JlmFile
from jitllm.lowering.cache import load_artifact
from jitllm.lowering.target import kind_for_target
from jitllm.runtime.backends import make_device
from jitllm.runtime.device import Device
from jitllm.runtime.device_spec import DeviceChoice, default_budget
from jitllm.runtime.engine.packed_weights import PackedWeights
from jitllm.runtime.inventory import GpuDevice, Inventory
from jitllm.runtime.model_layout import HEAD, ModelLayout
from jitllm.runtime.timing_cache import read_timings, timing_path, write_timings

CPU = "cpu"
MEASURE_SECONDS = 0.25
"""How long one device's kernel is run for (after a first call), at most."""
ROUND = 4
"""Calls per timed round (the device is synchronized after each round)."""

Measure = Callable[[GpuDevice | None], float]


class AutoTimer:
    """The device_spec.Timer of a run: seconds per call of the kernel on a device (None: the CPU), from the
    machine's cache or measured now (`measure`) and added to it. Failures to measure a device count as
    infinitely slow (it is not picked) and are said in -v, never raised."""

    def __init__(self, measure: Measure, material: dict, path: Path, kernel: str, left_out: tuple[str, ...] = ()
                 ) -> None:
        """`left_out`: the GPUs auto never picks, each with why (said where nothing was timed)."""
        self.measure, self.material, self.path, self.kernel, self.left_out = measure, material, path, kernel, left_out
        self.cached, self.problem = read_timings(path, material)
        self.seconds: dict[str, float] = {}
        self.measured: list[str] = []
        self.errors: dict[str, str] = {}
        self.unwritten: str | None = None
        """Why the timings measured now could not be kept (None: they were, or nothing was measured)."""

    def __call__(self, device: GpuDevice | None) -> float:
        name = CPU if device is None else device.spec_name
        if name not in self.seconds:
            if name in self.cached:
                self.seconds[name] = self.cached[name]
            else:
                try:
                    self.seconds[name] = self.measure(device)
                except Exception as e:  # (compilers and drivers raise their own types: the device just loses)
                    self.seconds[name] = math.inf
                    self.errors[name] = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.measured.append(name)
                self.unwritten = write_timings(self.path, self.material, {**self.cached, **self.seconds})
        return self.seconds[name]

    def describe(self, picked: str) -> str:
        """The -v line: each device's time per call, where the figures came from, and the pick."""
        if not self.seconds:
            why = f" ({'; '.join(self.left_out)})" if self.left_out else ""
            return f"auto: no GPU here that auto may pick{why}, nothing timed -> {picked}"
        times = ", ".join(f"{n} {_ms(s)}" + (f" ({self.errors[n]})" if n in self.errors else "")
                          for n, s in sorted(self.seconds.items(), key=lambda t: t[1]))
        kept = self.unwritten or f"kept in {self.path}"
        source = f"measured now: {', '.join(self.measured)}; {kept}" if self.measured else f"from {self.path}"
        note = f"; {self.problem}" if self.problem else ""
        return f"auto: {self.kernel} per call: {times} ({source}{note}) -> {picked}"


def _ms(seconds: float) -> str:
    return "failed" if math.isinf(seconds) else f"{seconds * 1e3:.3f} ms"


def head_timer(file: JlmFile, layout: ModelLayout, inventory: Inventory, workers: int, cpu_kernels: str,
               gpu_kernels: str, host: Device, cache_dir: Path | None, log: Callable[[str], None] | None,
               root: Path | None = None) -> AutoTimer:
    """The timer of the model's head decode kernel on this machine's devices (`host`: the CPU's device;
    `root`: the timing cache's folder, default the jitllm home's)."""
    (spec,) = layout.head.linears[:1]
    kernel = f"head decode kernel ({spec.out_features}x{spec.in_features} {spec.wtype})"
    material = json.loads(json.dumps({
        "jitllm": jitllm.__version__, "kernel": repr(layout.head.linears), "families": [cpu_kernels, gpu_kernels],
        "cpu": [inventory.cpu.model, inventory.cpu.features, inventory.cpu.cpu_mask, workers],
        "devices": [[v.spec_name, v.name, v.uuid, v.pci_bus, v.total_bytes] for v in inventory.views()]}))

    def measure(device: GpuDevice | None) -> float:
        return head_seconds(host if device is None else _device(device, cpu_kernels, gpu_kernels), file,
                            layout, cache_dir, log)

    left_out = tuple(f"{g.spec_name} {g.name}: " + ("a software adapter" if g.software else g.unusable)
                     for g in inventory.gpus if g.software or g.unusable is not None)
    return AutoTimer(measure, material, timing_path(material, root), kernel, left_out)


def _device(gpu: GpuDevice, cpu_kernels: str, gpu_kernels: str) -> Device:
    choice = DeviceChoice(gpu, gpu.spec_name, default_budget(gpu.free_bytes), False, frozenset({gpu.spec_name}))
    return make_device(choice, cpu_kernels, gpu_kernels)


def head_seconds(device: Device, file: JlmFile, layout: ModelLayout, cache_dir: Path | None = None,
                 log: Callable[[str], None] | None = None, budget: float = MEASURE_SECONDS) -> float:
    """Seconds per call of the head's decode program on `device` over the file's head weights: the fastest
    round of ROUND calls (each round ended by a synchronize) within `budget` seconds after a first call."""
    kind = kind_for_target(layout.head, device.target)
    if device.target.caps.decode_variants:
        kind = kind.decode_variant()
    program = load_artifact(kind, device.target, lambda path: device.load(path, kind, False), cache_dir, log=log)
    groups = layout.weight_sources(HEAD, kind)
    weights = PackedWeights.upload(device, [[file.tensor(n) for n in group] for group in groups])
    file.release_pages(n for group in groups for n in group)
    x = device.upload(np.random.default_rng(0).standard_normal((1, 1, layout.config.hidden), np.float32))
    program.main(x, *weights)
    device.synchronize()
    best, end = math.inf, time.perf_counter() + budget
    while time.perf_counter() < end:
        start = time.perf_counter()
        for _ in range(ROUND):
            program.main(x, *weights)
        device.synchronize()
        best = min(best, (time.perf_counter() - start) / ROUND)
    return best
