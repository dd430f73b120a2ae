"""Options shared by the verbs: the `-name`/`--name` style, the sampling flags, those of the verbs that load
and place a model (run, speed, verify), and the checks of what users type (finite numbers, UTF-8 text, a
model path that is a regular file). The verbs import from here, never from jitllm.cli (which imports them)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import click

if TYPE_CHECKING:
    from jitllm.checked_model import CheckedModel

WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
"""jitllm.core.layouts.WEIGHT_TYPES (the -wtype choices), repeated so --help needs no import
(tests/test_architecture.py checks them)."""
KV_TYPES = ("f32", "f16", "q8_0")
"""jitllm.ir.config.KV_DTYPES' keys (the -ctk/-ctv values), repeated so --help needs no import
(tests/test_architecture.py checks them)."""


def opt(name: str, *args, **kwargs):
    """An option that answers to both the seed style `-name` and `--name`."""
    return click.option(f"-{name}", f"--{name}", *args, **kwargs)


class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses nan and inf (nan compares false with any bound, so a range lets it by)."""

    def convert(self, value, param, ctx):  # type: ignore[override]
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


class Utf8Text(click.ParamType):
    """Text that is valid UTF-8 (the shell passes bytes; Python keeps undecodable ones as lone surrogates)."""

    name = "text"

    def convert(self, value, param, ctx):  # type: ignore[override]
        problem = utf8_problem(value)
        if problem:
            self.fail(f"not valid UTF-8 text ({problem})", param, ctx)
        return value


class TextCommand(click.Command):
    """A verb whose arguments take free text (a prompt): an unknown option there may be text that begins
    with '-' (the CLI then says how to pass it)."""


