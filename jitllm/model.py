"""The public Python API: load a .jlm onto devices, generate text; placement helpers mirror the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from jitllm.core.errors import DeviceFault, JitllmError
from jitllm.core.jlm import JlmFile
from jitllm.ir.block_type import KV_PAGES
from jitllm.runtime.backends.buffer_pool import pool_from_env
from jitllm.runtime.backends.host import HOST, host_device
from jitllm.runtime.device import Device
from jitllm.runtime.executor import Executor, Session
from jitllm.runtime.generation import GenerationStats, generate_ids
from jitllm.runtime.migration import MoveReport, move_unit, move_units
from jitllm.runtime.model_layout import HEAD, ModelLayout
from jitllm.runtime.placement import Placement, PlacementOption, parse_placement, with_placement
from jitllm.runtime.planner import Plan, plan
from jitllm.runtime.sampling import Sampler, SamplingParams
from jitllm.runtime.seam_tuning import SeamTuner

__all__ = ["Model", "load", "Placement", "PlacementOption", "parse_placement", "with_placement", "SamplingParams"]

DEFAULT_CTX = 4096


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

    def _scheduled_moves(self, produced: int) -> list[MoveReport]:
        reports: list[MoveReport] = []
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
        candidates = [u for u in self.executor.blocks if u.device is device and not self.plan.blocks[u.index].pinned]
        candidates = [u for u in candidates if u.state == KV_PAGES] or candidates  # (blocks that hold pages)
        if not candidates:
            raise JitllmError(f"{device.name}: the context cannot grow ({error}) and every block there is pinned")
        report = move_unit(self.executor, candidates[-1].index, self.devices[HOST])
        self._log("relocated: " + report.describe())

    def new_session(self) -> Session:
        return self.executor.new_session()

    def move(self, blocks: str, target: str) -> list[MoveReport]:
        """Move blocks (a selector: `8`, `8-15`, `head`, `*`) to `target` (`host` or a device) between two
        steps, with every live session's KV pages. All or nothing: on any error nothing has moved."""
        return move_units(self, f"{blocks}={target}")

    def fall_back_to_host(self) -> list[str]:
        """Bring every unit home after a device failure, dropping KV held on devices (recomputed later)."""
        host = self.devices[HOST]
        moved = []
        for unit in [*self.executor.blocks, self.executor.head]:
            if unit.device is not host:
                for session in self.executor.sessions.values():
                    self.executor.reset_session(session)
                moved.append(unit.device.name)
                unit.device.release(unit.nbytes)
                host.reserve(unit.nbytes, "weights")
                unit.kind = self.executor.kind_on(unit.index, host)
                unit.weights = self.executor.upload_weights(unit.index, host)
                unit.program, unit.decode_program = self.executor.programs(unit.kind, host)
                unit.device = host
        self.executor.drop_graphs()  # (and the segments: every unit is home)
        return sorted(set(moved))

    def encode_prompt(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special=False)
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
        failure, the rest finished on the host (unless no_gpu_fallback)."""
        if not ids:
            raise JitllmError("the prompt is empty")
        if len(ids) + (session.length if session else 0) > self.executor.ctx:
            raise JitllmError(f"prompt of {len(ids)} tokens is longer than the context of {self.executor.ctx}")
        own = session is None
        session = session or self.new_session()
        self.last_stats = stats = GenerationStats()
        sampler = Sampler(sampling)
        stops = set(self.tokenizer.stop_token_ids)
        generated: list[int] = []
        try:
            while True:
                try:
                    for token in generate_ids(self.executor, session, ids + generated, max_tokens - len(generated),
                                              sampler, stops, stats):
                        generated.append(token)
                        yield token
                        for report in self._scheduled_moves(len(generated)):
                            self._log(report.describe())
                    return
                except DeviceFault as fault:
                    if self.no_gpu_fallback:
                        raise JitllmError(f"{fault} (-no-gpu-fallback is set)") from None
                    self._log(f"warning: {fault}; finishing on the CPU")
                    self.fall_back_to_host()
                    self.executor.reset_session(session)
        finally:
            if own:
                self.executor.close_session(session)


def load(path: str | Path, devices: str = "auto", vram: str | None = None,
         placement: PlacementOption | Placement | str | None = None, gpu_layers: int | None = None,
         ctx: int | None = None, cache_dir: str | Path | None = None,
         log: Callable[[str], None] | None = None, no_gpu_fallback: bool = False,
         extra_devices: list[Device] | None = None, cpu_kernels: str = "fast", relocate: bool = True,
         gpu_grow: bool = False, tune_seam: bool = False, gpu_kernels: str = "fast") -> Model:
    """Open a .jlm, plan where each block runs, upload weights and load (or compile) the artifacts.

    `extra_devices` attaches devices the planner does not use but moves may target (e.g. simulated
    devices standing in for missing hardware). `cpu_kernels` picks the host's kernel family: "fast"
    (int8-quantized activations, llama.cpp's trick) or "exact" (f32 activations); `gpu_kernels` the same
    for the GPUs' decode matvecs over quantized weights (jitllm.lowering.targets.cuda.CudaTarget). `relocate`: when a
    device cannot grow the context, hand its last block to the host instead of failing. `gpu_grow`:
    start on the host and move one block per generated token to where the plan puts it. `tune_seam`:
    time a few seams while generating and keep the fastest (see runtime/seam_tuning.py)."""
    from jitllm.runtime.backends import link_peers, make_device
    from jitllm.runtime.device_spec import parse_devices
    from jitllm.tokenizer import Tokenizer

    file = JlmFile(path)
    layout = ModelLayout.from_file(file)
    tokenizer = Tokenizer.from_header(file.header)
    choices = []
    if devices.strip().lower() != "cpu":
        from jitllm.runtime.inventory import detect_inventory

        choices = parse_devices(devices, detect_inventory(), vram)
    option = placement if isinstance(placement, PlacementOption) or placement is None else with_placement(placement)
    if option is not None:
        option.placement.validate(layout.config.num_blocks, {a for c in choices for a in c.aliases} | {HOST})
    block_bytes = [layout.unit_bytes(file, i) for i in range(layout.config.num_blocks)]
    the_plan = plan(block_bytes, layout.unit_bytes(file, HEAD), choices,
                    option.placement if option else None, gpu_layers, option.strict if option else False, host_name=HOST)
    if log:
        log(the_plan.describe())
    devs: dict[str, Device] = {HOST: host_device(cpu_kernels)}
    for choice in choices:
        devs[choice.name] = make_device(choice, cpu_kernels, gpu_kernels)
    for extra in extra_devices or []:
        devs[extra.name.lower()] = extra
    devs[HOST].allocator = next((d.host_allocator for d in devs.values() if d.host_allocator is not None), None)
    if devs[HOST].allocator is not None:  # page-locked: weights leaving the host are kept for the next to arrive
        devs[HOST].weight_pool = pool_from_env()
    linked = link_peers(list(devs.values()))
    if log and linked is not None:
        log("peer access: " + (", ".join(f"{a} -> {b}" for a, b in linked) or "none (copies between cards go through the host)"))
    where = {i: devs[the_plan.device_of(i)] for i in range(layout.config.num_blocks)}
    where[HEAD] = devs[the_plan.head.device]
    grow: list[tuple[int | str, str]] = []
    if gpu_grow:
        for index, assignment in [*enumerate(the_plan.blocks), (HEAD, the_plan.head)]:
            if assignment.device != HOST and not assignment.pinned:
                grow.append((index, assignment.device))
                where[index] = devs[HOST]
    context = min(ctx or DEFAULT_CTX, layout.config.context)
    if context < 1:
        raise JitllmError(f"context must be at least 1 token (got {ctx})")
    executor = Executor(file, layout, where, context, cache_dir=Path(cache_dir) if cache_dir else None, log=log)
    model = Model(Path(path), file, layout, the_plan, devs, executor, tokenizer, no_gpu_fallback=no_gpu_fallback,
                  log=log, grow_queue=grow)
    if relocate:
        executor.relocate = model.relocate_from
    if tune_seam:
        model.tuner = seam_tuner(the_plan)
    return model


def seam_tuner(the_plan: Plan) -> SeamTuner | None:
    """A tuner over the engine's device blocks of the first device (None when no block is on a device)."""
    device_blocks = [i for i, a in enumerate(the_plan.blocks) if a.device != HOST and not a.pinned]
    if not device_blocks:
        return None
    device = the_plan.blocks[device_blocks[0]].device
    return SeamTuner(device, [i for i in device_blocks if the_plan.blocks[i].device == device])
