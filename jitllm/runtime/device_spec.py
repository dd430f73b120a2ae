"""The -devices grammar, parsed in one place for every command, and the memory budget of each device.

    auto | all | cpu | gpu[:N] | cuda[:ORD] | vulkan[:SEL] | metal     (comma-separated, each =BYTES)

and, with -cluster, NODE/DEVICE (`node2/cpu`, `node2/cuda:0`: a device of another node, NODE its name or
a node id prefix; jitllm.runtime.cluster.nodes),

and ONNX Runtime devices, `ort` (its CPU execution provider) and `ort:cuda[:ORD]` (its CUDA one), which
run the block graphs themselves (jitllm.runtime.backends.ort); for testing, `sim:N` (a simulated device:
host memory and kernels behind a device's own budget, accepted where JITLLM_SIM_DEVICES=1;
jitllm.runtime.backends.fake).

Sizes are binary: K, M, G, T (with or without `iB`/`B`, any case) are powers of 1024, so `3G` and
`3GiB` are the same 3221225472 bytes; a bare number is bytes; decimals such as `1.5G` are allowed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from jitllm.core.errors import JitllmError
from jitllm.runtime.inventory import BACKENDS, GpuDevice, Inventory

MIB = 1 << 20
MIN_HEADROOM = 256 * MIB
"""Default budgets keep free/8 of a device, at least this much, for the KV cache and scratch."""

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_DIGITS = re.compile(r"[0-9]+")
_KINDS = "auto, all, cpu, gpu[:N], cuda[:ORD], vulkan[:SEL], metal or ort[:cuda[:ORD]]"

Timer = Callable[[GpuDevice | None], float]
"""Seconds one reference kernel takes on a device, None the CPU (lower is faster): jitllm.runtime.auto_timer."""

Remote = Callable[[str, str], GpuDevice]
"""The device a `NODE/DEVICE` entry names on another node of a cluster (spec, entry as written):
jitllm.runtime.cluster.nodes.remote_device, where -cluster joined one."""


@dataclass(frozen=True)
class DeviceChoice:
    """A device picked by -devices with its weight budget.

    `name` is canonical (`cuda:0`, `vulkan:1`, `metal`) and is what plans report; `aliases` holds
    every lower-case name a placement map may use for it: the canonical one, `gpu:N`, and the
    entry as written in -devices (`vulkan:radeon`, `gpu`).
    """

    device: GpuDevice
    name: str
    budget_bytes: int
    explicit_budget: bool
    aliases: frozenset[str]
    shares_budget_of: str | None = None
    """The choice whose budget this one shares: one card named through two APIs (`cuda:0,vulkan:0`, both
    explicit) has one budget, charged by blocks on either view; None: a budget of its own."""


def parse_size(text: str) -> int:
    """Bytes in `3G`, `3GiB`, `512M`, `1.5g` or `800000000` (binary units); JitllmError otherwise."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise JitllmError(f"bad size '{text}'")
    return int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    """`40.0 MiB`, `1.5 GiB`, `512 B`: the unit every plan and listing prints."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def default_budget(free_bytes: int) -> int:
    """Free memory less headroom of an eighth of it, at least 256 MiB."""
    return max(0, free_bytes - max(free_bytes // 8, MIN_HEADROOM))


def hardware_only(text: str) -> bool:
    """Whether every entry of a -devices value takes ranked hardware GPUs only (auto, all, bare gpu, cpu),
    none that names an adapter a software one could be (vulkan:0, gpu:N)."""
    return all(e.partition("=")[0].strip().lower() in ("auto", "all", "gpu", "cpu") for e in text.split(","))


def parse_devices(text: str, inventory: Inventory, vram: str | None = None,
                  timer: Timer | None = None, remote: Remote | None = None) -> list[DeviceChoice]:
    """The devices `text` names, in order, each with a budget; an empty list means the CPU alone.

    `vram` is one budget for every device; an entry's own `=BYTES` wins over it. Unified-memory
    devices draw their default budget from host memory not yet promised to another unified device
    (see `host_budget`). `timer`, when given, ranks devices where there is a choice (`all`, bare `gpu`,
    `cuda`, `vulkan`) and makes `auto` the CPU alone where the CPU runs its kernel no slower than the
    fastest GPU. `remote` resolves `NODE/DEVICE` entries (devices of other nodes of a cluster).
    """
    for flag, value in (("-devices", text), ("-vram", vram)):
        if value is not None and not value.isprintable():
            raise JitllmError(f"{flag} {value!r}: control characters are not allowed")
    shared = None if vram is None else _size(vram, f"-vram {vram}")
    entries = [e.strip() for e in text.split(",")]
    if not any(entries):
        raise JitllmError("-devices is empty: name auto, cpu or a device")
    picks: list[tuple[str, GpuDevice, int | None]] = []
    for entry in entries:
        if not entry:
            raise JitllmError(f"-devices {text.strip()}: empty entry")
        spec, eq, size = entry.partition("=")
        spec = spec.strip()
        own = _size(size, entry) if eq else None
        if spec.lower() in ("auto", "all") and len(entries) > 1:
            raise JitllmError(f"{entry}: {spec.lower()} must be the only -devices entry")
        if spec.lower() == "cpu" and eq:
            raise JitllmError(f"{entry}: the CPU takes no budget")
        for device in _remote(spec, entry, remote) if "/" in spec else _resolve(spec, entry, inventory, timer):
            _check_unique(entry, spec, device, picks)
            picks.append((spec.lower(), device, own))
    return _budgeted(picks, inventory, shared)


def host_budget(inventory: Inventory, choices: list[DeviceChoice]) -> int:
    """Host memory left once unified-memory devices have taken their share (it is the same RAM)."""
    carved = sum(c.budget_bytes for c in choices if c.device.unified and c.shares_budget_of is None)
    return max(0, inventory.cpu.free_bytes - carved)


def _size(text: str, entry: str) -> int:
    try:
        return parse_size(text)
    except JitllmError as e:
        raise JitllmError(f"{entry}: {e}") from None


def _remote(spec: str, entry: str, remote: Remote | None) -> list[GpuDevice]:
    if remote is None:
        raise JitllmError(f"{entry}: {spec.strip()} names a device of another node: join its cluster with -cluster ADDRESS")
    return [remote(spec.strip(), entry)]


def _resolve(spec: str, entry: str, inventory: Inventory, timer: Timer | None) -> list[GpuDevice]:
    kind, colon, sel = spec.partition(":")
    kind = kind.lower()
    hardware = [g for g in inventory.gpus if not g.software and g.unusable is None]
    if not colon and kind == "cpu":
        return []
    if not colon and kind == "auto":
        fastest = _rank(hardware, timer)[:1]
        return [] if fastest and timer is not None and timer(None) <= timer(fastest[0]) else fastest
    if not colon and kind == "all":
        return _rank(hardware, timer)
    if kind == "gpu":
        if not colon:
            if not hardware:
                raise JitllmError(f"{entry}: no GPU on this machine (jitllm hardware lists none)")
            return _rank(hardware, timer)[:1]
        n = _ordinal(sel, entry)
        if n >= len(inventory.gpus):
            raise JitllmError(f"{entry}: no such GPU (jitllm hardware lists {len(inventory.gpus)})")
        return [_usable(inventory.gpus[n], entry)]
    if kind in BACKENDS:
        return [_usable(_by_backend(kind, sel if colon else None, entry, inventory, timer), entry)]
    if kind == "sim":
        return [_simulated(_ordinal(sel, entry) if colon else 0, inventory)]
    if kind == "ort":
        return [_onnx_runtime(sel if colon else "cpu", entry, inventory)]
    raise JitllmError(f"{entry}: unknown device '{spec}' (use {_KINDS})")


def _by_backend(backend: str, sel: str | None, entry: str, inventory: Inventory,
                timer: Timer | None) -> GpuDevice:
    """A backend's view by ordinal or (Vulkan) name substring; bare `cuda`/`vulkan` is the fastest."""
    label = {"cuda": "CUDA device", "vulkan": "Vulkan adapter", "metal": "Metal device"}[backend]
    views = [v for v in inventory.views() if v.backend == backend]
    if sel is None:
        if not views:
            raise JitllmError(f"{entry}: no {label} on this machine")
        return _rank([v for v in views if v.unusable is None] or views, timer)[0]
    if backend == "metal":
        raise JitllmError(f"{entry}: metal takes no selector")
    if _DIGITS.fullmatch(sel.strip()):
        n = int(sel)
        found = [v for v in views if v.ordinal == n]
        if not found:
            raise JitllmError(f"{entry}: no {label} {n} (found {len(views)})")
        return found[0]
    if backend == "cuda":
        raise JitllmError(f"{entry}: bad ordinal '{sel}'")
    found = [v for v in views if sel.strip().lower() in v.name.lower()] if sel.strip() else []
    if not found:
        raise JitllmError(f"{entry}: no {label} matches '{sel}'")
    if len(found) > 1:
        names = ", ".join(f"{v.spec_name} {v.name}" for v in found)
        raise JitllmError(f"{entry}: '{sel}' matches {len(found)} {label}s ({names}); name one by index")
    return found[0]


