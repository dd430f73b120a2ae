"""Many requests served by batched steps: each step's plan (scheduler.plan_step: every decoding request one
token, prompt chunks under a token budget) runs as one batched step (batched.py), its logits sampled per
request. Where a pool is full, prompts wait; where a decoding request cannot get a page, the request
admitted last is spilled to the host (spill.py) and resumed before any new prompt is admitted, so no KV
is ever recomputed to make room. The one recompute: a device that fails mid-step (its memory cannot be
read) sends its units home (`fall_back`), which computes again only their KV for the requests that held
some there (rebuild.py; counted in block-positions and said through `log`), and the step is planned
again; spilled requests keep their host copy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from jitllm.core.errors import DeviceFault, JitllmError
from jitllm.runtime.engine import spill as spilling
from jitllm.runtime.engine.batched import check_batchable
from jitllm.runtime.engine.kv import try_room
from jitllm.runtime.engine.rebuild import FallBack
from jitllm.runtime.engine.scheduler import SequencePlan, plan_step
from jitllm.runtime.engine.session import Session
from jitllm.runtime.sampling import Sampler

DONE_STOP, DONE_LENGTH, DONE_CONTEXT = "stop", "length", "context"
"""Why a request finished: a stop token, max_tokens reached, the context full."""


@dataclass
class BatchRequest:
    id: int
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: frozenset[int]
    session: Session
    plan: SequencePlan
    output: list[int] = field(default_factory=list)
    pending: int | None = None
    """The token sampled last, fed at its next step."""
    spilled: spilling.SpilledKV | None = None
    admitted: int = -1
    """The step it first ran in (-1: not yet); the request admitted last is spilled first."""
    finished: str | None = None
    """DONE_STOP, DONE_LENGTH or DONE_CONTEXT once it has finished."""


@dataclass
class BatchStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    largest_step: int = 0
    """Most requests in one step."""
    spills: int = 0
    resumes: int = 0
    spilled_bytes: int = 0
    recomputed_block_positions: int = 0
    """KV computed again, in positions times blocks (a lost block's positions each): making room never
    does; only a failed device's blocks are."""


class BatchRunner:
    """Requests in, tokens out, one batched step at a time (`step`), on one executor's units."""

    def __init__(self, executor, token_budget: int = 512, max_sequences: int = 64,
                 log: Callable[[str], None] | None = None,
                 fall_back: Callable[[str], FallBack] | None = None) -> None:
        """`fall_back`: brings the failed device's units home after a device failure, their KV computed
        again (Model.fall_back_to_host); without it a device failure ends the run."""
        if token_budget < 1 or max_sequences < 1:
            raise JitllmError("a batched step needs a token budget and a sequence limit of at least 1")
        check_batchable(executor)
        self.ex = executor
        self.token_budget, self.max_sequences, self.log, self.fall_back = token_budget, max_sequences, log, fall_back
        self.requests: list[BatchRequest] = []
        self.stats = BatchStats()

    def submit(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               stop_ids: frozenset[int] = frozenset()) -> BatchRequest:
        if not prompt:
            raise JitllmError("a request needs at least one prompt token")
        if max_tokens < 1:
            raise JitllmError("a request needs max_tokens of at least 1")
        if len(prompt) >= self.ex.ctx:
            raise JitllmError(f"a prompt of {len(prompt)} tokens does not fit the context of {self.ex.ctx}")
        request = BatchRequest(len(self.requests), list(prompt), max_tokens, sampler, frozenset(stop_ids),
                               self.ex.new_session(), SequencePlan(len(self.requests), len(prompt)))
        self.requests.append(request)
        return request

    @property
    def unfinished(self) -> list[BatchRequest]:
        return [r for r in self.requests if r.finished is None]

    def step(self) -> list[tuple[BatchRequest, int]]:
        """One batched step: (request, token) for each request that sampled a token in it."""
        self._resume_spilled()
        work = self._make_room(self._plan())
        if not work:
            raise JitllmError("no request can run: the KV pools have no room for any of them")
        try:
            logits = self.ex.batched_forward([(r.session, ids) for r, ids in work])
        except DeviceFault as fault:
            if self.fall_back is None:
                raise
            self._recover(fault)
            return []
        self.stats.steps += 1
        self.stats.largest_step = max(self.stats.largest_step, len(work))
        events = []
        for (request, ids), row in zip(work, logits):
            if request.admitted < 0:
                request.admitted = self.stats.steps
            if request.plan.decoding:
                self.stats.decode_tokens += 1
            else:
                request.plan.fed += len(ids)
                self.stats.prefill_tokens += len(ids)
                if request.plan.fed < request.plan.prompt:
                    continue
            token = request.sampler(row)
            if token in request.stop_ids:
                self._finish(request, DONE_STOP)
                continue
            request.output.append(token)
            events.append((request, token))
            if len(request.output) >= request.max_tokens:
                self._finish(request, DONE_LENGTH)
            elif request.session.length + 1 > self.ex.ctx:
                self._finish(request, DONE_CONTEXT)
            else:
                request.pending, request.plan.decoding = token, True
        return events

    def run(self) -> None:
        while self.unfinished:
            self.step()

    # -- planning ---------------------------------------------------------------------------------
    def _plan(self) -> list[tuple[BatchRequest, list[int]]]:
        """The step plan over the requests that hold their KV; new prompts wait while any request is spilled."""
        spilled = any(r.spilled is not None for r in self.unfinished)
        ready = [r for r in self.unfinished if r.spilled is None and not (spilled and r.admitted < 0)]
        by_id = {r.id: r for r in ready}
        plan = plan_step([r.plan for r in ready], self.token_budget, self.max_sequences)
        out = []
        for rid, count in plan:
            r = by_id[rid]
            out.append((r, [r.pending] if r.plan.decoding else r.prompt[r.plan.fed:r.plan.fed + count]))
        return out

    def _make_room(self, plan: list[tuple[BatchRequest, list[int]]]) -> list[tuple[BatchRequest, list[int]]]:
        """The planned requests that have pages for their step. A prompt chunk without room waits (unless
        nothing else could run); a decoding request without room spills the request admitted last."""
        work: list[tuple[BatchRequest, list[int]]] = []
        for request, ids in plan:
            if request.spilled is None and self._room_for(request, len(ids), spill=request.plan.decoding):
                work.append((request, ids))
            work = [(r, i) for r, i in work if r.spilled is None]
        if not work and plan:
            request, ids = plan[0]
            if self._room_for(request, len(ids), spill=True):
                work.append((request, ids))
        return work

    def _room_for(self, request: BatchRequest, tokens: int, spill: bool) -> bool:
        positions = request.session.length + tokens
        while not try_room(self.ex, request.session, positions):
            if not spill:
                return False
            victim = self._victim(exclude=request)
            if victim is None:
                raise JitllmError(f"the KV of one request ({positions} positions) does not fit the pools: "
                                  "give the devices more KV room or use a shorter context")
            self._spill(victim)
        return True

    def _victim(self, exclude: BatchRequest) -> BatchRequest | None:
        holding = [r for r in self.unfinished if r is not exclude and r.spilled is None and r.session.tables]
        return max(holding, key=lambda r: (r.admitted < 0, r.admitted, r.id), default=None)

    def _spill(self, request: BatchRequest) -> None:
        if request.session.length == 0:  # nothing has run: its pages are only given back
            self.ex.reset_session(request.session)
            return
        request.spilled = spilling.spill(self.ex, request.session)
        self.stats.spills += 1
        self.stats.spilled_bytes += request.spilled.nbytes
        if self.log:
            self.log(f"batch: spilled request {request.id} ({request.spilled.positions} positions, "
                     f"{request.spilled.nbytes / 2**20:.1f} MiB) to the host")

    def _resume_spilled(self) -> None:
        for request in sorted((r for r in self.unfinished if r.spilled is not None), key=lambda r: r.admitted):
            if not spilling.resume(self.ex, request.session, request.spilled):
                return  # first spilled, first resumed
            self.stats.resumes += 1
            if self.log:
                self.log(f"batch: resumed request {request.id} from the host ({request.spilled.positions} positions)")
            request.spilled = None

    def _recover(self, fault: DeviceFault) -> None:
        """The failed device's units home, only their KV computed again for the requests that held some there
        (every request keeps its history and goes on where it was)."""
        report = self.fall_back(fault.device)
        self.stats.recomputed_block_positions += report.block_positions
        if self.log:
            self.log(f"warning: {fault}; {report.describe()}")

    def _finish(self, request: BatchRequest, why: str) -> None:
        request.finished = why
        request.pending = None
        self.ex.close_session(request.session)
