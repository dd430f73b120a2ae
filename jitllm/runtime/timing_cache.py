"""The machine's cache of `auto`'s kernel timings: one small JSON file per machine and timed kernel under
the jitllm home (`<home>/auto/<key>.json`), the key a digest of what the timings depend on (the hardware
inventory, the CPU workers, the kernel families, the kernel's shape, jitllm's version). Written whole
(atomically); a file that does not parse or does not hold what its key says is ignored and rewritten."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from jitllm.core.atomic import atomic_write
from jitllm.core.errors import JitllmError
from jitllm.core.paths import home_dir


def timing_path(material: dict, root: Path | None = None) -> Path:
    """Where the timings of `material` (plain JSON data naming the machine and the kernel) are kept."""
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]
    return (root if root is not None else home_dir() / "auto") / f"{key}.json"


def read_timings(path: Path, material: dict) -> tuple[dict[str, float], str | None]:
    """Seconds per call by device name from `path`, and what was wrong with the file where it could not be
    used (None: it was fine, or there is none yet: nothing timed on this machine)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as e:
        return {}, f"cannot read {path} ({e}); timing again"
    seconds = data.get("seconds") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or data.get("material") != material or not isinstance(seconds, dict)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)
                       for v in seconds.values())):
        return {}, f"{path} does not hold this machine's timings; timing again"
    return {str(k): float(v) for k, v in seconds.items()}, None


def write_timings(path: Path, material: dict, seconds: dict[str, float]) -> str | None:
    """Write the timings (whole, atomically); None, or why they could not be kept (the run goes on)."""
    kept = {k: v for k, v in seconds.items() if math.isfinite(v)}  # (a device that failed is tried again next run)
    body = json.dumps({"material": material, "seconds": kept}, indent=1, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:
            f.write(body.encode())
    except (OSError, JitllmError) as e:
        return f"cannot write {path}: {getattr(e, 'strerror', None) or e}"
    return None
