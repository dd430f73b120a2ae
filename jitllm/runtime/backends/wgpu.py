"""Vulkan (`-devices vulkan[:SEL]`) and Metal (`-devices metal`) devices through wgpu: tensors are wgpu
storage buffers (a view is a buffer, a byte offset and a shape), artifacts are the webgpu target's kernel
packages, run by backends/wgpu_plan.py.

Work is encoded, not submitted, as it comes: consecutive dispatches share one compute pass, buffer copies
end the pass and stay in the same command encoder, and the encoder is submitted when the host needs the
queue (a write, which the queue would otherwise run before the unsubmitted work, or a read), waits for it,
or has encoded SUBMIT_EVERY dispatches since the last submit (so the device starts on a long step's first
blocks while the host encodes the rest). A read copies into a mappable buffer kept for it, in the same
encoder, and maps that: a decode step (its inputs written first, its token read last) is one submit per
SUBMIT_EVERY dispatches and one small map, creating nothing.

Replayed dispatches are encoded through wgpu-native's C functions directly (`_RawPass`): wgpu-py wraps
every call in Python error capture (and set_bind_group allocates): ~6 us a dispatch on the H200's host
(DESIGN.md §3), 4.1-4.3 us on the development machine against 1.2-1.7 us raw; an invalid command still
fails the encoder's `finish`, which goes through wgpu-py. Decode steps are captured and replayed as one
list (wgpu_graph.py). Metal goes through the same code; it has not been run (no Mac here).
"""

from __future__ import annotations

import json
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.config import BlockKind
from jitllm.lowering import (
    APPEND_FUNCTION,
    ARGMAX_FUNCTION,
    EMBED_FUNCTION,
    EXPORT_PAGES,
    IMPORT_PAGES,
    KERNEL_PACKAGE_FORMAT,
)
from jitllm.lowering.targets.webgpu import WebGpuTarget
from jitllm.runtime.backends.base import BackendCaps, Layout
from jitllm.runtime.backends.wgpu_adapters import open_adapter
from jitllm.runtime.backends.wgpu_graph import COPY, ENCODE, WgpuRecorder
from jitllm.runtime.backends.wgpu_plan import Dispatch, HostFunction, Kernels, RelaxProgram
from jitllm.runtime.device import Device
from jitllm.runtime.program import Program

CAPS = BackendCaps("wgpu", captured_steps=True)
UNIFIED_CAPS = BackendCaps("wgpu", unified_memory=True, captured_steps=True)


def make_device(choice, cpu_kernels: str, gpu_kernels: str) -> Device:
    """The registry's constructor. The webgpu target has one kernel family (exact), whatever -gpu-kernels says."""
    backend = WgpuBackend(choice.device.backend, choice.device.ordinal, choice.name, choice.device.unified)
    device = Device(choice.name, backend, WebGpuTarget(), choice.budget_bytes)
    device.graphs = WgpuRecorder(backend)
    return device


@dataclass(frozen=True, eq=False)
class WgpuTensor:
    """`shape` of `dtype` at byte `offset` of a wgpu buffer (of `backend`'s device)."""

    buffer: object
    offset: int
    shape: tuple[int, ...]
    dtype: str
    backend: "WgpuBackend"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def key(self) -> tuple:
        """What a recording of a call over this tensor depends on (wgpu_plan): the buffer's uid, which wgpu
        never reuses (an `id()` of a freed buffer can come back on a new one and replay a stale binding)."""
        return self.buffer.uid, self.offset, self.shape

    def view(self, shape: tuple[int, ...], dtype: str, offset: int) -> "WgpuTensor":
        return WgpuTensor(self.buffer, self.offset + offset, tuple(int(d) for d in shape), dtype, self.backend)


PIPELINE_THREADS = 8
"""Pipelines created at once when a package loads (WgpuBackend.pipelines)."""
SUBMIT_EVERY = 64
"""Dispatches encoded between submits: a decode step of SmolLM2's 30 blocks (153 dispatches) is three
submits, the first starting the device while the host still encodes (a submit costs ~60 us on the H200's
host, DESIGN.md §3; encoding 64 dispatches more than that)."""


