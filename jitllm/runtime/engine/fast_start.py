"""A fast first run (docs/performance.md, "First run and warm start"): the units placed on the host whose
llvm artifacts the cache lacks start on an ONNX Runtime device, whose artifact is the block's graph itself
(nothing to compile), while the missing artifacts compile in background processes (lowering/cache.py
`compile_in_background`), decode variants first. Between two decode steps the generation loop polls them
(`FastStart.poll`, on the engine's own thread: nothing else touches the executor) and moves every unit
whose artifacts have all landed to the host, KV and all (migration.move_unit, the move -gpu-grow makes).
A compile that fails leaves its units on ONNX Runtime, said in one line; ending the process (Ctrl-C,
SIGTERM, an error) kills the compiles and removes what they had half written."""

from __future__ import annotations

import atexit
import os
import time
import weakref
from typing import Callable

from jitllm.core.errors import JitllmError
from jitllm.ir.config import BlockKind
from jitllm.lowering.cache import BackgroundCompile, compile_in_background, compiles_in_background, is_cached
from jitllm.lowering.targets.onnxruntime import OnnxRuntimeTarget
from jitllm.runtime.device import Device
from jitllm.runtime.engine.migration import move_unit
from jitllm.runtime.engine.units import kind_on
from jitllm.runtime.model_layout import HEAD, ModelLayout

Log = Callable[[str], None]


class FastStart:
    """The background compiles of one opened model and the units waiting on them (`start_fast`)."""

    def __init__(self, home: Device, away: Device, needs: dict[int | str, tuple[BlockKind, ...]],
                 cache_dir, parallel: int, log: Log | None) -> None:
        self.home, self.away, self.cache_dir, self.parallel, self.log = home, away, cache_dir, parallel, log
        self.needs = needs
        """Unit -> the artifacts it waits for before it moves home."""
        self.waiting: list[BlockKind] = _compile_order(needs)
        self.total = len(self.waiting)
        self.running: list[BackgroundCompile] = []
        self.landed: set[BlockKind] = set()
        self.failed: set[BlockKind] = set()
        self.executor = None
        ref = weakref.ref(self)
        atexit.register(lambda: (lambda fast: fast and fast.close())(ref()))
        self._start()

    @property
    def done(self) -> bool:
        """Nothing is compiling or waiting to."""
        return not self.waiting and not self.running

    def poll(self) -> None:
        """Between two steps: take the compiles that ended, start the next, move the units now ready."""
        for compile_ in [c for c in self.running if c.child.poll()]:
            self._ended(compile_)
        self._start()
        self._move_ready()

    def finish(self) -> None:
        """Wait for the compiles left (the run is over: its artifacts are for the next one)."""
        if self.done:
            return
        self._say(f"compiling: finishing {len(self.running) + len(self.waiting)} artifact(s) for the next run "
                  "(Ctrl-C stops them)")
        while self.running:
            compile_ = self.running[0]
            try:
                compile_.child.wait()
            except JitllmError:
                pass  # (_ended says so)
            self._ended(compile_)
            self._start()

    def close(self) -> None:
        """Stop the compiles still running (their half-written directories removed); nothing more starts."""
        self.waiting.clear()
        while self.running:
            self.running.pop().stop()

    def _start(self) -> None:
        while self.waiting and len(self.running) < self.parallel:
            kind = self.waiting.pop(0)
            number = self.total - len(self.waiting)
            self._say(f"compiling {_name(kind)} for {self.home.target.name} in the background [{number}/{self.total}]")
            self.running.append(compile_in_background(kind, self.home.target, self.cache_dir))

    def _ended(self, compile_: BackgroundCompile) -> None:
        self.running.remove(compile_)
        seconds = time.perf_counter() - compile_.started
        if compile_.child.error is None:
            self.landed.add(compile_.kind)
            self._say(f"compiled {_name(compile_.kind)} for {self.home.target.name} in {seconds:.1f}s (background)")
            return
        self.failed.add(compile_.kind)
        stay = [i for i, kinds in self.needs.items() if compile_.kind in kinds]
        for index in stay:
            del self.needs[index]
        wanted = {k for kinds in self.needs.values() for k in kinds}
        self.waiting = [k for k in self.waiting if k in wanted]  # (what only those units needed is not compiled)
        if not stay:
            return  # (another of their kinds failed first and said so)
        self._say(f"warning: the background compile of {_name(compile_.kind)} failed ({compile_.child.error}); "
                  f"{_units(stay)} stay on ONNX Runtime")

    def _move_ready(self) -> None:
        if self.executor is None:
            return
        moved, seconds = [], 0.0
        for index, kinds in list(self.needs.items()):
            if self.landed.issuperset(kinds):
                del self.needs[index]
                if self.executor.unit(index).device is not self.away:
                    continue  # (moved elsewhere meanwhile: -move-at, -gpu-grow)
                try:
                    seconds += move_unit(self.executor, index, self.home).seconds
                except JitllmError as e:
                    self._say(f"warning: {_units([index])} stay on ONNX Runtime ({e})")
                    continue
                moved.append(index)
        if moved:
            self._say(f"moved {_units(moved)} {self.away.name} -> {self.home.name} in {seconds * 1e3:.1f} ms "
                      "(their artifacts landed)")

    def _say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)


