"""Vulkan (`-devices vulkan[:SEL]`) and Metal (`-devices metal`) devices through wgpu: tensors are wgpu
storage buffers (a view is a buffer, a byte offset and a shape), artifacts are the webgpu target's kernel
packages, run by backends/wgpu_plan.py.

Work is encoded, not submitted, as it comes: consecutive dispatches share one compute pass, buffer copies
end the pass and stay in the same command encoder, and the encoder is submitted only when the host needs
the queue (a write, which the queue would otherwise run before the unsubmitted work, or a read) or waits
for it. A decode step (its inputs written first, its token or logits read last) is therefore one submit
whatever its number of blocks. Metal goes through the same code; it has not been run (no Mac here).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.config import BlockKind
from jitllm.lowering import APPEND_FUNCTION, ARGMAX_FUNCTION, EXPORT_PAGES, IMPORT_PAGES, KERNEL_PACKAGE_FORMAT
from jitllm.lowering.targets.webgpu import WebGpuTarget
from jitllm.runtime.backends.base import BackendCaps, Layout
from jitllm.runtime.backends.wgpu_adapters import open_adapter
from jitllm.runtime.backends.wgpu_plan import Dispatch, HostFunction, Kernels, RelaxProgram
from jitllm.runtime.device import Device
from jitllm.runtime.program import Program

CAPS = BackendCaps("wgpu")
UNIFIED_CAPS = BackendCaps("wgpu", unified_memory=True)


def make_device(choice, cpu_kernels: str, gpu_kernels: str) -> Device:
    """The registry's constructor. The webgpu target has one kernel family (exact), whatever -gpu-kernels says."""
    backend = WgpuBackend(choice.device.backend, choice.device.ordinal, choice.name, choice.device.unified)
    return Device(choice.name, backend, WebGpuTarget(), choice.budget_bytes)


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
        self._pipelines: dict[tuple[str, str], object] = {}
        self._encoder = None
        self._pass = None
        self._fence = None
        self.stats = {"dispatches": 0, "submits": 0, "pipelines": 0, "pipeline_seconds": 0.0, "bind_groups": 0,
                      "encode_seconds": 0.0}
        """Counters: dispatches encoded (and the host seconds that took), submits, pipelines created (and the
        seconds that took), bind groups made."""

    # -- memory ----------------------------------------------------------------------------------
    def _buffer(self, nbytes: int):
        return self.device.create_buffer(size=_padded(nbytes, 16), usage=self.usage)

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
        self.flush()
        start = tensor.offset - tensor.offset % 4
        data = self.device.queue.read_buffer(tensor.buffer, start, _padded(tensor.offset - start + tensor.nbytes))
        raw = np.frombuffer(data, np.uint8)[tensor.offset - start:tensor.offset - start + tensor.nbytes]
        return raw.view(tensor.dtype).reshape(tensor.shape).copy()

    def write(self, tensor: WgpuTensor, array: np.ndarray) -> None:
        """Pending work is submitted first: the queue runs a write before anything submitted after it."""
        data = np.ascontiguousarray(array, dtype=tensor.dtype).reshape(-1).view(np.uint8)
        if data.nbytes != tensor.nbytes:
            raise JitllmError(f"{self.device_name}: {data.nbytes} bytes written into a {tensor.nbytes}-byte tensor")
        self.flush()
        if tensor.offset % 4 or data.nbytes % 4:  # (the queue writes whole words: merge with the bytes around)
            start = tensor.offset - tensor.offset % 4
            end = _padded(tensor.offset + data.nbytes)
            around = np.frombuffer(self.device.queue.read_buffer(tensor.buffer, start, end - start), np.uint8).copy()
            around[tensor.offset - start:tensor.offset - start + data.nbytes] = data
            self.device.queue.write_buffer(tensor.buffer, start, around)
            return
        self.device.queue.write_buffer(tensor.buffer, tensor.offset, data)

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
        self.flush()
        if self._fence is None:
            self._fence = self._buffer(4)
        self.device.queue.read_buffer(self._fence, 0, 4)

    def constant(self, binding: dict) -> WgpuTensor:
        """A Relax constant of a package, uploaded once."""
        return self.upload(np.asarray(binding["values"], binding["dtype"]).reshape(binding["shape"]))

    # -- kernels ---------------------------------------------------------------------------------
    def pipeline(self, name: str, wgsl: str):
        """The compute pipeline of kernel `name` from `wgsl`, created once per device."""
        key = (name, wgsl)
        found = self._pipelines.get(key)
        if found is None:
            start = time.perf_counter()
            module = self.device.create_shader_module(code=wgsl)
            found = self._pipelines[key] = self.device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": name})
            self.stats["pipelines"] += 1
            self.stats["pipeline_seconds"] += time.perf_counter() - start
        return found

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
        """Dispatches into the open compute pass (one is begun where none is open)."""
        start = time.perf_counter()
        if self._pass is None:
            self._pass = self._encoding().begin_compute_pass()
        compute = self._pass
        for d in dispatches:
            compute.set_pipeline(d.pipeline)
            compute.set_bind_group(0, d.bind_group)
            compute.dispatch_workgroups(*d.groups)
        self.stats["dispatches"] += len(dispatches)
        self.stats["encode_seconds"] += time.perf_counter() - start

    def _encoding(self):
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder()
        return self._encoder

    def _end_pass(self) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = None

    def flush(self) -> None:
        """Submit what is encoded (nothing where nothing is)."""
        if self._encoder is None:
            return
        self._end_pass()
        encoder, self._encoder = self._encoder, None
        self.device.queue.submit([encoder.finish()])
        self.stats["submits"] += 1

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
        argmax = functions.get(ARGMAX_FUNCTION)
        if not page_kernels:
            return Program(main, None, None, None, None, argmax)
        return Program(main, *(functions[name] for name in (APPEND_FUNCTION, EXPORT_PAGES, IMPORT_PAGES)),
                       None, argmax)

