"""The remote side of the Ray backend: one actor per node, owning that node's devices (made by the same
backends the coordinator uses, jitllm.runtime.backends) and the tensors and programs the coordinator
made on them, by id. The coordinator sends batches of operations (RemoteBackend's queue); one call runs
a batch in order and answers what it asked for (downloads, the functions a loaded artifact has, the
number of results a function gave)."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jitllm.ir.config import BlockKind

FUNCTIONS = ("main", "append", "export_pages", "import_pages", "embed", "argmax")
"""A Program's callables, in its field order (jitllm.runtime.program)."""


@dataclass(frozen=True)
class Ref:
    """A tensor of the actor named in an operation's arguments."""

    id: int


class HostActor:
    """Wrapped by ray.remote where it is started (backends/ray_remote.py), so this module needs no Ray."""

    def __init__(self) -> None:
        self.devices: dict[str, object] = {}
        self.tensors: dict[int, object] = {}
        self.programs: dict[int, object] = {}
        self.artifacts = Path(tempfile.mkdtemp(prefix="jitllm-artifacts-"))

    def open(self, local: str, cpu_kernels: str, gpu_kernels: str):
        """Make the device `local` names on this node (`cpu`, `cuda:0`); its target, to compile for. The
        node's CPU workers are chosen as the coordinator chooses its own (runtime/workers.py: one per
        physical performance core, or TVM_NUM_THREADS), before any kernel starts a pool here (Ray sets
        OMP_NUM_THREADS=1 in its workers, which TVM would otherwise take)."""
        from jitllm.runtime.workers import host_workers

        host_workers()
        if local not in self.devices:
            if local == "cpu":
                from jitllm.runtime.backends.host import host_device

                self.devices[local] = host_device(cpu_kernels)
            else:
                from jitllm.runtime.backends import make_device
                from jitllm.runtime.device_spec import parse_devices
                from jitllm.runtime.inventory import detect_inventory

                (choice,) = parse_devices(local, detect_inventory())
                self.devices[local] = make_device(choice, cpu_kernels, gpu_kernels)
        return self.devices[local].target

    def run(self, ops: list[tuple]) -> list:
        """Each operation in order; the answers of those that have one, in order."""
        answers = []
        for op in ops:
            answer = getattr(self, "_" + op[0])(*op[1:])
            if answer is not None:
                answers.append(answer)
        return answers

    # -- operations (RemoteBackend sends them) ------------------------------------------------------
    def _t(self, value):
        return self.tensors[value.id] if isinstance(value, Ref) else value

    def _empty(self, local: str, out: int, shape: tuple, dtype: str) -> None:
        self.tensors[out] = self.devices[local].backend.empty(shape, dtype)

    def _upload(self, local: str, out: int, array) -> None:
        self.tensors[out] = self.devices[local].backend.upload(array)

    def _write(self, local: str, tensor: int, array) -> None:
        self.devices[local].backend.write(self.tensors[tensor], array)

    def _copy(self, local: str, dst: int, src: int) -> None:
        self.devices[local].backend.copy(self.tensors[dst], self.tensors[src])

    def _receive(self, local: str, out: int, src: int) -> None:
        self.tensors[out] = self.devices[local].backend.receive(self.tensors[src])

    def _region(self, local: str, out: int, buffer: int, shape: tuple, dtype: str, offset: int) -> None:
        self.tensors[out] = self.devices[local].backend.region(self.tensors[buffer], shape, dtype, offset)

    def _aliases(self, local: str, first: int, buffer: int, layout: tuple) -> None:
        for i, view in enumerate(self.devices[local].backend.aliases(self.tensors[buffer], layout)):
            self.tensors[first + i] = view

    def _last_rows(self, local: str, out: int, hidden: int) -> None:
        self.tensors[out] = self.devices[local].backend.last_rows(self.tensors[hidden])

    def _download(self, local: str, tensor: int):
        return ("array", self.devices[local].backend.download(self.tensors[tensor]))

    def _synchronize(self, local: str) -> None:
        self.devices[local].backend.synchronize()

    def _free(self, ids: list[int]) -> None:
        for i in ids:
            self.tensors.pop(i, None)

    def _load(self, local: str, out: int, data: bytes, suffix: str, kind: BlockKind, page_kernels: bool):
        path = self.artifacts / f"{out}{suffix}"
        path.write_bytes(data)
        program = self.devices[local].backend.load(path, kind, page_kernels)
        self.programs[out] = program
        return ("functions", tuple(getattr(program, name) is not None for name in FUNCTIONS))

    def _call(self, program: int, function: str, first: int, results: int | None, args: tuple):
        """`results`: how many the coordinator expects (None the first time: it is told)."""
        out = getattr(self.programs[program], function)(*(self._t(a) for a in args))
        outs = [] if out is None else list(out) if isinstance(out, Sequence) else [out]
        if results is not None and len(outs) != results:
            raise RuntimeError(f"{function} gave {len(outs)} results where {results} were expected")
        for i, tensor in enumerate(outs):
            self.tensors[first + i] = tensor
        return ("results", len(outs)) if results is None else None
