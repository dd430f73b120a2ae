"""Simulated devices and fault injection: the reference backend for what the hardware here lacks.

A simulated device (`sim:N`) computes on the host, in host memory, with the host's kernels, but has a
name, a budget and a page pool of its own, so placement, moves, relocation and fallback run through
the same code they take between real devices. `-devices sim:N[=SIZE]` names them where
JITLLM_SIM_DEVICES=1 (tests and demos; a server process too).

Fault injection (`Faults`, `with_faults`) wraps any device's backend and step recorder, so a test
can fail its next allocation or its next launch (a program call, or a captured step's replay) the way
hardware fails; production devices carry no such switches. `ReplayRecorder` stands in for CUDA graphs:
it records the calls of a step with their tensors and replays them writing results back into the
captured outputs, which is what fixed addresses do, so the capture and invalidation logic runs here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

import numpy as np
import tvm

from jitllm.core.errors import JitllmError
from jitllm.ir.config import BlockKind
from jitllm.lowering.targets.llvm import LlvmTarget
from jitllm.runtime.backends.base import Backend, BackendCaps, Layout, Tensor
from jitllm.runtime.backends.tvm_tensors import HOST_ALLOCATOR, TvmBackend
from jitllm.runtime.device import Device
from jitllm.runtime.program import Program

CAPS = BackendCaps("tvm", unified_memory=True, captured_steps=True)
ENABLE = "JITLLM_SIM_DEVICES"
"""Set to 1 to let -devices name simulated devices."""


def simulated_device(name: str, budget_bytes: int | None = None, kernels: str = "exact",
                     graphs: bool = False) -> Device:
    """A device of its own accounting that computes on the host with the `kernels` family; `graphs`:
    its decode steps are captured and replayed (ReplayRecorder, whose replays call the programs again, so
    an injected launch fault reaches them too). Faults can be injected (`.backend.faults`)."""
    device = with_faults(Device(name, TvmBackend("sim", tvm.cpu(0), CAPS, HOST_ALLOCATOR), LlvmTarget(kernels), budget_bytes))
    device.graphs = ReplayRecorder() if graphs else None
    return device


def make_device(choice, cpu_kernels: str, gpu_kernels: str) -> Device:
    """The registry's constructor for `-devices sim:N[=SIZE]`: the host's kernel family, captured steps."""
    if os.environ.get(ENABLE) != "1":
        raise JitllmError(f"{choice.name}: simulated devices are for testing; set {ENABLE}=1 to use them")
    return simulated_device(choice.name, choice.budget_bytes, cpu_kernels, graphs=True)


@dataclass
class Faults:
    """Switches a test flips: the next allocation, or the next launch, fails as the hardware's would."""

    alloc: bool = False
    launch: bool = False

    def check_alloc(self) -> None:
        if self.alloc:
            self.alloc = False
            raise RuntimeError("out of memory (injected fault)")

    def check_launch(self) -> None:
        if self.launch:
            self.launch = False
            raise RuntimeError("kernel launch failed (injected fault)")


def with_faults(device: Device) -> Device:
    """`device` with its backend (and recorder) wrapped for fault injection; do it before anything is
    loaded on it (programs and captured steps made earlier are not wrapped)."""
    faults = Faults()
    device.backend = FaultyBackend(device.backend, faults)
    if device.graphs is not None:
        device.graphs = FaultyRecorder(device.graphs, faults)
    return device


