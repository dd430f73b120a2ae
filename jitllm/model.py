"""The public Python API: open a .jlm on devices (`load`, options as in LoadOptions), generate text, move
blocks while generating; placement helpers mirror the CLI. The CLI and the server call these functions."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator

from jitllm.checked_model import CheckedModel, open_checked
from jitllm.core.errors import DeviceFault, JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.runtime.backends.host import HOST
from jitllm.runtime.device import Device
from jitllm.runtime.engine.executor import Executor
from jitllm.runtime.engine.fast_start import FastStart
from jitllm.runtime.engine.generation import GenerationStats, generate_ids
from jitllm.runtime.engine.migration import MoveReport, fall_back_to_host, move_units, relocate
from jitllm.runtime.engine.rebuild import FallBack
from jitllm.runtime.engine.session import Session
from jitllm.runtime.loading import LoadOptions, open_model
from jitllm.runtime.model_layout import ModelLayout
from jitllm.runtime.placement import Placement, PlacementOption, parse_placement, with_placement
from jitllm.runtime.planner import Plan
from jitllm.runtime.sampling import Sampler, SamplingParams
from jitllm.runtime.seam_tuning import SeamTuner

__all__ = ["Model", "load", "load_with", "LoadOptions", "Placement", "PlacementOption", "parse_placement",
           "with_placement", "SamplingParams"]


@dataclass
class Model:
    path: Path
    file: JlmFile
    layout: ModelLayout
    plan: Plan
    devices: dict[str, Device]
    executor: Executor
    tokenizer: object
    last_stats: GenerationStats = field(default_factory=GenerationStats)
    no_gpu_fallback: bool = False
    move_schedule: dict[int, list[str]] = field(default_factory=dict)
    """Moves to make after the Nth generated token (CLI -move-at): token -> ["SEL=TARGET", ...]."""
    log: Callable[[str], None] | None = None

    def _log(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    grow_queue: list[tuple[int | str, str]] = field(default_factory=list)
    """-gpu-grow: (unit, device) moves still to make, one per generated token."""
    tuner: SeamTuner | None = None
    """-tune-seam: trials of seams while generating."""
    fast_start: FastStart | None = None
    """Background compiles whose units start on ONNX Runtime (LoadOptions.fast_start), polled per token."""
    context_filled: bool = False
    """Whether the last generation stopped because the context had no room for another token."""

    def _scheduled_moves(self, produced: int) -> list[MoveReport]:
        reports: list[MoveReport] = []
        if self.fast_start is not None:
            self.fast_start.poll()  # (moves units whose artifacts landed; it says so itself, in one line)
        for spec in self.move_schedule.get(produced, []):
            reports += move_units(self, spec)
        if self.grow_queue:
            index, device = self.grow_queue.pop(0)
            reports += move_units(self, f"{index}={device}")
        elif self.tuner is not None:
            reports += self.tuner.after_token(self)
        return reports

    def relocate_from(self, device: Device, error: Exception) -> None:
        """-relocate: the device cannot grow the context; hand its last unpinned block to the host."""
        report = relocate(self.executor, self.plan, device, self.devices[HOST], error)
        self._log("relocated: " + report.describe())

    def new_session(self) -> Session:
        return self.executor.new_session()

    def move(self, blocks: str, target: str) -> list[MoveReport]:
        """Move blocks (a selector: `8`, `8-15`, `head`, `*`) to `target` (`host` or a device) between two
        steps, with every live session's KV pages. All or nothing: on any error nothing has moved."""
        return move_units(self, f"{blocks}={target}")

    def fall_back_to_host(self, failed: str | None = None) -> FallBack:
        """Bring units home after a device failure (those on the device named `failed`, else every unit
        away from the host), computing again only their KV for the sessions that held some there."""
        return fall_back_to_host(self.executor, self.devices[HOST], failed)

    def encode_prompt(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return self.tokenizer.encode_chat(messages)
        return self.tokenizer.encode(prompt)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
                 chat: bool = False, system: str | None = None, session: Session | None = None) -> Iterator[str]:
        """Stream the answer as text pieces; statistics land in `last_stats`."""
        ids = prompt if isinstance(prompt, list) else self.encode_prompt(prompt, chat, system)
        decoder = self.tokenizer.stream()
        for token in self.generate_tokens(ids, max_tokens, sampling, session):
            piece = decoder.push(token)
            if piece:
                yield piece

    def generate_ids(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams = SamplingParams(0.0),
                     session: Session | None = None) -> list[int]:
        return list(self.generate_tokens(prompt_ids, max_tokens, sampling, session))

    def generate_tokens(self, ids: list[int], max_tokens: int, sampling: SamplingParams,
                        session: Session | None = None) -> Iterator[int]:
        """Token ids as they are sampled, with scheduled moves between steps and, after a device
        failure, the rest finished on the host (unless no_gpu_fallback). Generation ends where the context
        does (`max_tokens` is clamped to it, as llama.cpp does; `context_filled` then says so); only a prompt
        that does not fit is an error."""
        if not ids:
            raise JitllmError("the prompt is empty")
        held = len(ids) + (session.length if session else 0)
        if held > self.executor.ctx:
            raise JitllmError(f"prompt of {len(ids)} tokens is longer than the context of {self.executor.ctx}")
        room = self.executor.ctx - held + 1  # (the last token is picked, never fed)
        self.context_filled = False
        own = session is None
        session = session or self.new_session()
        self.last_stats = stats = GenerationStats()
        sampler = Sampler(sampling)
        stops = set(self.tokenizer.stop_token_ids)
        generated: list[int] = []
        history = len(session.tokens)
        try:
            while True:
                try:  # (after a fall-back the session holds what was fed before the fault: the rest is fed)
                    for token in generate_ids(self.executor, session, (ids + generated)[session.length - history:],
                                              min(max_tokens, room) - len(generated), sampler, stops, stats):
                        generated.append(token)
                        yield token
                        for report in self._scheduled_moves(len(generated)):
                            self._log(report.describe())
                    self.context_filled = len(generated) == room < max_tokens
                    return
                except DeviceFault as fault:
                    if self.no_gpu_fallback:
                        raise JitllmError(f"{fault} (-no-gpu-fallback is set)") from None
                    report = self.fall_back_to_host(fault.device)
                    self._log(f"warning: {fault}; finishing on the CPU: {report.describe()}")
        finally:
            if own:
                self.executor.close_session(session)


