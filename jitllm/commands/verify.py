"""`jitllm verify -devices DEV [-n N] [MODEL] [PROMPT]`: host vs device logits, position by position."""

from __future__ import annotations

import click

from jitllm.commands.common import FiniteFloat, TextCommand, checked_text, load_model, opt, placement_options

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time,"


@click.command(cls=TextCommand)
@click.argument("args", nargs=-1, metavar="[MODEL] [PROMPT]")
@opt("n", "steps", type=click.IntRange(min=1), default=32, show_default=True, help="positions to compare")
@opt("tol", type=FiniteFloat(min=0.0), default=None,
     help="report differences above this; 10x it is an error (default 0.01; 0.25 when fast kernels, host or GPU, "
          "are compared with exact ones: int8 activations move logits by up to ~2 on SmolLM2, docs/performance.md)")
@opt("ref-kernels", "ref_kernels", type=click.Choice(["fast", "exact"]), default="exact", show_default=True,
     help="host kernels of the reference side")
@placement_options
def verify(args, steps, tol, ref_kernels, **flags) -> None:
    """Run the same tokens on the host and on -devices; report every position where the logits part.

    `-devices cpu -cpu-kernels fast` compares the fast host kernels with the exact reference."""
    from jitllm.verify import verify as run_verify

    if len(args) > 2:
        raise click.UsageError(f"expected [MODEL] [PROMPT], got {len(args)} arguments")
    model_path = args[0] if args else None
    prompt = checked_text(args[1], "the prompt") if len(args) > 1 else DEFAULT_PROMPT
    device_model = load_model(model_path, flags, no_gpu_fallback=True, gpu_grow=False, tune_seam=False)
    host_model = load_model(model_path, flags, devices="cpu", vram=None, placement=None, gpu_layers=None,
                            no_gpu_fallback=True, cpu_kernels=ref_kernels, gpu_kernels=ref_kernels, relocate=True,
                            gpu_grow=False, tune_seam=False, verbose=False)
    cpu_kernels, gpu_kernels = flags["cpu_kernels"], flags["gpu_kernels"]
    ids = host_model.tokenizer.encode(prompt)
    where = sorted({u.device.name for u in [*device_model.executor.blocks, device_model.executor.head]})
    if tol is None:
        fast = "host" in where and cpu_kernels != ref_kernels or where != ["host"] and gpu_kernels != ref_kernels
        tol = 0.25 if fast else 1e-2
    report = run_verify(host_model, device_model, ids, steps, tol)
    kernels = [f"{cpu_kernels} host kernels"] * ("host" in where) + [f"{gpu_kernels} GPU kernels"] * (where != ["host"])
    sides = f"host ({ref_kernels} kernels) vs {', '.join(where)} ({', '.join(kernels)})"
    click.echo(f"compared {report.checked} positions, {sides}; max |dlogit| {report.max_diff:.3g} (tol {tol:g})")
    for p in report.positions:
        click.echo(f"  position {p.index}: max |dlogit| {p.max_diff:.3g}, top-1 host {p.host_top1} / device "
                   f"{p.device_top1}, host margin {p.host_margin:.3g}: {p.verdict}")
    if report.errors:
        click.echo(f"jitllm: error: {len(report.errors)} positions differ beyond a near-tie", err=True)
        raise SystemExit(1)
    click.echo("ok: no difference beyond near-ties")
