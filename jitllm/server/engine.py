"""The engine thread (llama.cpp's server loop): it alone owns the model. HTTP handlers only post jobs (one per
choice to generate) and calls (a placement move, a look at the sessions) and read what comes back.

Each turn of the loop runs the calls posted since the last turn, admits waiting jobs into free slots (a
session from the prefix cache each), then moves every busy slot on: with two or more busy and a model
whose blocks take batched steps, one batched step for all of them (each decoding slot one token, prompts
in chunks beside them: docs/batching.md); with one (or a model that cannot batch), its batch-1 step
(pipelined greedy decode where it can). Every stream moves on a token per turn. While slots decode, the
prompt chunks beside them are sized by the learnt step cost (step_cost.py) so that a step carrying a prompt
stays within `prefill_stretch` decode steps. Work posted in pieces (a live move, a unit a turn) advances one
piece per turn. Jobs beyond the busy slots wait in a bounded queue; a full queue is a 429, never a drop.

Where a device's KV pool is full, the prefix cache's idle sessions are closed first (least recently used
first); then, in batched turns, a prompt chunk waits and a decoding slot spills the slot admitted last to
the host (runtime/engine/spill.py, as BatchRunner does), which is resumed, first spilled first, before any
new job is admitted: no KV is recomputed to make room. Only a device fault recomputes: the failed device's
(or node's) units go home and only their KV is computed again for the sessions that held some there
(runtime/engine/rebuild.py); every slot then goes on from where its session is."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator

import numpy as np

from jitllm.core.errors import DeviceFault, JitllmError
from jitllm.runtime.sampling import Sampler, SamplingParams
from jitllm.server.errors import ApiError
from jitllm.server.metrics import Metrics
from jitllm.server.step_cost import StepCost


@dataclass(frozen=True)
class Token:
    """A generated token; with logprobs asked for, its log-probability and the `top` likeliest (id, logprob)."""

    id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: str
    """stop (a stop token), length (max_tokens or the context), cancelled (the client left)."""
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500


Event = Token | Finished | Failed


@dataclass
class Job:
    """One choice to generate. `deliver` takes its events on the engine thread (it must only hand them over);
    `cancelled` is set by the handler when its client leaves."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    top_logprobs: int | None
    ignore_eos: bool
    deliver: Callable[[Event], None]
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)


class LogprobSampler(Sampler):
    """A sampler that also keeps each pick's log-probability under the model (the raw logits, before
    temperature and penalties, as vLLM reports them) and the `top` likeliest tokens'."""

    def __init__(self, params: SamplingParams, top: int) -> None:
        super().__init__(params)
        self.top = top
        self.last: Token | None = None

    @property
    def greedy(self) -> bool:
        return False  # (the logits must come back to the host)

    def __call__(self, logits: np.ndarray) -> int:
        token = super().__call__(logits)
        shifted = logits.astype(np.float64) - logits.max()
        logp = shifted - np.log(np.exp(shifted).sum())
        best = np.argsort(-logp, kind="stable")[: self.top]
        self.last = Token(token, float(logp[token]), tuple((int(i), float(logp[i])) for i in best))
        return token


@dataclass
class Slot:
    job: Job
    session: object
    """Its engine Session (typed loosely: the engine's modules import TVM, which this module must not at start-up)."""
    cached: int
    sampler: Sampler
    tokens: Iterator[int] | None = None
    """Its batch-1 generation; None while it is served by batched steps."""
    generated: list[int] = field(default_factory=list)
    last_token_at: float = 0.0
    admitted: int = 0
    """Its place in the order of admission (the slot admitted last is spilled first)."""
    spilled: object = None
    """Its KV on the host (spill.SpilledKV) while a full pool has no room for it."""