class FaultyBackend:
    """Another backend, whose allocations and programs' calls fail when `faults` says."""

    def __init__(self, inner: Backend, faults: Faults) -> None:
        self.inner, self.faults = inner, faults
        self.name, self.caps = inner.name, inner.caps

    @property
    def tvm_device(self) -> tvm.runtime.Device:
        return self.inner.tvm_device

    def empty(self, shape: tuple[int, ...], dtype: str) -> Tensor:
        self.faults.check_alloc()
        return self.inner.empty(shape, dtype)

    def upload(self, array: np.ndarray) -> Tensor:
        self.faults.check_alloc()
        return self.inner.upload(array)

    def download(self, tensor: Tensor) -> np.ndarray:
        return self.inner.download(tensor)

    def write(self, tensor: Tensor, array: np.ndarray) -> None:
        self.inner.write(tensor, array)

    def copy(self, dst: Tensor, src: Tensor) -> None:
        self.inner.copy(dst, src)

    def receive(self, tensor: Tensor) -> Tensor:
        return self.inner.receive(tensor)

    def region(self, buffer: Tensor, shape: tuple[int, ...], dtype: str, offset: int) -> Tensor:
        return self.inner.region(buffer, shape, dtype, offset)

    def aliases(self, buffer: Tensor, layout: Layout) -> list[Tensor]:
        return self.inner.aliases(buffer, layout)

    def last_rows(self, hidden: Tensor) -> Tensor:
        return self.inner.last_rows(hidden)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def copy_queue(self):
        return self.inner.copy_queue()

    def load(self, path: Path, kind: BlockKind, page_kernels: bool) -> Program:
        program = self.inner.load(path, kind, page_kernels)
        return replace(program, **{f.name: self._launching(getattr(program, f.name)) for f in fields(program)})

    def _launching(self, fn: Callable | None) -> Callable | None:
        if fn is None:
            return None

        def launch(*args):
            self.faults.check_launch()
            return fn(*args)

        return launch


class FaultyRecorder:
    """Another step recorder, whose captured steps fail to launch when `faults` says."""

    def __init__(self, inner, faults: Faults) -> None:
        self.inner, self.faults = inner, faults

    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return self.inner.host_array(shape, dtype)

    def copy_in(self, tensor: Tensor, array: np.ndarray) -> None:
        self.inner.copy_in(tensor, array)

    def copy_out(self, array: np.ndarray, tensor: Tensor) -> None:
        self.inner.copy_out(array, tensor)

    def fence(self):
        return self.inner.fence()

    @property
    def captures(self) -> int:
        return self.inner.captures

    def capture(self, body: Callable[[Callable], object]):
        graph, output = self.inner.capture(body)
        return _FaultyGraph(graph, self.faults), output


class _FaultyGraph:
    def __init__(self, graph, faults: Faults) -> None:
        self.graph, self.faults = graph, faults

    def replay(self) -> None:
        self.faults.check_launch()
        self.graph.replay()

    def launch(self) -> None:
        self.faults.check_launch()
        self.graph.launch()


class ReplayRecorder:
    """Host stand-in for CUDA graphs (see the module docstring); its host arrays are plain numpy."""

    def __init__(self) -> None:
        self.captures = 0

    def host_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype)

    def copy_in(self, tensor: tvm.runtime.Tensor, array: np.ndarray) -> None:
        tensor.copyfrom(array)

    def copy_out(self, array: np.ndarray, tensor: tvm.runtime.Tensor) -> None:
        array[...] = tensor.numpy()

    def fence(self) -> "_Done":
        return _Done()

    def capture(self, body: Callable[[Callable], object]) -> tuple["_Replay", object]:
        calls: list[tuple[Callable, tuple, object]] = []

        def call(fn: Callable, *args):
            out = fn(*args)
            calls.append((fn, args, out))
            return out

        output = body(call)
        self.captures += 1
        return _Replay(calls), output


class _Done:
    """The host stand-in's fence: its replays run as they are launched."""

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass


class _Replay:
    def __init__(self, calls: list[tuple[Callable, tuple, object]]) -> None:
        self.calls = calls

    def launch(self) -> None:
        self.replay()

    def replay(self) -> None:
        for fn, args, captured in self.calls:
            fresh = fn(*args)
            for old, new in zip(_tensors(captured), _tensors(fresh)):
                old.copyfrom(new)


def _tensors(value) -> list:
    if value is None:
        return []
    if isinstance(value, tvm.runtime.Tensor):
        return [value]
    return list(value)
