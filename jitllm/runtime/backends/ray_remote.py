"""Devices of other nodes of a Ray cluster (`-devices node2/cpu`, `node2/cuda:0`): the Backend protocol
over tensors that live in that node's actor (backends/ray_host.py), which runs the node's own backend.

Nothing waits on the other node until a value must come back: every operation (allocations, writes,
copies, kernel calls) is queued with the ids of the tensors it makes, chosen here; a synchronize sends
the queue to the actor without waiting, and a download (the hidden state or the logits at a seam), or a
new program's functions, sends it and waits. The actor runs batches in order. A decode step of a segment
on another node is one wait, and only its inputs and the hidden state (or the logits) cross. Every wait
has a timeout (JITLLM_CLUSTER_TIMEOUT); a node that is gone or does not answer is a DeviceFault naming it,
and its device stays failed.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from jitllm.core.errors import DeviceFault, JitllmError
from jitllm.ir.config import BlockKind
from jitllm.runtime.backends.base import BackendCaps, Layout
from jitllm.runtime.backends.ray_host import FUNCTIONS, HostActor, Ref
from jitllm.runtime.device import Device
from jitllm.runtime.program import Program

CAPS = BackendCaps("ray")
"""The module's declaration; each node's devices declare their own family (`ray:NODE_ID`): tensors of one
node copy into each other there, others go through the coordinator."""

FLUSH_BYTES = 32 << 20
"""Queued writes beyond this many bytes go at once (the batch travels through Ray's object store)."""

_actors: dict[str, object] = {}
"""One actor per node (node id -> its handle), shared by that node's devices."""
_links: dict[str, "NodeLink"] = {}
"""Each node's queue (node id -> NodeLink), shared by that node's devices."""


class RemoteTensor:
    """A tensor in a node's actor; freed there once nothing here holds it."""

    __slots__ = ("backend", "id", "shape", "dtype", "__weakref__")

    def __init__(self, backend: "RemoteBackend", tid: int, shape: tuple | None, dtype: str | None) -> None:
        self.backend, self.id, self.shape, self.dtype = backend, tid, shape, dtype

    def __del__(self) -> None:
        self.backend.link.garbage.append(self.id)


class NodeLink:
    """The queue of one node's actor, and its failure once it failed (every later call raises it)."""

    def __init__(self, actor, node, timeout: float) -> None:
        self.actor, self.node, self.timeout = actor, node, timeout
        self.ops: list[tuple] = []
        self.garbage: list[int] = []
        self.queued_bytes = 0
        self.ids = itertools.count(1)
        self.failed: str | None = None
        self.sent: list = []
        """Batches sent and not yet waited for (their results, in order)."""

    def push(self, op: tuple, nbytes: int = 0) -> None:
        self.ops.append(op)
        self.queued_bytes += nbytes

    def send(self) -> None:
        """Everything queued goes to the actor now, without waiting for it (the next `flush` does)."""
        import ray

        if self.garbage:
            freed, self.garbage[:] = list(self.garbage), []
            self.ops.append(("free", freed))
        if self.ops:
            ops, self.ops, self.queued_bytes = self.ops, [], 0
            try:
                self.sent.append(self.actor.run.remote(ops))
            except ray.exceptions.RayError as e:
                self.failed = f"node {self.node.label()} is gone ({_last_line(e)})"

    def flush(self, device: str) -> list:
        """Run everything queued there and wait for it (and for what was sent before): the last batch's
        answers. A dead node, or one that does not answer in time: a DeviceFault naming the node."""
        import ray

        if self.failed is None:
            self.send()
        if self.failed is not None:
            raise DeviceFault(device, self.failed)
        sent, self.sent = self.sent, []
        if not sent:
            return []
        try:
            return ray.get(sent, timeout=self.timeout)[-1]
        except ray.exceptions.GetTimeoutError:
            self.failed = f"node {self.node.label()} did not answer within {self.timeout:g} s"
        except ray.exceptions.RayTaskError as e:  # the work failed there (allocation, launch): the device's fault
            raise DeviceFault(device, f"on node {self.node.name}: {_last_line(e.cause if e.cause else e)}") from None
        except ray.exceptions.RayError as e:  # the actor, its process or its node is gone
            self.failed = f"node {self.node.label()} is gone ({_last_line(e)})"
        raise DeviceFault(device, self.failed)


class RemoteBackend:
    name = "ray"

    def __init__(self, link: NodeLink, local: str, device_name: str) -> None:
        self.link, self.local, self.device_name = link, local, device_name
        self.caps = BackendCaps(f"ray:{link.node.node_id}")

    # -- the queue ----------------------------------------------------------------------------------
    def _new(self, shape: tuple | None, dtype: str | None) -> RemoteTensor:
        return RemoteTensor(self, next(self.link.ids), shape, dtype)

    def _push(self, op: tuple, nbytes: int = 0) -> None:
        if self.link.failed is not None:
            raise DeviceFault(self.device_name, self.link.failed)
        self.link.push(op, nbytes)
        if self.link.queued_bytes > FLUSH_BYTES:
            self.link.flush(self.device_name)

    def _answers(self) -> list:
        return self.link.flush(self.device_name)

    # -- the Backend protocol -----------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: str) -> RemoteTensor:
        out = self._new(tuple(shape), dtype)
        self._push(("empty", self.local, out.id, tuple(shape), dtype))
        return out

    def upload(self, array: np.ndarray) -> RemoteTensor:
        array = np.array(array, copy=True, order="C")  # (queued: the caller may rewrite its array)
        out = self._new(array.shape, str(array.dtype))
        self._push(("upload", self.local, out.id, array), array.nbytes)
        return out

    def download(self, tensor: RemoteTensor) -> np.ndarray:
        self._push(("download", self.local, tensor.id))
        return self._answers()[-1][1]

    def write(self, tensor: RemoteTensor, array: np.ndarray) -> None:
        array = np.array(array, copy=True, order="C")
        self._push(("write", self.local, tensor.id, array), array.nbytes)

    def copy(self, dst: RemoteTensor, src: RemoteTensor) -> None:
        self._push(("copy", self.local, dst.id, src.id))

    def receive(self, tensor: RemoteTensor) -> RemoteTensor:
        out = self._new(tensor.shape, tensor.dtype)
        self._push(("receive", self.local, out.id, tensor.id))
        return out

    def region(self, buffer: RemoteTensor, shape: tuple[int, ...], dtype: str, offset: int) -> RemoteTensor:
        out = self._new(tuple(shape), dtype)
        self._push(("region", self.local, out.id, buffer.id, tuple(shape), dtype, offset))
        return out

    def aliases(self, buffer: RemoteTensor, layout: Layout) -> list[RemoteTensor]:
        views = [self._new(tuple(shape), dtype) for shape, dtype, _ in layout]  # (consecutive ids)
        self._push(("aliases", self.local, views[0].id if views else 0, buffer.id, layout))
        return views

    def last_rows(self, hidden: RemoteTensor) -> RemoteTensor:
        out = self._new(None, "float32")
        self._push(("last_rows", self.local, out.id, hidden.id))
        return out

    def synchronize(self) -> None:
        """The queue goes to the node, in order before anything later; nothing waits here (the next
        download does), so a step's inputs and its outputs make one round trip together."""
        if self.link.ops:
            self._push(("synchronize", self.local))
            self.link.send()

    def load(self, path: Path, kind: BlockKind, page_kernels: bool) -> Program:
        """The artifact's bytes go to the node (nothing needs a shared file system), loaded there once."""
        if not path.is_file():
            raise JitllmError(f"{self.device_name}: remote devices take shared-library artifacts ({path} is not one)")
        program = next(self.link.ids)
        self._push(("load", self.local, program, path.read_bytes(), path.suffix, kind, page_kernels))
        _, present = self._answers()[-1]
        return Program(*(RemoteFunction(self, program, name) if there else None
                         for name, there in zip(FUNCTIONS, present)))


class RemoteFunction:
    """One function of a program loaded on a node: called here, queued there; its results are tensors
    there (how many it gives is learnt at its first call, which waits for the answer)."""

    def __init__(self, backend: RemoteBackend, program: int, name: str) -> None:
        self.backend, self.program, self.name = backend, program, name
        self.results: int | None = None

    def __call__(self, *args):
        backend = self.backend
        refs = tuple(Ref(a.id) if isinstance(a, RemoteTensor) else a for a in args)
        first = next(backend.link.ids)
        for _ in range(7):  # (ids for up to 8 results)
            next(backend.link.ids)
        backend._push(("call", self.program, self.name, first, self.results, refs))
        if self.results is None:
            self.results = backend._answers()[-1][1]
        outs = [RemoteTensor(backend, first + i, None, None) for i in range(self.results)]
        return None if not outs else outs[0] if len(outs) == 1 else tuple(outs)


def make_device(choice, cpu_kernels: str, gpu_kernels: str) -> Device:
    """The registry's constructor for `NODE/DEVICE`: that node's actor (started once), the device opened
    there, and the target it compiles for (the node's own: its CPU's features, its GPU's arch)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from jitllm.runtime.cluster.connection import connect, timeout
    from jitllm.runtime.cluster.nodes import remote_specs

    spec = remote_specs(connect("auto"))[choice.name.lower()]
    node = spec.node
    wait = timeout()
    actor = _actors.get(node.node_id)
    if actor is None:
        actor = ray.remote(num_cpus=0, max_restarts=0)(HostActor).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
        _actors[node.node_id] = actor
    link = _links.setdefault(node.node_id, NodeLink(actor, node, wait))
    try:
        target = ray.get(actor.open.remote(spec.local, cpu_kernels, gpu_kernels), timeout=wait)
    except ray.exceptions.GetTimeoutError:
        raise DeviceFault(choice.name, f"node {node.label()} did not start its actor within {wait:g} s") from None
    except ray.exceptions.RayError as e:
        raise DeviceFault(choice.name, f"node {node.label()}: {_last_line(getattr(e, 'cause', None) or e)}") from None
    return Device(choice.name, RemoteBackend(link, spec.local, choice.name), target, choice.budget_bytes)



def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1].strip() if text else type(e).__name__


def reset() -> None:
    """Forget every node's actor (its cluster is gone)."""
    _actors.clear()
    _links.clear()
