"""wgpu adapters by the -devices name the inventory gave them (`vulkan:N`, `metal`), opened once per
process with the features and limits the webgpu target's kernels need."""

from __future__ import annotations

from functools import lru_cache

from jitllm.core.errors import JitllmError
from jitllm.runtime.inventory import WGPU_FEATURES, quiet_stderr, wgpu_adapters

LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage",
          "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup")
"""Limits asked for at the adapter's own maximum (WebGPU's defaults are lower: 128 MiB bindings, 8 buffers)."""
OPTIONAL_FEATURES = ("timestamp-query",)
"""Features asked for where the adapter has them: timestamp queries let a profile (wgpu_profile.py) time
each dispatch on the device; enabling them changes nothing the decode path encodes."""


@lru_cache(maxsize=None)
def open_adapter(api: str, ordinal: int, device_name: str):
    """(adapter, device) of the `ordinal`-th `api` ("vulkan", "metal") adapter in the inventory's order."""
    found = [a for a, backend in wgpu_adapters() if backend == api]
    if ordinal >= len(found):
        raise JitllmError(f"{device_name}: no such {api} adapter (wgpu finds {len(found)})")
    adapter = found[ordinal]
    missing = [f for f in WGPU_FEATURES if f not in adapter.features]
    if missing:
        raise JitllmError(f"{device_name}: the adapter lacks {', '.join(missing)}, which the webgpu kernels need")
    limits = {name: adapter.limits[name] for name in LIMITS if name in adapter.limits}
    with quiet_stderr():
        features = [*WGPU_FEATURES, *(f for f in OPTIONAL_FEATURES if f in adapter.features)]
        device = adapter.request_device_sync(required_features=features, required_limits=limits)
    return adapter, device
