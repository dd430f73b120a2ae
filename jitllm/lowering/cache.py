"""Content-addressed cache of compiled block-kind artifacts (DESIGN.md §2, docs/compile-cache.md).

key = sha256(graph bytes, target dict, arch, jitllm version, TVM version, lowering sources, SCHEMA).
An artifact is a directory `<dir>/<target>/<kind>-<key>/` holding its file(s) (`<kind>-<key>.so`) and a
`<kind>-<key>.json` sidecar with the artifact's sha256, so a corrupted artifact is detected, reported and
rebuilt. The directory is written under a temporary name and renamed into place whole, so artifact and
sidecar appear together (two writers cannot leave a mismatched pair). A cache that cannot be written (a
file, a read-only folder) is noticed before compiling: the run compiles into a temporary cache of its
own, removed at exit, with one warning line.
Policy `JITLLM_CACHE`: on (default) | off (never read or write) | redo (rebuild, overwrite) | readonly.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

try:
    import fcntl
except ImportError:  # (Windows: no cross-process compile lock)
    fcntl = None

import tvm

import jitllm
from jitllm.core.atomic import atomic_write, sweep_stale, temp_prefix, umask_mode
from jitllm.core.errors import DeviceFault, JitllmError
from jitllm.core.paths import artifact_cache_dir
from jitllm.ir.blocks import build_block_graph
from jitllm.ir.config import BlockKind
from jitllm.lowering.compile_child import FORKS, Child, run_in_child, start_child
from jitllm.lowering.target import ARTIFACT_SUFFIXES, KERNEL_PACKAGE, ONNX_FILE, SHARED_LIBRARY, Target

SCHEMA = 1
POLICIES = ("on", "off", "redo", "readonly")


def cache_policy() -> str:
    policy = os.environ.get("JITLLM_CACHE", "on").lower()
    if policy not in POLICIES:
        raise JitllmError(f"JITLLM_CACHE={policy!r} is not one of {', '.join(POLICIES)}")
    return policy


FORMAT_SOURCES = {SHARED_LIBRARY: ("__init__.py", "onnx_import.py"),
                  KERNEL_PACKAGE: ("__init__.py", "onnx_import.py", "kernel_package.py"), ONNX_FILE: ()}
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


def artifact_key(kind: BlockKind, target: Target, root: Path | None = None, policy: str | None = None) -> str:
    """sha256 of the kind's ONNX graph and what lowers it (the module docstring). Building the graph
    imports onnx (~0.9 s) and takes milliseconds per kind, so where `root` (a cache's folder) is given
    the key is also kept there (`.keys/`), found again by a digest of everything the graph is built from
    (the kind, jitllm's IR and core sources, the onnx and protobuf versions) and the same metadata, as
    `policy` (default JITLLM_CACHE) allows: read where it reads the cache, written where it writes it."""
    sources = tuple(target.sources) + FORMAT_SOURCES[target.caps.artifact]
    meta = json.dumps({"target": target.cache_key(), "jitllm": jitllm.__version__, "tvm": tvm.__version__,
                       "lowering": _sources_digest(sources), "schema": SCHEMA}, sort_keys=True)
    policy = (policy or cache_policy()) if root is not None else "off"
    memo = root / ".keys" / hashlib.sha256(f"{kind!r}|{_graph_sources()}|{meta}".encode()).hexdigest()[:32] \
        if policy != "off" else None
    if memo is not None and policy != "redo":
        with contextlib.suppress(OSError):
            key = memo.read_text()
            if len(key) == 24 and all(c in "0123456789abcdef" for c in key):
                return key
    h = hashlib.sha256()
    h.update(build_block_graph(kind).SerializeToString())
    h.update(meta.encode())
    key = h.hexdigest()[:24]
    if memo is not None and policy in ("on", "redo"):
        with contextlib.suppress(OSError):  # (a cache that cannot be written just keeps no memo)
            memo.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(memo) as f:
                f.write(key.encode())
    return key


@lru_cache(maxsize=None)
def _graph_sources() -> str:
    """Digest of what a block's ONNX graph is built from besides its kind: jitllm's IR and core sources
    and the onnx and protobuf versions (read without importing them)."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for folder in ("ir", "core"):
        for path in sorted((package / folder).rglob("*.py")):
            h.update(path.relative_to(package).as_posix().encode())
            h.update(path.read_bytes())
    for name in ("onnx", "protobuf"):
        try:
            h.update(f"{name}={version(name)}".encode())
        except PackageNotFoundError:
            h.update(f"{name}=?".encode())
    return h.hexdigest()


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
    """Whether the artifact file `path` matches the sha256 of its sidecar (beside it, in its directory)."""
    try:
        return json.loads(path.with_suffix(".json").read_text())["sha256"] == _file_digest(path)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _family_flag(target: Target) -> str:
    """The compile flag naming the target's kernel family where it is not compile's default."""
    flag = target.caps.kernels_flag
    return "" if flag is None or target.kernels == "fast" else f" -{flag} {target.kernels}"


def _imported(kind: BlockKind, target: Target):
    """The block imported to Relax for `target` (lowering/onnx_import.py)."""
    try:
        from jitllm.lowering.onnx_import import to_relax
    except Exception:  # ImportError, or TVM failing half-way through importing relax without its compiler
        raise JitllmError(
            f"no compiled {kind.kind} artifact for target {target.name} and this TVM has no compiler "
            f"(runtime-only); run `jitllm compile -target {target.name}{_family_flag(target)} MODEL` where TVM is "
            "complete") from None
    return to_relax(kind, build_block_graph(kind), target)


def _write_shared_library(kind: BlockKind, target: Target, dest: Path) -> None:
    def compile_and_export() -> None:
        executable = target.build(_imported(kind, target))
        workspace = dest.parent / "build"  # (the link's objects: inside the temporary directory, never in /tmp)
        workspace.mkdir()
        executable.export_library(str(dest), workspace_dir=str(workspace))
        shutil.rmtree(workspace)

    run_in_child(compile_and_export)  # (SIGTERM and Ctrl-C end the command mid-compile: compile_child.py)


def _write_kernel_package(kind: BlockKind, target: Target, dest: Path) -> None:
    package = target.package(kind, lambda: _imported(kind, target))
    dest.write_text(json.dumps(package, separators=(",", ":")))


def _write_onnx(kind: BlockKind, target: Target, dest: Path) -> None:
    dest.write_bytes(build_block_graph(kind).SerializeToString())


WRITERS = {SHARED_LIBRARY: _write_shared_library, KERNEL_PACKAGE: _write_kernel_package, ONNX_FILE: _write_onnx}
"""Artifact format -> how an artifact of it is written (to a temporary path, renamed into place after)."""


def _build(kind: BlockKind, target: Target, dest: Path, replace: bool) -> None:
    """Write the artifact directory `dest` (holding the file `dest.name + suffix` and its sidecar) under a
    temporary name beside it, then rename it into place. Where `dest` exists, `replace` moves it aside
    first (redo, a corrupt or unloadable artifact); otherwise the directory already there (another
    writer's, just as valid) is kept and this one dropped."""
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(parent, dest.name)  # (directories of compiles that were killed)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(dest.name), dir=parent))
    try:
        artifact = tmp / f"{dest.name}{ARTIFACT_SUFFIXES[target.caps.artifact]}"
        WRITERS[target.caps.artifact](kind, target, artifact)
        sidecar = {"sha256": _file_digest(artifact), "kind": kind.kind, "target": target.cache_key()}
        artifact.with_suffix(".json").write_text(json.dumps(sidecar))
        for f in tmp.iterdir():
            os.chmod(f, f.stat().st_mode | umask_mode(0o444))  # (group-readable where the umask allows it)
        os.chmod(tmp, umask_mode(0o777))  # (mkdtemp makes it 0700)
        _publish(tmp, dest, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, dest: Path, replace: bool) -> None:
    """Rename the directory `tmp` to `dest`. A directory at `dest` is always whole (it got there by such a
    rename), so where another writer's lands first (a rename onto a non-empty directory fails), it is kept."""
    old = Path(tempfile.mkdtemp(prefix=temp_prefix(dest.name), suffix=".old", dir=dest.parent)) if replace else None
    try:
        if old is not None:
            with contextlib.suppress(FileNotFoundError):  # (nothing there, or another writer moved it first)
                os.rename(dest, old)
        os.rename(tmp, dest)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


@lru_cache(maxsize=None)
def process_cache() -> Path:
    """This process's own temporary cache (JITLLM_CACHE=off or readonly, and a cache that cannot be written),
    removed at exit (also after SIGTERM: jitllm.core.termination); those of killed processes are swept."""
    base = Path(tempfile.gettempdir())
    sweep_stale(base, "jitllm-cache")
    path = Path(tempfile.mkdtemp(prefix=temp_prefix("jitllm-cache"), dir=base))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _unwritable(directory: Path) -> str | None:
    """Why no artifact can be written in `directory` (made if missing), or None where one can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except FileExistsError:
        return "not a directory"
    except OSError as e:
        return e.strerror or str(e)
    return None


_WARNED: set[Path] = set()
"""Cache folders this process has said it cannot write (once each)."""


def _warn_unwritable(root: Path, reason: str, log: Callable[[str], None]) -> None:
    if root not in _WARNED:
        _WARNED.add(root)
        log(f"cache: cannot write {root} ({reason}); compiling into a temporary cache for this run")


def get_artifact(kind: BlockKind, target: Target, cache_dir: Path | None = None, policy: str | None = None,
                 log=None, rebuild: bool = False) -> Artifact:
    """The artifact of `kind` for `target`, compiled now if the cache lacks it (reported through `log`);
    `rebuild`: compiled again even where the cache has it (it did not load)."""
    policy = policy or cache_policy()
    root = Path(cache_dir) if cache_dir is not None else artifact_cache_dir()
    key = artifact_key(kind, target, root, policy)
    name = f"{kind.kind}-{key}"
    file_name = f"{name}{ARTIFACT_SUFFIXES[target.caps.artifact]}"
    dest = root / target.name / name
    if policy in ("on", "readonly") and not rebuild and (dest / file_name).exists():
        if _valid(dest / file_name):
            return Artifact(kind.kind, key, dest / file_name, False, 0.0)
        if log:
            log(f"cache: {dest / file_name} is corrupt; rebuilding it")
    if policy == "off":
        dest = Path(tempfile.mkdtemp(dir=process_cache())) / target.name / name
    elif policy == "readonly" or (reason := _unwritable(dest.parent)) is not None:
        if policy != "readonly":
            _warn_unwritable(root, reason, log or stderr_log)
        dest = process_cache() / target.name / name
        if not rebuild and _valid(dest / file_name):
            return Artifact(kind.kind, key, dest / file_name, False, 0.0)
    start = time.perf_counter()
    try:
        with _compiling(root, dest) as waited:
            if waited and policy == "on" and not rebuild and _valid(dest / file_name):
                return Artifact(kind.kind, key, dest / file_name, False, 0.0)  # (the writer we waited for)
            _build(kind, target, dest, replace=policy == "redo" or rebuild or dest.exists())
    except OSError as e:
        raise JitllmError(f"cannot write the compile cache at {dest.parent}: {e.strerror or e}") from None
    seconds = time.perf_counter() - start
    if log:
        log(f"compiled {kind.kind} for {target.name} in {seconds:.1f}s -> {dest / file_name}")
    return Artifact(kind.kind, key, dest / file_name, True, seconds)


def _dest(kind: BlockKind, target: Target, cache_dir: Path | None) -> tuple[Path, Path]:
    """(the cache's root, the artifact file of `kind` for `target` there)."""
    root = Path(cache_dir) if cache_dir is not None else artifact_cache_dir()
    name = f"{kind.kind}-{artifact_key(kind, target, root)}"
    return root, root / target.name / name / f"{name}{ARTIFACT_SUFFIXES[target.caps.artifact]}"


def is_cached(kind: BlockKind, target: Target, cache_dir: Path | None = None) -> bool:
    """Whether the cache holds a sound artifact of `kind` for `target` that this run would load as it is
    (JITLLM_CACHE on or readonly)."""
    return cache_policy() in ("on", "readonly") and _valid(_dest(kind, target, cache_dir)[1])


def compiles_in_background(target: Target, cache_dir: Path | None = None) -> bool:
    """Whether artifacts for `target` can be compiled by background processes into the cache (Linux; the
    cache read and written, JITLLM_CACHE=on, and writable): what they write is what a later load finds."""
    root = Path(cache_dir) if cache_dir is not None else artifact_cache_dir()
    return FORKS and cache_policy() == "on" and _unwritable(root / target.name) is None


@dataclass
class BackgroundCompile:
    """An artifact compiling in a child process of its own (compile_in_background)."""

    kind: BlockKind
    child: Child
    directory: Path
    """Its artifact's directory (a killed compile's temporary ones are beside it, swept by `stop`)."""
    started: float

    def stop(self) -> None:
        """Kill the compile (and its link step) and remove what it had half written."""
        self.child.kill()
        sweep_stale(self.directory.parent, self.directory.name)


def compile_in_background(kind: BlockKind, target: Target, cache_dir: Path | None = None) -> BackgroundCompile:
    """Start compiling the artifact of `kind` for `target` into the cache in a child process (the compile
    lock makes a second process needing it wait for this one); poll `.child`, then load it from the cache."""
    _, path = _dest(kind, target, cache_dir)
    child = start_child(lambda: get_artifact(kind, target, cache_dir, policy="on"))
    return BackgroundCompile(kind, child, path.parent, time.perf_counter())


@contextlib.contextmanager
def _compiling(root: Path, dest: Path):
    """Hold the cache's lock for artifact `dest` while it is compiled, so that two processes needing it
    (a server and a run, test workers) compile it once: the second waits, then finds it. Yields whether it
    had to wait (True), did not (None: nobody else was compiling), or `dest` is not under `root` (None: a
    temporary cache, this process's alone)."""
    if fcntl is None or root not in dest.parents:  # (fcntl: POSIX only)
        yield None
        return
    locks = root / ".locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{dest.parent.name}-{dest.name}", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = None
        except BlockingIOError:
            fcntl.flock(lock, fcntl.LOCK_EX)
            waited = True
        yield waited  # (released when the file closes)


Loaded = TypeVar("Loaded")


def load_artifact(kind: BlockKind, target: Target, load: Callable[[Path], Loaded], cache_dir: Path | None = None,
                  log=None) -> Loaded:
    """`load(path)` of the artifact of `kind`; one that does not load though its sidecar matches (a library
    built against another TVM, a truncated write the sidecar was made from) is compiled again, once."""
    artifact = get_artifact(kind, target, cache_dir, log=log)
    try:
        return load(artifact.path)
    except DeviceFault:
        raise  # (the device failed, not the artifact)
    except JitllmError as e:
        if artifact.built:
            raise
        (log or stderr_log)(f"cache: {e}; rebuilding it")
    return load(get_artifact(kind, target, cache_dir, log=log, rebuild=True).path)


def stderr_log(message: str) -> None:
    print(f"jitllm: {message}", file=sys.stderr, flush=True)