def _usable(device: GpuDevice, entry: str) -> GpuDevice:
    """`device`, named explicitly, unless blocks cannot run on it (GpuDevice.unusable)."""
    if device.unusable is not None:
        raise JitllmError(f"{entry}: {device.spec_name} cannot run blocks: {device.unusable}")
    return device


def _simulated(n: int, inventory: Inventory) -> GpuDevice:
    """Simulated device N: host memory (its default budget draws on the host's, as unified devices' do)."""
    cpu = inventory.cpu
    return GpuDevice(index=-1 - n, backend="sim", ordinal=n, name="simulated device (host memory and kernels)",
                     total_bytes=cpu.total_bytes, free_bytes=cpu.free_bytes, unified=True, software=True)


def _onnx_runtime(sel: str, entry: str, inventory: Inventory) -> GpuDevice:
    """An ONNX Runtime device: `cpu` (host memory, as unified devices' budgets draw on it) or `cuda[:ORD]`
    (that CUDA device's memory, where the inventory lists it)."""
    provider, _, ordinal = sel.strip().lower().partition(":")
    if provider == "cpu" and not ordinal:
        cpu = inventory.cpu
        return GpuDevice(index=-1000, backend="ort", ordinal=0, name="ONNX Runtime, CPU execution provider",
                         total_bytes=cpu.total_bytes, free_bytes=cpu.free_bytes, unified=True, software=True,
                         spec="ort")
    if provider == "cuda":
        n = _ordinal(ordinal, entry) if ordinal else 0
        card = next((v for v in inventory.views() if v.backend == "cuda" and v.ordinal == n), None)
        if card is None:
            raise JitllmError(f"{entry}: no CUDA device {n} for ONNX Runtime's CUDA execution provider")
        return dataclasses.replace(card, index=-1001 - n, backend="ort", spec=f"ort:cuda:{n}",
                                   name=f"ONNX Runtime, CUDA execution provider on {card.name}")
    raise JitllmError(f"{entry}: unknown ONNX Runtime device '{sel}' (use ort, ort:cpu or ort:cuda[:ORD])")


