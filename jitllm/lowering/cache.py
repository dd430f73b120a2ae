"""Content-addressed cache of compiled block-kind artifacts (DESIGN.md §2).

key = sha256(graph bytes, target dict, arch, jitllm version, TVM version, lowering sources, SCHEMA).
An artifact is `<dir>/<target>/<kind>-<key>.so` plus a `.json` sidecar holding the .so's sha256, so a
corrupted artifact is detected, reported and rebuilt. Writes are temp file + os.replace.
Policy `JITLLM_CACHE`: on (default) | off (never read or write) | redo (rebuild, overwrite) | readonly.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import tvm

import jitllm
from jitllm.core.atomic import atomic_path, atomic_write
from jitllm.core.errors import JitllmError
from jitllm.core.paths import artifact_cache_dir
from jitllm.ir.config import BlockKind
from jitllm.ir.llama import build_block_graph

SCHEMA = 1
POLICIES = ("on", "off", "redo", "readonly")


def cache_policy() -> str:
    policy = os.environ.get("JITLLM_CACHE", "on").lower()
    if policy not in POLICIES:
        raise JitllmError(f"JITLLM_CACHE={policy!r} is not one of {', '.join(POLICIES)}")
    return policy


COMMON_SOURCES = ("__init__.py", "onnx_import.py", "kernels_pages.py")


@lru_cache(maxsize=None)
def _sources_digest(names: tuple[str, ...]) -> str:
    """Digest of the lowering sources a target's artifacts are generated from (its own kernels plus the
    shared import), so editing one target's kernels does not invalidate another target's artifacts."""
    h = hashlib.sha256()
    for name in sorted(set(COMMON_SOURCES + names)):
        h.update(name.encode())
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()


def artifact_key(kind: BlockKind, target) -> str:
    h = hashlib.sha256()
    h.update(build_block_graph(kind).SerializeToString())
    meta = {"target": target.cache_key(), "jitllm": jitllm.__version__, "tvm": tvm.__version__,
            "lowering": _sources_digest(tuple(target.sources)), "schema": SCHEMA}
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()[:24]


@dataclass(frozen=True)
class Artifact:
    kind: str
    key: str
    path: Path
    built: bool
    seconds: float


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _valid(path: Path) -> bool:
    sidecar = path.with_suffix(".json")
    try:
        return json.loads(sidecar.read_text())["sha256"] == _file_digest(path)
    except (OSError, ValueError, KeyError):
        return False


def _family_flag(target) -> str:
    """The compile flag naming the target's kernel family where it is not compile's default."""
    kernels = getattr(target, "kernels", "fast")
    return "" if kernels == "fast" else f" -{'cpu' if target.name == 'llvm' else 'gpu'}-kernels {kernels}"


def _build(kind: BlockKind, target, dest: Path) -> None:
    try:
        from jitllm.lowering.onnx_import import to_relax
    except Exception:  # ImportError, or TVM failing half-way through importing relax without its compiler
        raise JitllmError(
            f"no compiled {kind.kind} artifact for target {target.name} and this TVM has no compiler "
            f"(runtime-only); run `jitllm compile -target {target.name}{_family_flag(target)} MODEL` where TVM is "
            "complete") from None
    executable = target.build(to_relax(kind, build_block_graph(kind), target))
    with atomic_path(dest, ".so") as tmp:
        executable.export_library(str(tmp))
        digest = _file_digest(tmp)
    with atomic_write(dest.with_suffix(".json"), ".json") as f:
        f.write(json.dumps({"sha256": digest, "kind": kind.kind, "target": target.cache_key()}).encode())


def get_artifact(kind: BlockKind, target, cache_dir: Path | None = None, policy: str | None = None,
                 log=None) -> Artifact:
    """The artifact of `kind` for `target`, compiled now if the cache lacks it (reported through `log`)."""
    policy = policy or cache_policy()
    root = Path(cache_dir) if cache_dir is not None else artifact_cache_dir()
    key = artifact_key(kind, target)
    path = root / target.name / f"{kind.kind}-{key}.so"
    if policy == "off":
        path = Path(tempfile.mkdtemp(prefix="jitllm-nocache-")) / path.name
    elif policy in ("on", "readonly") and path.exists():
        if _valid(path):
            return Artifact(kind.kind, key, path, False, 0.0)
        if log:
            log(f"cache: {path} is corrupt; rebuilding it")
    if policy == "readonly":
        path = Path(tempfile.mkdtemp(prefix="jitllm-readonly-")) / path.name
    start = time.perf_counter()
    try:
        _build(kind, target, path)
    except OSError as e:
        raise JitllmError(f"cannot write the compile cache at {root}: {e.strerror or e}") from None
    seconds = time.perf_counter() - start
    if log:
        log(f"compiled {kind.kind} for {target.name} in {seconds:.1f}s -> {path}")
    return Artifact(kind.kind, key, path, True, seconds)


def stderr_log(message: str) -> None:
    print(f"jitllm: {message}", file=sys.stderr, flush=True)