def load(path: str | Path, **options) -> Model:
    """Open a .jlm on devices: `options` are LoadOptions' fields (devices="auto", ctx, cpu_kernels, ...)."""
    unknown = set(options) - {f.name for f in fields(LoadOptions)}
    if unknown:
        raise TypeError(f"load() got unknown options: {', '.join(sorted(unknown))}")
    if "extra_devices" in options:
        options["extra_devices"] = tuple(options["extra_devices"] or ())
    return load_with(path, LoadOptions(**options))


def load_with(source: str | Path | CheckedModel, options: LoadOptions) -> Model:
    """Open a .jlm (its whole header checked first, before anything compiles: jitllm.checked_model), plan
    where each block runs, upload weights and load (or compile) the artifacts."""
    checked = source if isinstance(source, CheckedModel) else open_checked(source)
    opened = open_model(checked.file, checked.layout, options)
    model = Model(checked.file.path, opened.file, opened.layout, opened.plan, opened.devices, opened.executor,
                  checked.tokenizer, no_gpu_fallback=options.no_gpu_fallback, log=options.log,
                  grow_queue=opened.grow_queue, fast_start=opened.fast_start)
    if options.relocate:
        opened.executor.relocate = model.relocate_from
    if options.tune_seam:
        model.tuner = seam_tuner(opened.plan)
    return model


def seam_tuner(the_plan: Plan) -> SeamTuner | None:
    """A tuner over the engine's device blocks of the first device (None when no block is on a device;
    streamed blocks are left streaming)."""
    device_blocks = [i for i, a in enumerate(the_plan.blocks) if a.device != HOST and not a.pinned and not a.streamed]
    if not device_blocks:
        return None
    device = the_plan.blocks[device_blocks[0]].device
    return SeamTuner(device, [i for i in device_blocks if the_plan.blocks[i].device == device])
