"""ONNX Runtime devices (`-devices ort`, `ort:cuda`): numpy tensors in host memory, and the block graphs
(the onnxruntime target's artifacts) run by an InferenceSession with the CPU execution provider, or the
CUDA one where onnxruntime-gpu and a GPU are present (its inputs then cross to the GPU on every call: a
check of the protocols, not a fast path).

KV pages use the same pool layout and page tables as every other device, and the KV append and page
export/import the TVM artifacts carry as kernels are numpy here, so a block moves between an ONNX
Runtime device and a TVM one with its pages.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.block_type import RECURRENT
from jitllm.ir.blocks import activation_inputs, block_type, weight_inputs
from jitllm.ir.config import BlockKind
from jitllm.ir.kv_quant import from_f32
from jitllm.lowering.targets.onnxruntime import OnnxRuntimeTarget
from jitllm.runtime.backends.base import BackendCaps, Layout
from jitllm.runtime.device import Device
from jitllm.runtime.program import Program
from jitllm.runtime.workers import host_workers

CAPS = BackendCaps("numpy", unified_memory=True, memory_on_touch=True)
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def make_device(choice, cpu_kernels: str, gpu_kernels: str) -> Device:
    """The registry's constructor: `ort` (the CPU provider) or `ort:cuda` (`choice.device.name` says which)."""
    provider = "cuda" if choice.name.startswith("ort:cuda") else "cpu"
    return Device(choice.name, OrtBackend(provider, choice.device.ordinal, choice.name), OnnxRuntimeTarget(),
                  choice.budget_bytes)


class OrtBackend:
    name = "ort"
    caps = CAPS

    def __init__(self, provider: str = "cpu", ordinal: int = 0, device_name: str = "ort") -> None:
        try:
            import onnxruntime
        except ImportError:
            raise JitllmError(f"{device_name}: ONNX Runtime is not installed (pip install 'jitllm[ort]')") from None
        if PROVIDERS[provider] not in onnxruntime.get_available_providers():
            raise JitllmError(f"{device_name}: this ONNX Runtime has no {PROVIDERS[provider]} "
                              f"(it has {', '.join(onnxruntime.get_available_providers())})")
        self.provider, self.ordinal = provider, ordinal

    def empty(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """Zeroed: the graph's attention reads every page a table lists and masks what it must not see,
        and a masked NaN from uninitialised memory would still poison its sums (0 * NaN)."""
        return np.zeros(shape, dtype)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True, order="C")

    def download(self, tensor: np.ndarray) -> np.ndarray:
        return tensor.copy()

    def write(self, tensor: np.ndarray, array: np.ndarray) -> None:
        tensor[...] = array

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src

    def receive(self, tensor: np.ndarray) -> np.ndarray:
        return tensor

    def region(self, buffer: np.ndarray, shape: tuple[int, ...], dtype: str, offset: int) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return buffer.reshape(-1).view(np.uint8)[offset:offset + nbytes].view(dtype).reshape(shape)

    def aliases(self, buffer: np.ndarray, layout: Layout) -> list[np.ndarray]:
        return [self.region(buffer, shape, dtype, offset) for shape, dtype, offset in layout]

    def last_rows(self, hidden: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(hidden[:, -1:, :])

    def synchronize(self) -> None:
        """Every call returns with its results written: nothing to wait for."""

    def load(self, path: Path, kind: BlockKind, page_kernels: bool) -> Program:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = host_workers().count  # (the host's worker count: one knob for both)
        provider = (PROVIDERS["cuda"], {"device_id": self.ordinal}) if self.provider == "cuda" else PROVIDERS["cpu"]
        try:
            session = onnxruntime.InferenceSession(str(path), options, providers=[provider])
        except Exception as e:  # ORT raises its own error types; any failure here means an unusable artifact
            raise JitllmError(f"cannot load {path} into ONNX Runtime: {str(e).splitlines()[0]}") from None
        main = _Main(session, kind)
        if not page_kernels:
            return Program(main, None, None, None)
        append = functools.partial(append_ragged_kv if kind.ragged else append_kv, kv_type=kind.kv_type)
        return Program(main, append, export_pages, import_pages)


class _Main:
    """A block's graph as the engine calls a program's `main`: positional inputs in graph-input order, its
    outputs back (one array, or a tuple); a recurrent block's state input is updated in place, as the TVM
    kernels do."""

    def __init__(self, session, kind: BlockKind) -> None:
        self.session = session
        self.names = [name for name, _, _ in activation_inputs(kind) + weight_inputs(kind)]
        self.inplace = block_type(kind).state == RECURRENT

    def __call__(self, *args: np.ndarray):
        outputs = self.session.run(None, dict(zip(self.names, args)))
        if self.inplace:  # (y, state_out): the state is the second input
            args[1][...] = outputs[1]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def append_kv(pages: np.ndarray, k: np.ndarray, v: np.ndarray, page_table: np.ndarray, past: np.ndarray,
              kv_type: str = "f32") -> None:
    """The new tokens' K and V [B, S, Hkv, D] into the pool at positions past[b] + s (page_table[b, pos // P],
    slot pos % P), as a pool of `kv_type` stores them (jitllm.ir.kv_quant)."""
    batch, seq = k.shape[:2]
    page_size = pages.shape[3]
    positions = past.astype(np.int64)[:, None] + np.arange(seq)[None, :]  # [B, S]
    ids = np.take_along_axis(page_table.astype(np.int64), positions // page_size, axis=1)
    slots = positions % page_size
    pages[ids, 0, :, slots, :] = from_f32(k, kv_type, pages.dtype)
    pages[ids, 1, :, slots, :] = from_f32(v, kv_type, pages.dtype)


def append_ragged_kv(pages: np.ndarray, k: np.ndarray, v: np.ndarray, page_table: np.ndarray, past: np.ndarray,
                     seq_starts: np.ndarray, kv_type: str = "f32") -> None:
    """A ragged step's new K and V [1, rows, Hkv, D]: sequence b's rows seq_starts[b] .. at its positions
    past[b] ..."""
    starts = seq_starts.astype(np.int64)
    seq = np.repeat(np.arange(len(starts) - 1), np.diff(starts))  # the sequence of each row
    positions = past.astype(np.int64)[seq] + np.arange(starts[-1]) - starts[seq]
    page_size = pages.shape[3]
    ids = page_table.astype(np.int64)[seq, positions // page_size]
    slots = positions % page_size
    pages[ids, 0, :, slots, :] = from_f32(k[0], kv_type, pages.dtype)
    pages[ids, 1, :, slots, :] = from_f32(v[0], kv_type, pages.dtype)


def export_pages(pages: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    out[...] = pages[ids.astype(np.int64)]


def import_pages(pages: np.ndarray, ids: np.ndarray, data: np.ndarray) -> None:
    pages[ids.astype(np.int64)] = data
