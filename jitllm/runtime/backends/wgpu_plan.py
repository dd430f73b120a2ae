"""A kernel package (jitllm/lowering/kernel_package.py) run on a wgpu device: its Relax programs and TIR
functions as callables over WgpuTensors.

A call's dispatches are recorded once per distinct set of argument buffers (and shapes): the outputs it
allocates, each dispatch's pipeline, bind group (storage bindings and a uniform of its int32 arguments)
and grid. A later call with the same arguments replays the recording: the same outputs are written again
and only `set_pipeline` / `set_bind_group` / `dispatch` are encoded (wgpu has no reusable command buffers;
pipelines, bind groups, uniforms and scratch are made once). Decode steps of a block call its program with
the same buffers every token, so after the first token a step allocates and creates nothing.
Recordings are kept per callable up to RECORDINGS, least recently used dropped first.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jitllm.core.errors import JitllmError

RECORDINGS = 64
"""Argument sets whose recordings one callable keeps (each block of a kind is one)."""
KEPT_SCRATCH = 8 << 20
"""A recording whose outputs and intermediates take more bytes than this (a prefill's) is used once and
dropped: a prefill's inputs are new buffers every time, so it would never be replayed, and keeping it
would keep its activations."""
MAX_GROUPS = 65535
"""Workgroups per grid dimension WebGPU guarantees; a larger x is folded into z (TVM's packGridDimX)."""


def evaluate(tree, env: dict[str, int]):
    """A kernel_package.expr_tree expression's value (int32 arithmetic, as the kernels compute it)."""
    if isinstance(tree, (int, float)):
        return tree
    if isinstance(tree, str):
        return env[tree]
    op, *args = tree
    if op == "cast":
        value = evaluate(args[1], env)
        return float(value) if args[0].startswith("float") else int(value)
    if op == "select":
        return evaluate(args[1], env) if evaluate(args[0], env) else evaluate(args[2], env)
    if op == "not":
        return not evaluate(args[0], env)
    a, b = evaluate(args[0], env), evaluate(args[1], env)
    return _BINARY[op](a, b)


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


_BINARY = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "//": lambda a, b: a // b,
    "%": lambda a, b: a % b, "/": _trunc_div, "rem": lambda a, b: a - _trunc_div(a, b) * b,
    "min": min, "max": max, "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
    "and": lambda a, b: bool(a and b), "or": lambda a, b: bool(a or b),
}


def itemsize(dtype: str) -> int:
    """Bytes of one element of a kernel parameter's TVM dtype (vectors too: "uint32x4" is 16)."""
    base, _, lanes = dtype.partition("x")
    return np.dtype(base).itemsize * int(lanes or 1)


def bind_shapes(declared: list, tensors: list, env: dict[str, int], what: str) -> None:
    """Name each symbolic dim of `declared` (a param's shape trees) from the tensors' shapes; check the rest."""
    for spec, tensor in zip(declared, tensors):
        shape = spec["shape"]
        if len(shape) != len(tensor.shape):
            raise JitllmError(f"{what}: a {len(tensor.shape)}-d tensor where the kernel takes {len(shape)} dims")
        for dim, actual in zip(shape, tensor.shape):
            if isinstance(dim, str) and dim not in env:
                env[dim] = int(actual)
    for spec, tensor in zip(declared, tensors):
        want = [evaluate(d, env) for d in spec["shape"]]
        same_bytes = int(np.prod(want, dtype=np.int64)) * itemsize(spec["dtype"]) == tensor.nbytes
        if [int(a) for a in tensor.shape] != want and not same_bytes:  # (bytes read as words or 16-byte vectors)
            raise JitllmError(f"{what}: shape {tuple(tensor.shape)} where the kernel takes {tuple(want)}")


@dataclass
class Dispatch:
    """One recorded dispatch: what replaying it encodes."""

    pipeline: object
    bind_group: object
    groups: tuple[int, int, int]
    buffers: frozenset = frozenset()
    """The uids of the buffers it binds (what a captured step may write before it: wgpu_graph)."""
    kernel: str = ""
    """The package's name of its kernel (what a profile, wgpu_profile.py, reports it under)."""


class Kernels:
    """The package's kernels on one device: pipelines made once (cached by the backend across packages)."""

    def __init__(self, backend, kernels: dict) -> None:
        self.backend, self.specs = backend, kernels
        self.pipelines = backend.pipelines({name: spec["wgsl"] for name, spec in kernels.items()})

    def dispatch(self, name: str, buffers: list, pods: list, grid: list[int]) -> Dispatch:
        """One launch of kernel `name`: storage `buffers` (tensors) in its argument order, then a uniform
        of its POD values and packGridDimX (the grid's x extent less one)."""
        spec = self.specs[name]
        dims = dict(zip(spec["launch"], grid))
        x, y, z = (int(dims.get(f"blockIdx.{a}", 1)) for a in "xyz")
        pack = x - 1  # (the kernel skips workgroups past it: a folded grid has a ragged last row)
        if x > MAX_GROUPS:
            if z != 1:
                raise JitllmError(f"webgpu: kernel {name} needs {x} x {z} workgroups")
            x, z = MAX_GROUPS, -(-x // MAX_GROUPS)
        values = b"".join(struct.pack("<f" if t.startswith("float") else "<i", v) for t, v in zip(spec["pods"], pods))
        uniform = self.backend.uniform(values + struct.pack("<I", pack))
        pipeline = self.pipelines[name]
        group = self.backend.bind_group(pipeline, buffers, uniform)
        return Dispatch(pipeline, group, (x, y, z), frozenset(t.buffer.uid for t in buffers), name)


class HostFunction:
    """A TIR function of the package: its launches over the tensors it is called with (every parameter,
    outputs included, is an argument: kernels write in place)."""

    def __init__(self, name: str, spec: dict, kernels: Kernels) -> None:
        self.name, self.spec, self.kernels = name, spec, kernels
        self._recordings: OrderedDict = OrderedDict()

    def record(self, tensors: list) -> list[Dispatch]:
        """The dispatches of a call over `tensors`; its scratch buffers are made here, once per recording."""
        env: dict[str, int] = {}
        bind_shapes(self.spec["params"], tensors, env, self.name)
        out = []
        for step in self.spec["steps"]:
            if step[0] == "let":
                env[step[1]] = evaluate(step[2], env)
                continue
            if step[0] == "scratch":
                tensors.append(self.kernels.backend.empty(tuple(evaluate(d, env) for d in step[1]), step[2]))
                continue
            _, kernel, bound, pods, grid = step
            out.append(self.kernels.dispatch(kernel, [tensors[i] for i in bound], [evaluate(p, env) for p in pods],
                                             [evaluate(g, env) for g in grid]))
        return out

    def __call__(self, *tensors) -> None:
        if len(tensors) != len(self.spec["params"]):
            raise JitllmError(f"{self.name}: {len(tensors)} arguments where it takes {len(self.spec['params'])}")
        key = tuple(t.key for t in tensors)
        dispatches = _recalled(self._recordings, key, lambda: self.record(list(tensors)))
        self.kernels.backend.encode(dispatches)


class RelaxProgram:
    """A Relax function of the package (a block's `main`): its bindings in order over fresh outputs, as one
    recording per argument set; returns its output tensor or tuple of tensors."""

    def __init__(self, name: str, spec: dict, functions: dict[str, HostFunction], backend) -> None:
        self.name, self.spec, self.functions, self.backend = name, spec, functions, backend
        self._recordings: OrderedDict = OrderedDict()
        self._constants = {b["id"]: backend.constant(b) for b in spec["bindings"] if b["op"] == "const"}

    def record(self, args: list) -> tuple[list[Dispatch], object, int]:
        """(dispatches, output, bytes allocated for outputs and intermediates)."""
        env: dict[str, int] = {}
        bind_shapes(self.spec["params"], args, env, self.name)
        values = {p["id"]: a for p, a in zip(self.spec["params"], args)}
        values.update(self._constants)
        dispatches: list[Dispatch] = []
        allocated = 0
        for b in self.spec["bindings"]:
            op = b["op"]
            if op == "call":
                outs = [self.backend.empty(tuple(evaluate(d, env) for d in o["shape"]), o["dtype"]) for o in b["outs"]]
                allocated += sum(o.nbytes for o in outs)
                dispatches += self.functions[b["function"]].record([values[a] for a in b["args"]] + outs)
                values[b["id"]] = tuple(outs) if b["tuple"] else outs[0]
            elif op == "reshape":
                src = values[b["arg"]]
                values[b["id"]] = src.view(tuple(evaluate(d, env) for d in b["shape"]), src.dtype, 0)
            elif op == "item":
                values[b["id"]] = values[b["arg"]][b["index"]]
            elif op == "tuple":
                values[b["id"]] = tuple(values[a] for a in b["args"])
            elif op == "alias":
                values[b["id"]] = values[b["arg"]]
        output = self.spec["output"]
        return (dispatches, tuple(values[i] for i in output) if isinstance(output, list) else values[output],
                allocated)

    def __call__(self, *args):
        if len(args) != len(self.spec["params"]):
            raise JitllmError(f"{self.name}: {len(args)} arguments where it takes {len(self.spec['params'])}")
        key = tuple(a.key for a in args)
        dispatches, output, _ = _recalled(self._recordings, key, lambda: self.record(list(args)),
                                          lambda found: found[2])
        self.backend.encode(dispatches)
        return output


def _recalled(recordings: OrderedDict, key, record, scratch: Callable[[object], int] = lambda found: 0):
    """The recording for `key` (made by `record()` the first time, and kept where `scratch(recording)`, the
    bytes it allocated, is at most KEPT_SCRATCH), most recently used last."""
    found = recordings.get(key)
    if found is None:
        found = record()
        if scratch(found) <= KEPT_SCRATCH:
            recordings[key] = found
            if len(recordings) > RECORDINGS:
                recordings.popitem(last=False)
    else:
        recordings.move_to_end(key)
    return found