@dataclass(frozen=True)
class EngineSettings:
    parallel: int = 4
    queue: int = 64
    cache_sessions: int = 32
    cache_bytes: int | None = None
    verbose: bool = False
    """Print every message of the load (-v: the plan too), not only compile, cache, move and fallback events."""
    token_budget: int = 512
    """Tokens per batched step (decoding slots one each, prompt chunks in the rest)."""
    prefill_stretch: float = 1.5
    """A step with prompt chunks beside decoding slots is kept within this many times a decode-only step's
    time (step_cost.py: what a decoding stream's inter-token latency may stretch to); 0: only `token_budget`."""


class Engine:
    def __init__(self, load: Callable[[Callable[[str], None]], object], settings: EngineSettings,
                 metrics: Metrics) -> None:
        """`load(log)` opens the model (on the engine thread), reporting its progress through `log`."""
        self._load, self.settings, self.metrics = load, settings, metrics
        self.stage = "starting"
        """starting, loading, ready, failed: MESSAGE, stopped."""
        self.compiled: list[str] = []
        self.model = None
        self.cache = None
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._calls: deque[tuple[Callable, Future]] = deque()
        self._posted_pieces: deque[tuple[Callable, Future]] = deque()
        self._pieces: deque[tuple[Generator, Future]] = deque()
        """Work done a piece per turn (call_in_pieces), oldest first."""
        self._outstanding = 0
        """Jobs queued or in a slot (the bound of `submit`)."""
        self.accepting = True
        self._stopping = False
        self._slots: list[Slot] = []
        self._admissions = 0
        self._batching = False
        """The model's blocks take batched steps (engine/batched.py: KV-page blocks on targets with ragged
        kernels); found once it is loaded."""
        self._costs = StepCost()
        """What a batched step costs, learnt as they run: it sizes the prompt chunks beside decoding slots."""
        self._thread = threading.Thread(target=self._run, name="jitllm-engine", daemon=True)
        self.on_failure: Callable[[str], None] = lambda message: None

    @property
    def ready(self) -> bool:
        return self.stage == "ready"

    @property
    def batching(self) -> bool:
        """Whether two or more busy slots share batched steps (known once the model is loaded)."""
        return self._batching

    # -- the handlers' side ------------------------------------------------------------------------
    def start(self) -> None:
        self.stage = "loading"
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue the jobs of one request, all or none: 429 (with Retry-After) when the slots and the queue
        cannot take them all, 503 while loading or shutting down."""
        with self._cond:
            if not self.accepting or not self.ready:
                raise ApiError(503, "the server is shutting down" if not self.accepting else f"model {self.stage}")
            capacity = self.settings.parallel + self.settings.queue
            if self._outstanding + len(jobs) > capacity:
                raise ApiError(429, f"the server is busy ({self._outstanding} requests in its slots and queue)",
                               headers={"Retry-After": "1"})
            self._outstanding += len(jobs)
            self._queue.extend(jobs)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()

    def call(self, fn: Callable[[object], object]) -> Future:
        """Run `fn(model)` on the engine thread between two steps; its result (or exception) in the future."""
        future: Future = Future()
        with self._cond:
            if not self.ready:
                raise ApiError(503, f"model {self.stage}")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def call_in_pieces(self, fn: Callable[[object], Generator]) -> Future:
        """Like `call`, for work done in pieces: the generator `fn(model)` is advanced by one item each turn,
        between two steps (a live move, a unit a turn: a step never waits for a whole move); its return value
        (or exception) in the future. Pieces of a later call wait for the earlier call to end."""
        future: Future = Future()
        with self._cond:
            if not self.ready:
                raise ApiError(503, f"model {self.stage}")
            self._posted_pieces.append((fn, future))
            self._cond.notify()
        return future

    def stop_admitting(self) -> None:
        """SIGTERM: new requests get 503 and queued jobs fail at the engine's next turn; the slots' streams
        finish. (Called from a signal handler: it only sets a flag.)"""
        self.accepting = False

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------------
    def _log(self, message: str) -> None:
        if message.startswith("compiled"):
            self.compiled.append(message.split(" in ")[0].removeprefix("compiled "))
        if self.settings.verbose or message.startswith(("compiled", "cache:", "kv:", "moved", "relocated",
                                                         "warning:")):
            print(f"jitllmd: {message}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        try:
            self.model = self._load(self._log)
            from jitllm.server.prefix_cache import PrefixCache  # (after the model: the engine's modules import TVM)

            self.cache = PrefixCache(self.model.executor, self.settings.cache_sessions, self.settings.cache_bytes)
            self._batching = self.settings.parallel > 1 and batchable(self.model.executor)
            if self._batching:
                compile_ragged(self.model.executor)
        except Exception as e:  # noqa: BLE001 (a load that fails for any reason ends the server in one line)
            self.stage = f"failed: {e}"
            self.on_failure(str(e) if isinstance(e, JitllmError) else f"{type(e).__name__}: {e}")
            return
        self.stage = "ready"
        try:
            self._serve()
        except Exception as e:  # noqa: BLE001 (a bug of the loop itself: say so and end the server, never hang)
            traceback.print_exc(file=sys.stderr)
            self.stage = f"failed: {type(e).__name__}: {e}"
            for slot in self._slots:
                slot.job.deliver(Failed("the engine stopped"))
            self.on_failure(f"the engine stopped: {type(e).__name__}: {e}")
            return
        self.stage = "stopped"

    def _serve(self) -> None:
        """The loop (the module docstring), until `stop`; the slots still busy then are cancelled."""
        while True:
            with self._cond:
                while not (self._stopping or self._calls or self._posted_pieces or self._pieces or self._slots
                           or self._queue):
                    self._cond.wait()
                if self._stopping:
                    break
                calls, self._calls = list(self._calls), deque()
                posted, self._posted_pieces = list(self._posted_pieces), deque()
            for fn, future in calls:
                self._answer(fn, future)
            for fn, future in posted:
                try:
                    self._pieces.append((fn(self.model), future))
                except Exception as e:  # noqa: BLE001 (handed to the handler that asked)
                    future.set_exception(e)
            self._advance_pieces()
            self._resume_spilled()
            self._admit()
            running = [slot for slot in self._slots if slot.spilled is None]
            if self._batching and len(running) > 1:
                self._batched_turn(running)
            else:
                for slot in running:
                    if slot.tokens is None:  # (it was in batched steps until now)
                        self._begin(slot)
                    self._step(slot)
            self.metrics.observe_kv(self.model.executor, self.cache)
        for slot in list(self._slots):
            self._finish(slot, "cancelled")
        while self._pieces:  # (a move under way is finished: all or nothing)
            self._advance_pieces()

    def _advance_pieces(self) -> None:
        """One piece of the oldest work done in pieces; its future is answered when it ends."""
        if not self._pieces:
            return
        pieces, future = self._pieces[0]
        try:
            next(pieces)
            return
        except StopIteration as end:
            future.set_result(end.value)
        except Exception as e:  # noqa: BLE001 (handed to the handler that asked)
            future.set_exception(e)
        self._pieces.popleft()

    def _answer(self, fn: Callable, future: Future) -> None:
        try:
            future.set_result(fn(self.model))
        except Exception as e:  # noqa: BLE001 (handed to the handler that asked)
            future.set_exception(e)

    def _admit(self) -> None:
        if not self.accepting:
            with self._cond:
                waiting, self._queue = list(self._queue), deque()
                self.metrics.queue_depth.set(0)
            for job in waiting:
                self._done(job)
                job.deliver(Failed("the server is shutting down", 503))
        while len(self._slots) < self.settings.parallel and not any(s.spilled is not None for s in self._slots):
            with self._cond:
                if not self._queue:
                    return
                job = self._queue.popleft()
                self.metrics.queue_depth.set(len(self._queue))
            if job.cancelled:
                self._done(job)
                continue
            session, cached = self.cache.acquire(job.prompt)
            sampler = (LogprobSampler(job.sampling, job.top_logprobs) if job.top_logprobs is not None
                       else Sampler(job.sampling))
            self._admissions += 1
            slot = Slot(job, session, cached, sampler, admitted=self._admissions)
            self._slots.append(slot)
            self.metrics.slots_busy.set(len(self._slots))
            self.metrics.prompt_tokens.inc(len(job.prompt))
            self.metrics.cached_tokens.inc(cached)
            self._begin(slot)

    def _begin(self, slot: Slot) -> None:
        """(Re)start the slot's generation after what its session holds."""
        from jitllm.runtime.engine.generation import GenerationStats, generate_ids

        job = slot.job
        ids = job.prompt + slot.generated
        stops = set() if job.ignore_eos else set(self.model.tokenizer.stop_token_ids)
        slot.tokens = generate_ids(self.model.executor, slot.session, ids[slot.session.length:],
                                   job.max_tokens - len(slot.generated), slot.sampler, stops, GenerationStats())

    def _step(self, slot: Slot) -> None:
        if slot.job.cancelled:
            self._finish(slot, "cancelled")
            return
        if slot.session.kv_room <= _history_length(slot):  # (a page boundary: idle sessions give way first)
            self._room(slot, _history_length(slot) + 1, spill=False)
        try:
            token = next(slot.tokens, None)
        except DeviceFault as fault:
            self._fall_back(fault)
            return
        except Exception as e:  # noqa: BLE001 (one request fails; the server goes on)
            if not isinstance(e, JitllmError):
                traceback.print_exc(file=sys.stderr)
            self._fail(slot, str(e))
            return
        if token is None:
            self._finish(slot, "length" if len(slot.generated) >= slot.job.max_tokens else "stop")
            return
        self._deliver(slot, token)

    def _batched_turn(self, running: list[Slot]) -> None:
        """One batched step for every busy slot holding its KV: a slot leaving its batch-1 generation gives
        back what that ran ahead (the last token it delivered is fed again), then each slot feeds what its
        session lacks of its prompt and tokens (scheduler.plan_step: decoding slots first, prompt chunks
        under the budget; `_make_room` where a pool is full); a slot whose history is all in sees its next
        token sampled."""
        from jitllm.runtime.engine.scheduler import SequencePlan, plan_step

        for slot in [s for s in running if s.job.cancelled]:
            self._finish(slot, "cancelled")
            running.remove(slot)
        for slot in running:
            _give_back_ahead(self.model.executor, slot)
        plans = [SequencePlan(i, _history_length(slot), slot.session.length,
                              decoding=bool(slot.generated) and _history_length(slot) - slot.session.length == 1)
                 for i, slot in enumerate(running)]
        page = self.model.executor.layout.block_kinds[0].page_size
        budget, decoding = self.settings.token_budget, sum(p.decoding for p in plans)
        if decoding and self.settings.prefill_stretch:
            budget = min(budget, decoding + self._costs.prompt_room(decoding, self.settings.prefill_stretch, page))
        plan = plan_step(plans, budget, len(plans))
        plan = [(i, _page_aligned(running[i], count, page)) for i, count in plan]
        work = self._make_room([(running[i], _unfed(running[i], count), plans[i].decoding) for i, count in plan])
        if not work:
            return
        ex = self.model.executor
        began = time.perf_counter()
        try:
            logits = ex.batched_forward([(slot.session, ids) for slot, ids in work])
        except DeviceFault as fault:
            self._fall_back(fault)
            return
        except Exception as e:  # noqa: BLE001 (the step's requests fail; the server goes on)
            if not isinstance(e, JitllmError):
                traceback.print_exc(file=sys.stderr)
            for slot, _ in work:
                self._fail(slot, str(e))
            return
        self._costs.observe(sum(len(ids) for _, ids in work), time.perf_counter() - began)
        self.metrics.batched_steps.inc()
        self.metrics.batched_rows.inc(len(work))
        for (slot, _), row in zip(work, logits):
            if slot.session.length < _history_length(slot):
                continue  # (a prompt chunk: more of it next turn)
            token = slot.sampler(row)
            if not slot.job.ignore_eos and token in self.model.tokenizer.stop_token_ids:
                self._finish(slot, "stop")
                continue
            self._deliver(slot, token)
            if len(slot.generated) >= slot.job.max_tokens:
                self._finish(slot, "length")

    def _deliver(self, slot: Slot, token: int) -> None:
        now = time.perf_counter()
        if slot.generated:
            self.metrics.inter_token.observe(now - slot.last_token_at)
        else:
            self.metrics.first_token.observe(now - slot.job.submitted)
        slot.last_token_at = now
        slot.generated.append(token)
        self.metrics.generated_tokens.inc()
        slot.job.deliver(slot.sampler.last if isinstance(slot.sampler, LogprobSampler) else Token(token))

    def _fall_back(self, fault: DeviceFault) -> None:
        """A device failed during some slot's step: every slot stops where it is, that device's units go home
        (only their KV computed again, for every session that held some there), and each slot starts again
        from what its session holds."""
        if self.model.no_gpu_fallback:
            for slot in list(self._slots):
                self._fail(slot, f"{fault} (-no-gpu-fallback is set)")
            return
        for slot in self._slots:
            if slot.tokens is not None:
                _close(slot)
        held = [slot for slot in self._slots if slot.spilled is None]
        report = self.model.fall_back_to_host(fault.device)
        self.metrics.fallbacks.inc()
        self.metrics.recomputed.inc(report.block_positions)
        self._log(f"warning: {fault}; {report.describe()}")
        for slot in held:  # (spilled slots keep their host copy)
            self._begin(slot)

    # -- room in full pools ----------------------------------------------------------------------
    def _make_room(self, work: list[tuple[Slot, list[int], bool]]) -> list[tuple[Slot, list[int]]]:
        """The planned (slot, tokens, decoding) that have pages for this step. A prompt chunk without room
        waits (unless nothing else could run); a decoding slot without room spills the slot admitted last."""
        kept: list[tuple[Slot, list[int]]] = []
        for slot, ids, decoding in work:
            if slot.spilled is None and self._room_or_fail(slot, len(ids), spill=decoding):
                kept.append((slot, ids))
            kept = [(s, i) for s, i in kept if s.spilled is None and s.session.tables]  # (victims leave)
        if not kept and work:
            slot, ids, _ = work[0]
            if slot in self._slots and slot.spilled is None and self._room_or_fail(slot, len(ids), spill=True):
                kept.append((slot, ids))
        return kept

    def _room_or_fail(self, slot: Slot, tokens: int, spill: bool) -> bool:
        try:
            return self._room(slot, slot.session.length + tokens, spill)
        except JitllmError as e:
            self._fail(slot, str(e))
            return False

    def _room(self, slot: Slot, positions: int, spill: bool) -> bool:
        """Pages for `positions` of the slot's session: idle cached sessions are closed first, then (with
        `spill`) the busy slot admitted last is spilled; False where there is still no room."""
        from jitllm.runtime.engine.kv import try_room

        while not try_room(self.model.executor, slot.session, positions):
            if self.cache.discard_idle():
                self.metrics.cache_discards.inc()
                continue
            if not spill:
                return False
            holding = [s for s in self._slots if s is not slot and s.spilled is None and s.session.tables]
            if not holding:
                raise JitllmError(f"the KV of one request ({positions} positions) does not fit the pools: give the "
                                  "devices more KV room or use a shorter context")
            self._spill(max(holding, key=lambda s: s.admitted))
        return True

    def _spill(self, slot: Slot) -> None:
        from jitllm.runtime.engine import spill as spilling

        _give_back_ahead(self.model.executor, slot)
        if slot.session.length == 0:  # (nothing has run: its pages are only given back)
            self.model.executor.reset_session(slot.session)
            return
        slot.spilled = spilling.spill(self.model.executor, slot.session)
        self.metrics.spills.inc()
        self.metrics.spilled_bytes.inc(slot.spilled.nbytes)
        self._log(f"kv: a full pool spilled slot {slot.admitted} ({slot.spilled.positions} positions, "
                  f"{slot.spilled.nbytes / 2**20:.2f} MiB) to the host")

    def _resume_spilled(self) -> None:
        """Spilled slots back into the pools, first spilled first, while there is room (idle cached sessions
        give way); a slot whose history cannot fit even alone fails."""
        from jitllm.runtime.engine import spill as spilling

        for slot in sorted((s for s in self._slots if s.spilled is not None), key=lambda s: s.admitted):
            if slot.job.cancelled:
                self._finish(slot, "cancelled")
                continue
            while not spilling.resume(self.model.executor, slot.session, slot.spilled):
                if self.cache.discard_idle():
                    self.metrics.cache_discards.inc()
                elif any(s.spilled is None and s.session.tables for s in self._slots):
                    return  # (room comes as other slots finish)
                else:
                    self._fail(slot, f"the KV of one request ({slot.spilled.positions} positions) does not fit "
                                     "the pools: give the devices more KV room or use a shorter context")
                    break
            else:
                self.metrics.resumes.inc()
                self._log(f"kv: resumed slot {slot.admitted} from the host ({slot.spilled.positions} positions)")
                slot.spilled = None

    def _finish(self, slot: Slot, reason: str) -> None:
        job = slot.job
        self._release(slot)
        job.deliver(Finished(reason, len(job.prompt), slot.cached, len(slot.generated)))

    def _fail(self, slot: Slot, message: str) -> None:
        self._release(slot)
        slot.job.deliver(Failed(message))

    def _release(self, slot: Slot) -> None:
        _close(slot)
        self._slots.remove(slot)
        self.metrics.slots_busy.set(len(self._slots))
        self.cache.release(slot.session)
        self._done(slot.job)

    def _done(self, job: Job) -> None:
        with self._cond:
            self._outstanding -= 1