def _ordinal(sel: str, entry: str) -> int:
    if not _DIGITS.fullmatch(sel.strip()):
        raise JitllmError(f"{entry}: bad index '{sel}'")
    return int(sel)


def _rank(devices: list[GpuDevice], timer: Timer | None) -> list[GpuDevice]:
    """Fastest first: by the timer if there is one, else by bandwidth estimate, with unknown speeds
    ordered discrete before unified and by backend preference."""
    if len(devices) < 2:
        return list(devices)
    if timer is not None:
        times = {d: timer(d) for d in devices}
        return sorted(devices, key=lambda d: (d.software, times[d]))
    return sorted(devices, key=lambda d: (d.software, -d.speed, d.unified, BACKENDS.index(d.backend),
                                          d.index))


def _check_unique(entry: str, spec: str, device: GpuDevice, picks: list[tuple[str, GpuDevice, int | None]]) -> None:
    """A device may be named once; one card may be named once per API where each entry names its API
    (`cuda:0,vulkan:0`: the two views share one budget), never through `gpu:N`, `all` or `auto`."""
    for other_spec, other, _ in picks:
        if other.index != device.index:
            continue
        if other != device and other.backend != device.backend and _names_api(spec) and _names_api(other_spec):
            continue
        same = "" if other == device else f" ({device.spec_name} and {other.spec_name} are one card)"
        raise JitllmError(f"{entry}: {other.spec_name} is already in -devices{same}")


def _names_api(spec: str) -> bool:
    return spec.partition(":")[0].strip().lower() in BACKENDS


def _budgeted(picks: list[tuple[str, GpuDevice, int | None]], inventory: Inventory,
              shared: int | None) -> list[DeviceChoice]:
    host_left = inventory.cpu.free_bytes
    card_size = _card_sizes(picks)
    choices: list[DeviceChoice] = []
    first_of: dict[int, DeviceChoice] = {}
    for spec, device, own in picks:
        lead = first_of.get(device.index) if device.index >= 0 else None
        aliases = {device.spec_name} | ({f"gpu:{device.index}"} if device.index >= 0 and lead is None else set())
        if spec not in ("auto", "all"):
            aliases.add(spec)
        if lead is not None:
            choices.append(DeviceChoice(device, device.spec_name, lead.budget_bytes, lead.explicit_budget,
                                        frozenset(aliases), shares_budget_of=lead.name))
            continue
        budget = card_size.get(device.index, own)
        budget = budget if budget is not None else shared
        explicit = budget is not None
        if budget is None:
            free = min(device.free_bytes, host_left) if device.unified else device.free_bytes
            budget = default_budget(free)
        if device.unified:
            host_left = max(0, host_left - budget)
        choices.append(DeviceChoice(device, device.spec_name, budget, explicit, frozenset(aliases)))
        if device.index >= 0:
            first_of[device.index] = choices[-1]
    return choices


def _card_sizes(picks: list[tuple[str, GpuDevice, int | None]]) -> dict[int, int]:
    """The `=SIZE` of each card named through several APIs: given on one of its entries at most."""
    sizes: dict[int, tuple[str, int]] = {}
    for _, device, own in picks:
        if own is None or device.index < 0:
            continue
        if device.index in sizes:
            raise JitllmError(f"{sizes[device.index][0]} and {device.spec_name} are one card with one budget: "
                              f"give =SIZE on one of them")
        sizes[device.index] = (device.spec_name, own)
    return {index: size for index, (_, size) in sizes.items()}
