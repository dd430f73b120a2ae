"""Recurrent state of recurrent (GLA) blocks: one device tensor per (block, session), updated in place by the kernel.

Like KV pages, a state lives on its block's device and is charged to that device's KV budget; unlike
them its size is fixed, [1, heads, head_dim, head_dim] float32, whatever the history length. A
migration copies it to the destination (a fresh tensor there, so the source keeps its copy until the
move commits) and frees the source's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from jitllm.core.errors import JitllmError
from jitllm.ir.blocks import block_type
from jitllm.ir.config import BlockKind
from jitllm.runtime.backends.base import Tensor
from jitllm.runtime.device import Device


@dataclass
class RecurrentState:
    device: Device
    tensor: Tensor
    positions: int = 0
    """Tokens folded into the state; -1 while a step runs on it (a step that failed leaves it unusable)."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.tensor.shape)) * 4

    @classmethod
    def zeros(cls, kind: BlockKind, device: Device, what: str) -> "RecurrentState":
        """An empty history's state on `device`, charged to its KV budget (or raise charging nothing)."""
        shape = block_type(kind).state_shape(kind)
        nbytes = int(np.prod(shape)) * 4
        device.reserve(nbytes, what, kv=True)
        try:
            return cls(device, device.upload(np.zeros(shape, np.float32)))
        except BaseException:
            device.release(nbytes, kv=True)
            raise

    def copy_to(self, dest: Device, what: str) -> "RecurrentState":
        """The same state in a new tensor on `dest` (charged there); this one is left as it is."""
        dest.reserve(self.nbytes, what, kv=True)
        try:
            tensor = dest.empty(tuple(self.tensor.shape), "float32")
            dest.copy_from(tensor, self.tensor, self.device)
        except BaseException:
            dest.release(self.nbytes, kv=True)
            raise
        return RecurrentState(dest, tensor, self.positions)

    def release(self) -> None:
        self.device.release(self.nbytes, kv=True)


def copy_states(sessions: Iterable, index: int, dest: Device, into: dict[int, RecurrentState]) -> int:
    """Copy every session's state of block `index` to `dest`, filling `into` (session id -> copy) as it
    goes so a caller can release a partial copy; returns the bytes copied."""
    copied = 0
    for session in sessions:
        old = session.states.get(index)
        if old is not None:
            into[session.id] = old.copy_to(dest, f"recurrent state of block {index}")
            copied += old.nbytes
    return copied


def commit_states(sessions: dict, index: int, copies: dict[int, RecurrentState]) -> None:
    """Switch each session to its copy of block `index`'s state and free the old one."""
    for session_id, state in copies.items():
        states = sessions[session_id].states
        states[index].release()
        states[index] = state


def release_states(session) -> None:
    for state in session.states.values():
        state.release()
    session.states.clear()


def recurrent_step(session, unit, x: Tensor, n: int) -> Tensor:
    """Run a recurrent block over `n` new tokens; its kernel folds them into the session's state in place."""
    state = session.states.get(unit.index)
    if state is None:
        state = session.states[unit.index] = RecurrentState.zeros(
            unit.kind, unit.device, f"recurrent state of block {unit.index}")
    if state.positions != session.length:
        raise JitllmError(f"session {session.id}: block {unit.index}'s recurrent state does not match its "
                          f"{session.length} positions (an earlier step failed); reset the session")
    state.positions = -1  # until the step has finished (forward reports device failures)
    y, _ = unit.program_for(n).main(x, state.tensor, *unit.call_weights())
    unit.launched()
    state.positions = session.length + n
    return y