def _close(slot: Slot) -> None:
    """End the slot's generator (a pipelined step launched ahead is waited for and not counted)."""
    if slot.tokens is None:
        return
    with contextlib.suppress(DeviceFault):  # (a step launched ahead on a device that failed)
        slot.tokens.close()


def _give_back_ahead(ex, slot: Slot) -> None:
    """End the slot's batch-1 generation and give back what it ran ahead of the tokens delivered (the last one
    delivered is fed again by the next step)."""
    if slot.tokens is not None:
        _close(slot)
        slot.tokens = None
    if slot.session.length >= _history_length(slot):
        ex.truncate_session(slot.session, _history_length(slot) - 1)


def _page_aligned(slot: Slot, count: int, page: int) -> int:
    """A prompt chunk that stops short of the slot's history cut back to end at a page boundary (where that
    leaves some of it): the ragged attention kernels reduce a prompt fed in chunks that end at page boundaries
    exactly as one fed whole, but not one cut mid-page, so a stream's text does not depend on how the token
    budget split its prompt."""
    end = slot.session.length + count
    if end >= _history_length(slot) or end - end % page <= slot.session.length:
        return count
    return end - end % page - slot.session.length


def _history_length(slot: Slot) -> int:
    """Tokens the slot's session must hold before its next token is sampled: its prompt and what it generated."""
    return len(slot.job.prompt) + len(slot.generated)


def _unfed(slot: Slot, count: int) -> list[int]:
    """The first `count` of those its session does not hold yet (without copying its whole history each token)."""
    at, prompt = slot.session.length, slot.job.prompt
    if at >= len(prompt):
        return slot.generated[at - len(prompt):at - len(prompt) + count]
    head = prompt[at:at + count]
    return head + slot.generated[:count - len(head)]


def compile_ragged(executor) -> None:
    """Load (compiling where the cache lacks them) the ragged variants of every unit where it is, before /health
    says ready: otherwise the first turn with two busy slots compiles them while every stream waits (measured on
    SmolLM2 with a cold cache: 18.5 s, one block kind and the head)."""
    from jitllm.runtime.engine.batched import ragged_program

    for unit in (*executor.blocks, executor.head):
        ragged_program(executor, unit)


def batchable(executor) -> bool:
    """Whether the model's units take batched steps (all KV-page blocks, on targets with ragged kernels)."""
    from jitllm.runtime.engine.batched import check_batchable

    try:
        check_batchable(executor)
    except JitllmError:
        return False
    return True
