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
from jitllm.ir.blocks import build_block_graph
from jitllm.ir.config import BlockKind
from jitllm.lowering.target import ARTIFACT_SUFFIXES, ONNX_FILE, SHARED_LIBRARY, Target

SCHEMA = 1
POLICIES = ("on", "off", "redo", "readonly")


def cache_policy() -> str:
    policy = os.environ.get("JITLLM_CACHE", "on").lower()
    if policy not in POLICIES:
        raise JitllmError(f"JITLLM_CACHE={policy!r} is not one of {', '.join(POLICIES)}")
    return policy


FORMAT_SOURCES = {SHARED_LIBRARY: ("__init__.py", "onnx_import.py"), ONNX_FILE: ()}
"""What every artifact of a format is generated from, beside its target's own sources."""


@lru_cache(maxsize=None)
def _sources_digest(names: tuple[str, ...]) -> str:
    """Digest of the lowering sources (files, and every .py file of folders) a target's artifacts are
    generated from (its own kernels plus its format's shared import), so editing one target's kernels
    does not invalidate another target's artifacts."""
    root = Path(__file__).parent
    files = set()
    for name in names:
        path = root / name
        files |= set(path.rglob("*.py")) if path.is_dir() else {path}
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def artifact_key(kind: BlockKind, target: Target) -> str:
    h = hashlib.sha256()
    h.update(build_block_graph(kind).SerializeToString())
    sources = tuple(target.sources) + FORMAT_SOURCES[target.caps.artifact]
    meta = {"target": target.cache_key(), "jitllm": jitllm.__version__, "tvm": tvm.__version__,
            "lowering": _sources_digest(sources), "schema": SCHEMA}
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


def _family_flag(target: Target) -> str:
    """The compile flag naming the target's kernel family where it is not compile's default."""
    flag = target.caps.kernels_flag
    return "" if flag is None or target.kernels == "fast" else f" -{flag} {target.kernels}"


def _write_shared_library(kind: BlockKind, target: Target, dest: Path) -> None:
    try:
        from jitllm.lowering.onnx_import import to_relax
    except Exception:  # ImportError, or TVM failing half-way through importing relax without its compiler
        raise JitllmError(
            f"no compiled {kind.kind} artifact for target {target.name} and this TVM has no compiler "
            f"(runtime-only); run `jitllm compile -target {target.name}{_family_flag(target)} MODEL` where TVM is "
            "complete") from None
    executable = target.build(to_relax(kind, build_block_graph(kind), target))
    executable.export_library(str(dest))


def _write_onnx(kind: BlockKind, target: Target, dest: Path) -> None:
    dest.write_bytes(build_block_graph(kind).SerializeToString())


WRITERS = {SHARED_LIBRARY: _write_shared_library, ONNX_FILE: _write_onnx}
"""Artifact format -> how an artifact of it is written (to a temporary path, renamed into place after)."""


def _build(kind: BlockKind, target: Target, dest: Path) -> None:
    suffix = ARTIFACT_SUFFIXES[target.caps.artifact]
    with atomic_path(dest, suffix) as tmp:
        WRITERS[target.caps.artifact](kind, target, tmp)
        digest = _file_digest(tmp)
    with atomic_write(dest.with_suffix(".json"), ".json") as f:
        f.write(json.dumps({"sha256": digest, "kind": kind.kind, "target": target.cache_key()}).encode())


def get_artifact(kind: BlockKind, target: Target, cache_dir: Path | None = None, policy: str | None = None,
                 log=None) -> Artifact:
    """The artifact of `kind` for `target`, compiled now if the cache lacks it (reported through `log`)."""
    policy = policy or cache_policy()
    root = Path(cache_dir) if cache_dir is not None else artifact_cache_dir()
    key = artifact_key(kind, target)
    path = root / target.name / f"{kind.kind}-{key}{ARTIFACT_SUFFIXES[target.caps.artifact]}"
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