def start_fast(layout: ModelLayout, where: dict[int | str, Device], home: Device, away: Device | None,
               cache_dir, workers: int, log: Log | None) -> FastStart | None:
    """Where units placed on `home` lack artifacts that can compile in the background: start those
    compiles, and place the units on `away` (an ONNX Runtime device; made here where None) in `where`
    meanwhile. None (and `where` unchanged) where every artifact is cached or no fast start is possible."""
    target = home.target
    if not compiles_in_background(target, cache_dir):
        return None
    cached: dict[BlockKind, bool] = {}
    needs: dict[int | str, tuple[BlockKind, ...]] = {}
    for index, device in where.items():
        if device is not home:
            continue
        kind = kind_on(layout, index, home)
        kinds = (kind.decode_variant(), kind) if target.caps.decode_variants else (kind,)
        missing = tuple(k for k in kinds if not cached.setdefault(k, is_cached(k, target, cache_dir)))
        if missing:
            needs[index] = missing
    if not needs:
        return None
    if away is None:
        try:
            from jitllm.runtime.backends.ort import OrtBackend

            away = Device("ort", OrtBackend("cpu", 0, "ort"), OnnxRuntimeTarget(), None)
        except JitllmError as e:  # (no ONNX Runtime: compile before the first token, as without fast start)
            if log:
                log(f"fast start: off ({e}); compiling before the first token")
            return None
    for index in needs:
        where[index] = away
    parallel = max(1, len(os.sched_getaffinity(0)) - workers)
    if log:
        log(f"compiling: {_units(list(needs))} start on ONNX Runtime and move to {home.name} as their "
            f"{target.name} artifacts compile ({parallel} at a time; -no-fast-start waits for them instead)")
    return FastStart(home, away, needs, cache_dir, parallel, log)


def _compile_order(needs: dict[int | str, tuple[BlockKind, ...]]) -> list[BlockKind]:
    """Each kind once, the units' order (blocks, then the head), each unit's decode variant before its
    general kind: the steps after the first token are decode steps."""
    order: list[BlockKind] = []
    for kinds in needs.values():
        order += [k for k in kinds if k not in order]
    return order


def _name(kind: BlockKind) -> str:
    return f"{kind.kind} (decode)" if kind.decode else kind.kind


def _units(indices: list[int | str]) -> str:
    """`blocks 0-29 and the head`, `block 3`, `the head`."""
    blocks = sorted(i for i in indices if i != HEAD)
    runs: list[str] = []
    for i in blocks:
        if runs and runs[-1].split("-")[-1] == str(i - 1):
            runs[-1] = f"{runs[-1].split('-')[0]}-{i}"
        else:
            runs.append(str(i))
    words = [f"block{'s' if len(blocks) > 1 else ''} {', '.join(runs)}"] if blocks else []
    return " and ".join(words + (["the head"] if HEAD in indices else []))