class _RawPass:
    """set_pipeline / set_bind_group / dispatch of a compute pass through wgpu-native's C functions (see
    the module docstring); None where this wgpu has not the names (then wgpu-py's own methods are used)."""

    def __init__(self, compute) -> None:
        from wgpu.backends.wgpu_native._ffi import ffi, lib

        self.handle, self.null = compute._internal, ffi.NULL
        self.set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        self.set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
        self.dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups

    @classmethod
    def of(cls, compute) -> "_RawPass | None":
        try:
            return cls(compute)
        except (ImportError, AttributeError):
            return None

    def encode(self, dispatches: list) -> None:
        handle, null = self.handle, self.null
        set_pipeline, set_bind_group, dispatch = self.set_pipeline, self.set_bind_group, self.dispatch
        for d in dispatches:
            set_pipeline(handle, d.pipeline._internal)
            set_bind_group(handle, 0, d.bind_group._internal, 0, null)
            dispatch(handle, *d.groups)


def _padded(n: int, to: int = 4) -> int:
    return max(to, -(-n // to) * to)


class WgpuBackend:
    """One wgpu adapter's device (Vulkan or Metal)."""

    name = "wgpu"

    def __init__(self, api: str, ordinal: int, device_name: str, unified: bool) -> None:
        import wgpu

        self.wgpu = wgpu
        self.caps = UNIFIED_CAPS if unified else CAPS
        self.adapter, self.device = open_adapter(api, ordinal, device_name)
        self.device_name = device_name
        self.alignment = int(self.device.limits["min-storage-buffer-offset-alignment"])
        self.usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.mappable = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        self._pipelines: dict[tuple[str, str], object] = {}
        self._encoder = None
        self._pass = None
        self._raw = None
        self._unsubmitted = 0
        self._readback = None
        self._fence = None
        self._staging: dict[int, object] = {}
        self._reads: list[tuple[np.ndarray, object, int]] = []
        self.capturing: Callable[..., None] | None = None
        """While a step is captured (wgpu_graph.WgpuRecorder): takes the dispatches and copies instead of
        encoding them."""
        self.timer = None
        """While a run is profiled (wgpu_profile.py): encodes every dispatch instead, timing each."""
        self.stats = {"dispatches": 0, "submits": 0, "pipelines": 0, "pipeline_seconds": 0.0, "bind_groups": 0,
                      "encode_seconds": 0.0, "buffers": 0, "writes": 0, "write_seconds": 0.0, "reads": 0,
                      "read_seconds": 0.0, "wait_seconds": 0.0, "submit_seconds": 0.0}
        """Counters: dispatches encoded (and the host seconds that took), submits (and their seconds),
        pipelines created (and the seconds that took), bind groups made, buffers created, queue writes (and
        their seconds), reads (and their seconds, waiting for the device included; the map's wait alone)."""

    # -- memory ----------------------------------------------------------------------------------
    def _buffer(self, nbytes: int, usage=None):
        self.stats["buffers"] += 1
        return self.device.create_buffer(size=_padded(nbytes, 16), usage=self.usage if usage is None else usage)

    def empty(self, shape: tuple[int, ...], dtype: str) -> WgpuTensor:
        """Zeroed (WebGPU clears new buffers): the attention reads every page a table lists."""
        shape = tuple(int(d) for d in shape)
        return WgpuTensor(self._buffer(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize), 0, shape,
                          str(np.dtype(dtype)), self)

    def upload(self, array: np.ndarray) -> WgpuTensor:
        tensor = self.empty(array.shape, str(array.dtype))
        self.write(tensor, array)
        return tensor

    def download(self, tensor: WgpuTensor) -> np.ndarray:
        start = tensor.offset - tensor.offset % 4
        data = self._read(tensor.buffer, start, _padded(tensor.offset - start + tensor.nbytes))
        raw = np.frombuffer(data, np.uint8)[tensor.offset - start:tensor.offset - start + tensor.nbytes]
        return raw.view(tensor.dtype).reshape(tensor.shape).copy()

    def _read(self, buffer, offset: int, size: int):
        """`size` bytes at `offset` (both multiples of 4) of `buffer` after all work encoded so far: copied
        into the mappable buffer kept for reads (grown to the largest read), in the pending encoder, which
        is then submitted, and that buffer mapped (the wait for the device)."""
        start = time.perf_counter()
        if self._readback is None or self._readback.size < size:
            if self._readback is not None:
                self._readback.destroy()
            self._readback = self._buffer(max(size, 256), self.mappable)
        self._end_pass()
        self._encoding().copy_buffer_to_buffer(buffer, offset, self._readback, 0, size)
        self.flush()
        data = self._mapped(self._readback, size)
        self.stats["reads"] += 1
        self.stats["read_seconds"] += time.perf_counter() - start
        return data

    def read_later(self, array: np.ndarray, tensor: WgpuTensor) -> None:
        """Encode a copy of `tensor` into a mappable buffer kept for `array`; the array is filled by
        `finish_reads` of the reads `take_reads` hands out (after the submit)."""
        if tensor.offset % 4 or tensor.nbytes % 4:
            array[...] = self.download(tensor)
            return
        buffer = self._staging.get(id(array))
        if buffer is None:  # (kept while the array lives: a session's host arrays go with it)
            buffer = self._staging[id(array)] = self._buffer(max(tensor.nbytes, 256), self.mappable)
            weakref.finalize(array, self._staging.pop, id(array), None)
        self._end_pass()
        self._encoding().copy_buffer_to_buffer(tensor.buffer, tensor.offset, buffer, 0, tensor.nbytes)
        self._reads.append((array, buffer, tensor.nbytes))

    def take_reads(self) -> list[tuple[np.ndarray, object, int]]:
        reads, self._reads = self._reads, []
        return reads

    def finish_reads(self, reads: list[tuple[np.ndarray, object, int]]) -> None:
        """Map each read's buffer (waiting for the submit that copied into it) into its array."""
        for array, buffer, nbytes in reads:
            start = time.perf_counter()
            array.reshape(-1).view(np.uint8)[:] = np.frombuffer(self._mapped(buffer, nbytes), np.uint8)
            self.stats["reads"] += 1
            self.stats["read_seconds"] += time.perf_counter() - start

    def _mapped(self, buffer, nbytes: int):
        """The first `nbytes` of the mappable `buffer` once the device has written them (the map waits for
        the submit that copied into it; that wait is counted apart)."""
        waiting = time.perf_counter()
        buffer.map_sync(self.wgpu.MapMode.READ, 0, _padded(nbytes, 8))
        self.stats["wait_seconds"] += time.perf_counter() - waiting
        try:
            return buffer.read_mapped(0, nbytes, copy=True)
        finally:
            buffer.unmap()

    def write(self, tensor: WgpuTensor, array: np.ndarray) -> None:
        """Pending work is submitted first: the queue runs a write before anything submitted after it."""
        data = np.ascontiguousarray(array, dtype=tensor.dtype).reshape(-1).view(np.uint8)
        if data.nbytes != tensor.nbytes:
            raise JitllmError(f"{self.device_name}: {data.nbytes} bytes written into a {tensor.nbytes}-byte tensor")
        self.flush()
        start = time.perf_counter()
        if tensor.offset % 4 or data.nbytes % 4:  # (the queue writes whole words: merge with the bytes around)
            begin = tensor.offset - tensor.offset % 4
            end = _padded(tensor.offset + data.nbytes)
            around = np.frombuffer(self._read(tensor.buffer, begin, end - begin), np.uint8).copy()
            around[tensor.offset - begin:tensor.offset - begin + data.nbytes] = data
            self.device.queue.write_buffer(tensor.buffer, begin, around)
        else:
            self.device.queue.write_buffer(tensor.buffer, tensor.offset, data)
        self.stats["writes"] += 1
        self.stats["write_seconds"] += time.perf_counter() - start

    def copy(self, dst: WgpuTensor, src: WgpuTensor) -> None:
        """Within this device by a copy command; from another wgpu device through the host."""
        if src.backend is not self:
            self.write(dst, src.backend.download(src))
            return
        if dst.nbytes != src.nbytes:
            raise JitllmError(f"{self.device_name}: copy of {src.nbytes} bytes into {dst.nbytes}")
        if src.offset % 4 or dst.offset % 4 or src.nbytes % 4:
            self.write(dst, self.download(src))
            return
        if self.capturing is not None:
            self.capturing(COPY, dst, src)
            return
        self._end_pass()
        self._encoding().copy_buffer_to_buffer(src.buffer, src.offset, dst.buffer, dst.offset, src.nbytes)

    def receive(self, tensor: WgpuTensor) -> WgpuTensor:
        if tensor.backend is self:
            return tensor
        return self.upload(tensor.backend.download(tensor))

    def region(self, buffer: WgpuTensor, shape: tuple[int, ...], dtype: str, offset: int) -> WgpuTensor:
        return buffer.view(shape, dtype, offset)

    def aliases(self, buffer: WgpuTensor, layout: Layout) -> list[WgpuTensor]:
        return [buffer.view(shape, dtype, offset) for shape, dtype, offset in layout]

    def last_rows(self, hidden: WgpuTensor) -> WgpuTensor:
        batch, seq, width = hidden.shape
        out = self.empty((batch, 1, width), "float32")
        row = width * 4
        for b in range(batch):
            self.copy(out.view((1, 1, width), "float32", b * row),
                      hidden.view((1, 1, width), "float32", (b * seq + seq - 1) * row))
        return out

    def synchronize(self) -> None:
        """Submit, then wait by reading a word (a read maps after all submitted work; wgpu 0.32's
        on_submitted_work_done_sync fails on its own callback's signature)."""
        if self._fence is None:
            self._fence = self._buffer(4)
        self._read(self._fence, 0, 4)  # (a map waits for the last submit using the buffer, so copy into it)

    def constant(self, binding: dict) -> WgpuTensor:
        """A Relax constant of a package, uploaded once."""
        return self.upload(np.asarray(binding["values"], binding["dtype"]).reshape(binding["shape"]))

    # -- kernels ---------------------------------------------------------------------------------
    def pipelines(self, kernels: dict[str, str]) -> dict[str, object]:
        """The compute pipelines of kernels (name -> WGSL), created once per device: those not made yet in
        parallel, PIPELINE_THREADS at a time (wgpu-native leaves createComputePipelineAsync unimplemented, and
        wgpu-py then creates synchronously; its C calls release the GIL, so threads overlap the shader
        translation and the driver's compile). `pipeline_seconds` counts the wall time."""
        missing = [(name, wgsl) for name, wgsl in kernels.items() if (name, wgsl) not in self._pipelines]
        if missing:
            start = time.perf_counter()
            with ThreadPoolExecutor(min(len(missing), PIPELINE_THREADS)) as pool:
                made = list(pool.map(lambda kernel: self._create_pipeline(*kernel), missing))
            self._pipelines.update(zip(missing, made))
            self.stats["pipelines"] += len(missing)
            self.stats["pipeline_seconds"] += time.perf_counter() - start
        return {name: self._pipelines[(name, wgsl)] for name, wgsl in kernels.items()}

    def _create_pipeline(self, name: str, wgsl: str):
        module = self.device.create_shader_module(code=wgsl)
        return self.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": name})

    def uniform(self, data: bytes):
        """A uniform buffer holding `data` (a dispatch's POD arguments), padded to 16 bytes."""
        padded = data + b"\0" * (_padded(len(data), 16) - len(data))
        return self.device.create_buffer_with_data(data=padded, usage=self.wgpu.BufferUsage.UNIFORM)

    def bind_group(self, pipeline, tensors: list[WgpuTensor], uniform):
        """The bind group of one dispatch: storage bindings 0..n-1, then the uniform at n."""
        entries = []
        for i, t in enumerate(tensors):
            if t.backend is not self:
                raise JitllmError(f"{self.device_name}: a kernel was given a tensor of another device")
            if t.offset % self.alignment:
                raise JitllmError(f"{self.device_name}: a tensor at byte offset {t.offset} cannot be bound "
                                  f"(the adapter aligns storage bindings to {self.alignment} bytes)")
            size = min(_padded(t.nbytes), t.buffer.size - t.offset)
            entries.append({"binding": i, "resource": {"buffer": t.buffer, "offset": t.offset, "size": size}})
        entries.append({"binding": len(tensors), "resource": {"buffer": uniform, "offset": 0, "size": uniform.size}})
        self.stats["bind_groups"] += 1
        return self.device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)

    def encode(self, dispatches: list[Dispatch]) -> None:
        """Dispatches into the open compute pass (one is begun where none is open), submitted every
        SUBMIT_EVERY dispatches."""
        if self.capturing is not None:
            self.capturing(ENCODE, dispatches)
            return
        at = 0
        while at < len(dispatches):
            part = dispatches[at:at + SUBMIT_EVERY - self._unsubmitted]
            self._encode(part)
            at += len(part)
            if self._unsubmitted >= SUBMIT_EVERY:
                self.flush()

    def _encode(self, dispatches: list[Dispatch]) -> None:
        start = time.perf_counter()
        if self.timer is not None:
            self.timer.encode(dispatches)
        else:
            if self._pass is None:
                self._pass = self._encoding().begin_compute_pass()
                self._raw = _RawPass.of(self._pass)
            if self._raw is not None:
                self._raw.encode(dispatches)
            else:
                compute = self._pass
                for d in dispatches:
                    compute.set_pipeline(d.pipeline)
                    compute.set_bind_group(0, d.bind_group)
                    compute.dispatch_workgroups(*d.groups)
        self.stats["dispatches"] += len(dispatches)
        self._unsubmitted += len(dispatches)
        self.stats["encode_seconds"] += time.perf_counter() - start

    def _encoding(self):
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder()
        return self._encoder

    def _end_pass(self) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = self._raw = None

    def flush(self) -> None:
        """Submit what is encoded (nothing where nothing is)."""
        self._unsubmitted = 0  # (also where a profile's timer submitted its dispatches itself)
        if self._encoder is None:
            return
        start = time.perf_counter()
        self._end_pass()
        encoder, self._encoder = self._encoder, None
        self.device.queue.submit([encoder.finish()])
        self.stats["submits"] += 1
        self.stats["submit_seconds"] += time.perf_counter() - start

    def load(self, path: Path, kind: BlockKind, page_kernels: bool) -> Program:
        try:
            package = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise JitllmError(f"cannot load kernel package {path}: {e}") from None
        if not isinstance(package, dict) or package.get("format") != KERNEL_PACKAGE_FORMAT:
            raise JitllmError(f"cannot load kernel package {path}: not format {KERNEL_PACKAGE_FORMAT}")
        kernels = Kernels(self, package["kernels"])
        functions = {name: HostFunction(name, spec, kernels) for name, spec in package["functions"].items()}
        main = RelaxProgram("main", package["programs"]["main"], functions, self)
        embed, argmax = functions.get(EMBED_FUNCTION), functions.get(ARGMAX_FUNCTION)
        if not page_kernels:
            return Program(main, None, None, None, embed, argmax)
        return Program(main, *(functions[name] for name in (APPEND_FUNCTION, EXPORT_PAGES, IMPORT_PAGES)),
                       embed, argmax)