def utf8_problem(text: str) -> str | None:
    """Where `text` is not valid UTF-8 (None where it is): the first byte that did not decode (Python keeps
    it as a surrogate U+DC80..U+DCFF), or any other lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        return f"{byte} at character {e.start}"
    return None


def checked_text(text: str, what: str) -> str:
    """`text` where it is valid UTF-8; else a UsageError naming `what`."""
    problem = utf8_problem(text)
    if problem:
        raise click.UsageError(f"{what} is not valid UTF-8 text ({problem})")
    return text


def regular_file(path: str) -> str:
    """`path` where it names a regular file (links followed): opening a FIFO would wait for a writer for ever,
    and a device would be read as if it were the file."""
    from jitllm.core.paths import special_kind

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise click.UsageError(f"model file not found: {path}") from None
    except OSError as e:
        raise click.UsageError(f"cannot read {path}: {e.strerror or e}") from None
    kind = special_kind(mode)
    if kind is not None:
        raise click.UsageError(f"{path} is {kind}, not a model file")
    return path


def read_text(path: str, label: str) -> str:
    """The UTF-8 text of the file at `path` (`-`: standard input); a UsageError naming `label` (the option or
    argument it came from) where it cannot be read or is not UTF-8."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise click.UsageError(f"{label} {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.UsageError(f"{label} {path}: not valid UTF-8 text (byte 0x{data[e.start]:02x} at byte "
                               f"{e.start})") from None


def sampling_options(func):
    """-temp, -top-k, -top-p, -seed (run and chat)."""
    decorators = [
        opt("temp", "temperature", type=FiniteFloat(min=0.0), default=0.8, show_default=True, help="0 = greedy"),
        opt("top-k", "top_k", type=click.IntRange(min=0), default=40, show_default=True, help="0 = whole vocabulary"),
        opt("top-p", "top_p", type=FiniteFloat(min=0.0, max=1.0), default=0.95, show_default=True),
        opt("seed", type=click.IntRange(min=-1), default=-1, show_default=True,
            callback=lambda ctx, param, value: None if value == -1 else value,
            help="sampling seed: N gives reproducible runs, -1 a random seed each run (as llama.cpp)"),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def placement_options(func=None, *, devices: str = "auto"):
    """-devices, -vram, -placement, -placement-strict, -gpu-layers, -ctx, -ctk/-ctv, -cache, -threads, -v (`devices`: the
    default of -devices; `@placement_options` or `@placement_options(devices="cpu")`)."""
    if func is None:
        return lambda f: placement_options(f, devices=devices)
    decorators = [
        opt("devices", default=devices, show_default=True, help="auto|all|cpu|gpu[:N]|cuda[:ORD]|vulkan[:SEL]|metal, =BYTES each"),
        opt("vram", default=None, help="one weight budget for every device (3G, 512M, bytes)"),
        opt("cluster", default=None, help="join a Ray cluster (host:port or auto): -devices then takes NODE/DEVICE"),
        opt("placement", default=None, help="SEL=TARGET[!|~],... (N, A-B, head, *; host or a device)"),
        opt("placement-strict", "placement_strict", is_flag=True, help="the map is all or nothing"),
        opt("gpu-layers", "gpu_layers", type=click.IntRange(min=0), default=None, help="cap the blocks offered to devices"),
        opt("ctx", type=click.IntRange(min=1), default=None, help="context length (default 4096, at most the model's)"),
        opt("ctk", "cache_type_k", type=click.Choice(KV_TYPES), default="f16", show_default=True,
            help="KV cache type of K (as llama.cpp's; f32 on devices that lack it; q8_0: head dims multiple of 32)"),
        opt("ctv", "cache_type_v", type=click.Choice(KV_TYPES), default="f16", show_default=True,
            help="KV cache type of V (equal to -ctk for now)"),
        opt("cache", "cache_dir", default=None, help="compiled-artifact cache directory (default ./cache or $JITLLM_CACHE_DIR)"),
        opt("no-gpu-fallback", "no_gpu_fallback", is_flag=True, help="fail instead of finishing on the CPU when a device breaks"),
        opt("cpu-kernels", "cpu_kernels", type=click.Choice(["fast", "exact"]), default="fast", show_default=True,
            help="host kernels: fast = int8-quantized activations, exact = f32 activations"),
        opt("gpu-kernels", "gpu_kernels", type=click.Choice(["fast", "exact"]), default="fast", show_default=True,
            help="GPU decode matvecs over quantized weights: fast = int8 activations (dp4a), exact = f32"),
        click.option("-relocate/-no-relocate", "--relocate/--no-relocate", "relocate", default=True, show_default=True,
                     help="when a device cannot grow the context, hand its last block to the host"),
        opt("threads", type=click.IntRange(min=1), default=None,
            help="CPU workers (default: one per physical performance core in the CPU mask, or $TVM_NUM_THREADS)"),
        opt("gpu-grow", "gpu_grow", is_flag=True, help="start on the CPU, move one block per token onto the devices"),
        opt("tune-seam", "tune_seam", is_flag=True, help="time runs of tokens at different seams, keep the fastest"),
        opt("v", "verbose", is_flag=True, help="print the placement plan"),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def open_model(model_path: str | None) -> CheckedModel:
    """The model file opened with its header checked (jitllm.checked_model, no TVM import), the built-in
    default converted first where `model_path` is None."""
    from jitllm.checked_model import open_checked

    if model_path is None:
        from jitllm.default_model import default_model_path

        model_path = str(default_model_path())
    regular_file(model_path)
    return open_checked(model_path)


FAST_START_HELP = ("compile the CPU's missing artifacts before the first token (default: start on ONNX Runtime, "
                   "move to them as they compile)")


def load_model(model_path: str | CheckedModel | None, flags: dict, log: Callable[[str], None] | None = None,
               **overrides):
    """Load (converting the built-in default when `model_path` is None; `model_path` may be what `open_model`
    gave) and report on stderr, or through `log` where given (then -v's plan goes there too). `flags`: the
    values of `placement_options` by name, `overrides` what a verb sets itself."""
    from jitllm.checked_model import CheckedModel

    f = {**flags, **overrides}
    if f["vram"] is not None and f["devices"].strip().lower() == "cpu":
        raise click.UsageError(f"-vram {f['vram']}: -devices cpu uses no device to budget (leave -vram out)")
    kv_type = kv_cache_type(f["cache_type_k"], f["cache_type_v"])
    # (a bad file fails here, before the imports below bring TVM in)
    checked = model_path if isinstance(model_path, CheckedModel) else open_model(model_path)
    from jitllm.core.lean_imports import importing_tvm

    with importing_tvm():
        from jitllm.lowering.cache import stderr_log
        from jitllm.model import LoadOptions, load_with, with_placement

    option = with_placement(f["placement"], strict=f["placement_strict"]) if f["placement"] else None
    options = LoadOptions(
        devices=f["devices"], vram=f["vram"], placement=option, gpu_layers=f["gpu_layers"], ctx=f["ctx"],
        cache_dir=f["cache_dir"] or os.environ.get("JITLLM_CACHE_DIR"),
        log=log or (stderr_log if f["verbose"] else _compile_log),
        no_gpu_fallback=f["no_gpu_fallback"], cpu_kernels=f["cpu_kernels"], gpu_kernels=f["gpu_kernels"],
        relocate=f["relocate"], gpu_grow=f["gpu_grow"], tune_seam=f["tune_seam"], threads=f["threads"],
        cluster=f.get("cluster"), kv_type=kv_type, fast_start=f.get("fast_start", False))
    return load_with(checked, options)


def kv_cache_type(k: str, v: str) -> str:
    """The one KV type of -ctk and -ctv (a usage error where they differ)."""
    if k != v:
        raise click.UsageError(f"-ctk {k} and -ctv {v} differ: K and V share one cache type for now")
    return k


def finish_answer(model, reused: int | None = None) -> None:
    """After an answer streamed to stdout: its line ended, a note where the context's end stopped it
    (Model.context_filled), and the prefill/decode figures on stderr (`reused`: chat's tokens kept)."""
    sys.stdout.write("\n")
    sys.stdout.flush()
    ex = model.executor
    if model.context_filled:
        longer = (f"-ctx gives up to the model's {ex.layout.config.context}" if ex.ctx < ex.layout.config.context
                  else "the model's own")
        click.echo(f"jitllm: the context of {ex.ctx} tokens is full: generation stopped there ({longer})", err=True)
    s = model.last_stats
    kept = "" if reused is None else f" ({reused} reused)"
    click.echo(f"jitllm: prefill {s.prompt_tokens} tokens{kept} at {s.prefill_tps:.1f} tok/s, "
               f"decode {s.generated_tokens} tokens at {s.decode_tps:.1f} tok/s", err=True)
    for pool in ex.streams.values():
        if pool.members:
            click.echo(f"jitllm: streamed {pool.describe()}", err=True)
        if pool.experts is not None:
            click.echo(f"jitllm: experts streamed {pool.experts.describe()}", err=True)


def _compile_log(message: str) -> None:
    """Without -v, the plan stays quiet; compile, cache, move and fallback events still reach stderr."""
    if message.startswith(("compiled", "compiling", "fast start", "cache:", "moved", "relocated", "tune-seam", "warning:")):
        click.echo(f"jitllm: {message}", err=True)
