"""What this host has: GPUs (one entry per physical card, whatever backends reach it) and the CPU.

Detection never fails: a backend whose library or driver is missing contributes no devices, and a
machine with no GPU is simply a CPU machine. Tests build an Inventory by hand with
`Inventory.from_views` and `CpuInfo(...)`, so nothing below needs real hardware to be exercised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from jitllm.runtime.vulkan_ids import VulkanCard, vulkan_cards

BACKENDS = ("cuda", "metal", "vulkan")
"""Backend preference when one card answers to several: CUDA, then Metal, then Vulkan."""

KERNEL_FEATURES = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
    "asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2",
)
"""CPU flags that decide which kernels can run (the rest of /proc/cpuinfo's flags are noise here)."""


@dataclass(frozen=True)
class GpuDevice:
    """One backend's view of one GPU.

    `index` is the card's position in `jitllm hardware` (what `gpu:N` names); two views of the same
    card share it. `ordinal` is the backend's own number (`cuda:ORD`, `vulkan:N`). `speed` is an
    estimate of memory bandwidth in GB/s, 0 when unknown. `software` marks CPU implementations of a
    backend (llvmpipe/lavapipe): listed and selectable by name, never picked by auto/all/gpu.
    """

    index: int
    backend: str
    ordinal: int
    name: str
    total_bytes: int
    free_bytes: int
    uuid: str | None = None
    pci_bus: str | None = None
    unified: bool = False
    speed: float = 0.0
    software: bool = False
    spec: str | None = None
    """Its -devices name where that is not `backend:ordinal` (ONNX Runtime's `ort`, `ort:cuda:0`)."""
    unusable: str | None = None
    """Why blocks cannot run on it (a wgpu adapter without a feature the kernels need), None where they
    can: listed and refused with this reason when named, never picked by auto/all/gpu."""

    @property
    def spec_name(self) -> str:
        """The canonical device name used in -devices, placement maps and plans: `cuda:0`, `metal`."""
        if self.spec is not None:
            return self.spec
        return "metal" if self.backend == "metal" else f"{self.backend}:{self.ordinal}"


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as the worker pool sees it; all core lists are logical CPU ids inside the process mask.

    `performance_cores` holds one CPU per physical performance core (where workers run);
    `hyperthread_siblings` the other threads of those cores and `efficiency_cores` the E-cores,
    both left alone for decode. `numa_nodes` maps node id to its CPUs. `free_bytes` is available RAM.
    """

    model: str
    performance_cores: list[int]
    hyperthread_siblings: list[int]
    efficiency_cores: list[int]
    numa_nodes: dict[int, list[int]]
    cpu_mask: list[int]
    total_bytes: int
    free_bytes: int
    features: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Inventory:
    """Distinct GPUs (fastest backend view of each card) plus the views deduplicated away."""

    gpus: list[GpuDevice]
    cpu: CpuInfo
    other_backends: list[GpuDevice] = field(default_factory=list)

    @classmethod
    def from_views(cls, views: list[GpuDevice], cpu: CpuInfo) -> Inventory:
        """Number the cards and fold views that share a UUID into one, keeping the preferred backend.

        The `index` of the given views is ignored; each returned view carries its card's index.
        """
        cards: list[list[GpuDevice]] = []
        by_uuid: dict[str, list[GpuDevice]] = {}
        for view in sorted(views, key=lambda v: (BACKENDS.index(v.backend), v.ordinal)):
            if view.uuid is not None and view.uuid in by_uuid:
                by_uuid[view.uuid].append(view)
                continue
            cards.append([view])
            if view.uuid is not None:
                by_uuid[view.uuid] = cards[-1]
        gpus, others = [], []
        for index, (first, *rest) in enumerate(cards):
            gpus.append(dataclasses.replace(first, index=index))
            others.extend(dataclasses.replace(v, index=index) for v in rest)
        return cls(gpus=gpus, cpu=cpu, other_backends=others)

    def views(self) -> list[GpuDevice]:
        """Every backend view of every card, listed ones first."""
        return self.gpus + self.other_backends

    def to_dict(self) -> dict:
        """Plain data for `jitllm hardware -json`; each view also carries its -devices name."""
        data = dataclasses.asdict(self)
        for key in ("gpus", "other_backends"):
            for view, d in zip(getattr(self, key), data[key]):
                d["spec_name"] = view.spec_name
        return data


def detect_inventory(software: bool = True) -> Inventory:
    """Probe CUDA (NVML), Vulkan and Metal (wgpu) and the CPU of this process. `software=False`: the
    caller takes hardware GPUs only (-devices auto, all, gpu), so wgpu is not asked where no GPU device
    node exists (`gpu_nodes`): there it finds software adapters alone (llvmpipe), and asking costs ~1.2 s
    (the parse of its C header, the enumeration) of every run's start."""
    cpu = detect_cpu()
    cuda = _cuda_views()
    wgpu_views = _wgpu_views(cpu) if software or gpu_nodes() else []
    vulkan = _adopt_identity([v for v in wgpu_views if v[0].backend == "vulkan"], cuda)
    metal = [v for v, _ in wgpu_views if v.backend == "metal"]
    return Inventory.from_views([v for v, _ in cuda] + vulkan + metal, cpu)


GPU_NODES = ("dri/renderD*", "nvidia[0-9]*", "dxg")
"""Device nodes (under /dev) a hardware GPU's driver makes on Linux: a DRM render node (Mesa's Vulkan
drivers, amdgpu, i915), NVIDIA's own, WSL's GPU paravirtualisation."""


def gpu_nodes(dev: str = "/dev") -> bool:
    """Whether this machine may have a hardware GPU (on Linux: one of GPU_NODES exists; elsewhere: yes)."""
    if not sys.platform.startswith("linux"):
        return True
    root = Path(dev)
    return any(next(root.glob(pattern), None) is not None for pattern in GPU_NODES)


# ---- CUDA through NVML ---------------------------------------------------------------------------

def _cuda_views() -> list[tuple[GpuDevice, int]]:
    """CUDA devices with their PCI id ((device << 16) | vendor), honouring CUDA_VISIBLE_DEVICES."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        handles = _visible(handles, [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles])
        views = []
        for ordinal, handle in enumerate(handles):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            view = GpuDevice(
                index=-1, backend="cuda", ordinal=ordinal,
                name=_text(pynvml.nvmlDeviceGetName(handle)),
                total_bytes=int(memory.total), free_bytes=int(memory.free),
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)), pci_bus=_text(pci.busId).lower(),
                speed=_nvml_bandwidth(pynvml, handle),
            )
            views.append((view, int(pci.pciDeviceId)))
        return views
    except pynvml.NVMLError:
        return []
    finally:
        pynvml.nvmlShutdown()


def _visible(handles: list, uuids: list[str]) -> list:
    """Apply CUDA_VISIBLE_DEVICES (indices or UUID prefixes) so ordinals match the CUDA runtime's."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return handles
    chosen = []
    for item in (s.strip() for s in spec.split(",")):
        if re.fullmatch("[0-9]+", item) and int(item) < len(handles):
            chosen.append(handles[int(item)])
        else:
            hits = [h for h, u in zip(handles, uuids) if item and u.startswith(item)]
            if len(hits) != 1:
                break  # the CUDA runtime stops at the first entry it cannot resolve
            chosen.append(hits[0])
    return chosen


def _nvml_bandwidth(pynvml, handle) -> float:
    """Peak memory bandwidth in GB/s from the memory clock and bus width (double data rate)."""
    try:
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
    except pynvml.NVMLError:
        return 0.0
    return clock_mhz * 1e6 * 2 * bus_bits / 8 / 1e9


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ---- Vulkan and Metal through wgpu ---------------------------------------------------------------

WGPU_FEATURES = ("shader-f16",)
"""wgpu features the webgpu target's kernels need (f16 weight scales; runtime/backends/wgpu_adapters.py)."""


@contextlib.contextmanager
def quiet_stderr():
    """Vulkan drivers print setup chatter (XDG_RUNTIME_DIR, ICD probing) straight to fd 2."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_ADAPTERS: list | None = None


def wgpu_adapters() -> list:
    """(adapter, backend) of every Vulkan adapter (and Metal on macOS) in wgpu's order, enumerated once per
    process (the -devices ordinals `vulkan:N` count these); none where wgpu or its driver is missing."""
    global _ADAPTERS
    if _ADAPTERS is None:
        try:
            with quiet_stderr():
                import wgpu

                adapters = wgpu.gpu.enumerate_adapters_sync()
        except Exception:  # a missing or broken native driver must not stop detection
            adapters = []
        _ADAPTERS = []
        for adapter in adapters:
            backend = str(adapter.info.get("backend_type", "")).lower()
            if backend == "vulkan" or (backend == "metal" and sys.platform == "darwin"):
                _ADAPTERS.append((adapter, backend))
    return _ADAPTERS


def _wgpu_views(cpu: CpuInfo) -> list[tuple[GpuDevice, int]]:
    """Vulkan adapters (and Metal on macOS) in wgpu's order, each with its PCI id."""
    views, ordinals = [], {"vulkan": 0, "metal": 0}
    for adapter, backend in wgpu_adapters():
        info = adapter.info
        missing = [f for f in WGPU_FEATURES if f not in adapter.features]
        kind = str(info.get("adapter_type", ""))
        shared = kind in ("IntegratedGPU", "CPU") or (backend == "metal" and kind != "DiscreteGPU")
        view = GpuDevice(
            index=-1, backend=backend, ordinal=ordinals[backend],
            name=str(info.get("device") or info.get("description") or "unknown adapter"),
            total_bytes=cpu.total_bytes if shared else 0, free_bytes=cpu.free_bytes if shared else 0,
            unified=shared, software=kind == "CPU",
            unusable=f"the adapter lacks {', '.join(missing)}, which the webgpu kernels need" if missing else None,
        )
        ordinals[backend] += 1
        views.append((view, (int(info.get("device_id", 0)) << 16) | int(info.get("vendor_id", 0))))
    return views


def _adopt_identity(vulkan: list[tuple[GpuDevice, int]], cuda: list[tuple[GpuDevice, int]],
                    drm_root: str = "/sys/class/drm", cards: tuple[VulkanCard, ...] | None = None) -> list[GpuDevice]:
    """Give Vulkan views the UUID, bus and memory of the card they are.

    Each wgpu adapter is matched to the Vulkan physical device with its PCI id (the n-th adapter of an id to
    the n-th device of it: wgpu enumerates in Vulkan's order) and takes Vulkan's own UUID and device-local
    memory (`cards`, default vulkan_ids.vulkan_cards()); a CUDA device with that UUID lends its identity
    (bus, memory, bandwidth), so the two views fold into one card. A DRM card of the same PCI id (amdgpu)
    gives the bus and the VRAM in use. Where Vulkan cannot be read, an adapter is paired with the n-th CUDA
    device (else DRM card) of its PCI id, in enumeration order.
    """
    if cards is None:
        cards = vulkan_cards() if vulkan else ()
    cards = list(cards)
    drm = _drm_cards(drm_root)
    by_uuid = {_bare_uuid(view.uuid): i for i, (view, _) in enumerate(cuda) if view.uuid}
    taken: set[int] = set()
    out = []
    for view, pci_id in vulkan:
        card = next((c for c in cards if c.pci_id == pci_id), None)
        if card is not None:
            cards.remove(card)
        if view.unified:
            out.append(view if card is None else dataclasses.replace(view, uuid=card.uuid))
            continue
        if card is not None:
            same = [by_uuid[card.uuid]] if card.uuid in by_uuid else []
        else:
            same = [i for i, (_, p) in enumerate(cuda) if p == pci_id and i not in taken]
        if same:
            taken.add(same[0])
            twin = cuda[same[0]][0]
            out.append(dataclasses.replace(
                view, uuid=twin.uuid, pci_bus=twin.pci_bus, total_bytes=twin.total_bytes,
                free_bytes=twin.free_bytes, speed=twin.speed))
            continue
        if card is not None:
            free = card.local_bytes if card.budget_bytes is None else min(card.budget_bytes, card.local_bytes)
            view = dataclasses.replace(view, uuid=card.uuid, total_bytes=card.local_bytes, free_bytes=free)
        match = next((c for c in drm if c[0] == pci_id), None)
        if match is not None:
            drm.remove(match)
            _, bus, total, used = match
            view = dataclasses.replace(view, pci_bus=bus, total_bytes=total, free_bytes=total - used)
        out.append(view)
    return out


def _bare_uuid(uuid: str) -> str:
    """NVML's `GPU-xxxxxxxx-...` as Vulkan's deviceUUID reads (vulkan_ids.uuid_text)."""
    return uuid.removeprefix("GPU-").lower()


def _drm_cards(root: str) -> list[tuple[int, str, int, int]]:
    """(PCI id, bus, VRAM total, VRAM used) for each DRM card whose driver reports VRAM (amdgpu)."""
    cards = []
    for card in sorted(Path(root).glob("card[0-9]*")):
        dev = card / "device"
        try:
            pci_id = (int(_read(dev / "device"), 16) << 16) | int(_read(dev / "vendor"), 16)
            total, used = int(_read(dev / "mem_info_vram_total")), int(_read(dev / "mem_info_vram_used"))
        except (OSError, ValueError):
            continue
        cards.append((pci_id, dev.resolve().name, total, used))
    return cards


# ---- CPU --------------------------------------------------------------------------------------

def detect_cpu(root: str = "/", mask: list[int] | None = None) -> CpuInfo:
    """Read the CPU from procfs/sysfs under `root` (tests point it at a fake tree)."""
    base = Path(root)
    cpuinfo = _read(base / "proc/cpuinfo", "")
    mask = sorted(mask if mask is not None else os.sched_getaffinity(0))
    efficiency = _efficiency_cpus(base, mask)
    performance, siblings = [], []
    seen_cores: set[tuple[int, ...]] = set()
    for cpu in mask:
        if cpu in efficiency:
            continue
        core = tuple(parse_cpu_list(_read(
            base / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", str(cpu))))
        (siblings if core in seen_cores else performance).append(cpu)
        seen_cores.add(core)
    memory = psutil.virtual_memory()
    return CpuInfo(
        model=_cpuinfo_model(cpuinfo),
        performance_cores=performance,
        hyperthread_siblings=siblings,
        efficiency_cores=sorted(efficiency),
        numa_nodes=_numa_nodes(base),
        cpu_mask=mask,
        total_bytes=int(memory.total),
        free_bytes=int(memory.available),
        features=_features(cpuinfo),
    )


def _efficiency_cpus(base: Path, mask: list[int]) -> set[int]:
    """E-cores: Intel hybrid parts list them as the `cpu_atom` PMU; ARM big.LITTLE gives them a
    lower `cpu_capacity` than the big cores."""
    atom = _read(base / "sys/devices/cpu_atom/cpus", "")
    if atom:
        return set(parse_cpu_list(atom)) & set(mask)
    capacity = {}
    for cpu in mask:
        value = _read(base / f"sys/devices/system/cpu/cpu{cpu}/cpu_capacity", "")
        if re.fullmatch("[0-9]+", value):
            capacity[cpu] = int(value)
    if not capacity:
        return set()
    top = max(capacity.values())
    return {cpu for cpu, c in capacity.items() if c < top}


def _numa_nodes(base: Path) -> dict[int, list[int]]:
    nodes = {}
    for node in (base / "sys/devices/system/node").glob("node[0-9]*"):
        nodes[int(node.name[4:])] = parse_cpu_list(_read(node / "cpulist", ""))
    return dict(sorted(nodes.items()))


def _cpuinfo_model(cpuinfo: str) -> str:
    for key in ("model name", "Model", "Hardware", "cpu model"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
        if m:
            return m.group(1).strip()
    return "unknown CPU"


def _features(cpuinfo: str) -> list[str]:
    m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    present = set(m.group(1).split()) if m else set()
    return [f for f in KERNEL_FEATURES if f in present]


def parse_cpu_list(text: str) -> list[int]:
    """Parse the kernel's CPU list format: `0-3,8,10-11`."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpu_list(cpus: list[int]) -> str:
    """The inverse of parse_cpu_list: `[0, 1, 2, 5]` -> `0-2,5`."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _read(path: Path, default: str | None = None) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        if default is None:
            raise
        return default
